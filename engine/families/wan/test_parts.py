"""Wan blocks in parts (``parts.py``) against diffusers 0.42.1's own ``WanTransformerBlock.forward``: the three
parts run one after the other, each under its own checkpoint as the engine streams them, give the block's output,
the gradients of its inputs and of every block parameter (rtol 1e-5, fp32), for both tiny variants and for the two
temb layouts (one per sample; one per token: TI2V-5B's ``expand_timesteps``). In bf16 the forward is bit-identical
(the same ops and casts in the same order)."""
import copy
import dataclasses

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lowvram_lora.engine.families.recompute import ChunkedRecompute
from lowvram_lora.engine.families.tiny import randomize_zero_inits
from lowvram_lora.engine.families.wan import FAMILY
from lowvram_lora.engine.families.wan.parts import CrossAttention, FeedForward, SelfAttention

#: wan-i2v-tiny: Wan 2.1 I2V's image cross-attention (add_k_proj / add_v_proj over the CLIP rows) in the cross part.
VARIANTS = (FAMILY.tiny_variant, "wan2.2-ti2v-tiny", "wan-i2v-tiny")


@pytest.fixture(autouse=True)
def _parts_on(monkeypatch):
    """The parts are on by default (WanMemory.stream_in_parts); kept on here whatever the default."""
    monkeypatch.setattr(type(FAMILY), "memory", dataclasses.replace(FAMILY.memory, stream_in_parts=True))


def _model(variant: str, dtype=torch.float32):
    """A tiny random model; in bf16 with diffusers' ``_keep_in_fp32_modules`` (the modulation table, the norms, RoPE)
    kept in fp32, as ``from_pretrained(torch_dtype=torch.bfloat16)`` loads it."""
    torch.manual_seed(0)
    model = FAMILY.transformer_class().from_config(FAMILY.load_config(variant))
    randomize_zero_inits(model, 0)
    with torch.no_grad():  # the table is randn / sqrt(dim): make the modulation clearly non-trivial
        for block in model.blocks:
            block.scale_shift_table.mul_(10.0)
    keep = set(model._keep_in_fp32_modules)
    for name, param in model.named_parameters():
        if not keep & set(name.split(".")):
            param.data = param.data.to(dtype)
    return model.eval()


def _block_inputs(model, per_token: bool, frames: int = 5):
    """What the model hands its first block (hidden, text, temb, RoPE), captured from a real forward: timestep
    (B,) gives temb (B, 6, D); timestep (B, S) as TI2V's pipeline passes it gives temb (B, S, 6, D)."""
    g = torch.Generator().manual_seed(1)
    dtype = model.patch_embedding.weight.dtype
    shape = list(FAMILY.latent_shape(model, 32, 32 if model.config.out_channels == 16 else 64, frames))
    shape[0] = model.config.in_channels  # an I2V model's input: the latents and the 20 condition channels
    latents = torch.randn(2, *shape, generator=g).to(dtype)
    clip = model.config.image_dim is not None  # Wan 2.1 I2V: its cross-attention splits off the rows before 512 text
    text = torch.randn(2, 512 if clip else 9, model.config.text_dim, generator=g).to(dtype)
    image = {"encoder_hidden_states_image": torch.randn(2, 5, model.config.image_dim, generator=g).to(dtype)} \
        if clip else {}
    if per_token:
        p = model.config.patch_size
        tokens = latents.shape[2] // p[0] * (latents.shape[3] // p[1]) * (latents.shape[4] // p[2])
        timestep = torch.rand(2, tokens, generator=g) * 1000
        timestep[:, : tokens // 4] = 0.0  # the clean first frame of TI2V's image-to-video sits at t = 0
    else:
        timestep = torch.tensor([300.0, 850.0])
    seen = {}

    def grab(block, args):
        seen["args"] = args
        raise StopIteration  # the first block's inputs are all we need

    handle = model.blocks[0].register_forward_pre_hook(grab)
    try:
        with torch.no_grad(), pytest.raises(StopIteration):
            model(hidden_states=latents, timestep=timestep, encoder_hidden_states=text, return_dict=False, **image)
    finally:
        handle.remove()
    hidden, encoder, temb, rope = seen["args"]
    assert temb.ndim == (4 if per_token else 3)
    return hidden, encoder, temb, rope


def _run(block, parts, inputs, checkpointed: bool):
    """The block's output and the gradients of its float inputs and parameters, under a fixed random cotangent."""
    hidden, encoder, temb, rope = (x.detach().clone().requires_grad_(True) if i < 3 else x
                                   for i, x in enumerate(inputs))
    if parts is None:
        out = block(hidden, encoder, temb, rope)
    else:
        out = (hidden, encoder, temb, rope)
        for part in parts:
            out = checkpoint(part, *out, use_reentrant=False) if checkpointed else part(*out)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
    block.zero_grad(set_to_none=True)
    (out.float() * cot.float()).sum().backward()
    grads = {"hidden": hidden.grad, "encoder": encoder.grad, "temb": temb.grad}
    grads.update({n: p.grad.clone() for n, p in block.named_parameters()})
    return out.detach(), grads


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_parts_compose_to_the_diffusers_block(variant, per_token):
    model = _model(variant)
    block = model.blocks[0]
    names = [n for n, _ in FAMILY.memory.block_parts(block)]
    assert names == ["self_attention", "cross_attention", "feed_forward"]
    inputs = _block_inputs(model, per_token)
    want, want_grads = _run(block, None, inputs, False)
    for checkpointed in (False, True):
        got, grads = _run(block, [m for _, m in FAMILY.memory.block_parts(block)], inputs, checkpointed)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert grads.keys() == want_grads.keys()
        for name, g in want_grads.items():
            assert g is not None and g.abs().sum() > 0, name  # every input and parameter matters
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("variant", VARIANTS)
def test_parts_are_bit_identical_in_bf16(variant):
    """The same ops and casts in the same order as diffusers: bf16 output and input gradients equal exactly."""
    model = _model(variant, torch.bfloat16)
    block = model.blocks[1]
    inputs = _block_inputs(model, False)
    want, want_grads = _run(block, None, inputs, False)
    got, grads = _run(block, [m for _, m in FAMILY.memory.block_parts(block)], inputs, True)
    assert torch.equal(got, want)
    for name in ("hidden", "encoder", "temb", "attn1.to_q.weight", "ffn.net.2.weight", "scale_shift_table"):
        assert torch.equal(grads[name], want_grads[name]), name


def test_parts_hold_each_block_tensor_once_and_ffn_chunks_apply():
    """Every parameter of a block is in exactly one part (the engine's check), the parts hold Wan's own modules (so
    LoRA names do not change), and ``install_chunked_recompute`` (FFN token chunks, patched on ``block.ffn``) runs
    inside the FFN part: the same result as the whole block with the same chunks (exactly: the same arithmetic), and
    as the unchunked block within 1e-5 of each gradient's norm (chunks sum the weight gradients in another order)."""
    from lowvram_lora.engine.offload.units import _check_partition

    model = _model(FAMILY.tiny_variant)
    block = model.blocks[0]
    parts = FAMILY.memory.block_parts(block)
    _check_partition(block, parts)
    assert [type(m) for _, m in parts] == [SelfAttention, CrossAttention, FeedForward]
    assert parts[2][1].ffn is block.ffn and parts[0][1].scale_shift_table is block.scale_shift_table
    inputs = _block_inputs(model, False)
    plain, plain_grads = _run(block, None, inputs, False)
    undo = ChunkedRecompute()
    calls = []
    FAMILY.memory.install_chunked_recompute(model, 3, undo)
    chunked = block.ffn.forward
    block.ffn.forward = lambda *a, **k: calls.append(1) or chunked(*a, **k)
    try:
        want, want_grads = _run(block, None, inputs, False)
        calls.clear()
        got, grads = _run(block, [m for _, m in parts], inputs, True)
    finally:
        del block.ffn.forward
        undo.remove()
    assert calls, "the FFN part did not go through the chunked feed-forward"
    assert torch.equal(got, want)
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-6)
    for name, g in want_grads.items():
        assert torch.equal(grads[name], g), name
        assert ((grads[name] - plain_grads[name]).norm() / plain_grads[name].norm()).item() < 1e-5, name


def test_streaming_with_activation_offload_runs_blocks_as_three_units():
    """With activation offload the streamer installs the parts: three streaming units per block, in run order."""
    from lowvram_lora.engine.offload.footprint import measure_footprint, named_blocks
    from lowvram_lora.engine.offload.units import install_units

    model = copy.deepcopy(_model(FAMILY.tiny_variant))
    fp = measure_footprint(model, FAMILY)
    assert all(u is not None and len(u) == 3 and sum(u) == b for u, b in zip(fp.unit_bytes, fp.block_bytes))
    units = install_units(model, FAMILY, named_blocks(model, FAMILY))
    try:
        assert [n for n, _ in units.units][:3] == ["blocks.0.self_attention", "blocks.0.cross_attention",
                                                   "blocks.0.feed_forward"]
        assert len(units.units) == 3 * len(model.blocks)
    finally:
        units.remove()


def test_the_planner_sizes_the_working_set_by_the_largest_part():
    """With activation offload (blocks stream in parts) the plan scales the block working set by Wan's
    ``parts_activation_scale``; without it (whole blocks) by ``activation_scale``: A14B at 832x480x81."""
    from lowvram_lora.engine.families.base import meta_model
    from lowvram_lora.engine.offload import Workload, build_plan
    from lowvram_lora.engine.offload.footprint import measure_footprint
    from lowvram_lora.engine.offload.plan import TRANSIENT_UNITS

    variant = "wan2.2-t2v-a14b-high-noise"
    model = meta_model(FAMILY, FAMILY.load_config(variant))
    model.requires_grad_(False)
    fp = measure_footprint(model, FAMILY, trainable_params=0)
    assert all(len(u) == 3 and sum(u) == b for u, b in zip(fp.unit_bytes, fp.block_bytes))
    assert fp.working_set_scale(True) == FAMILY.memory.parts_activation_scale < FAMILY.memory.activation_scale
    assert fp.working_set_scale(False) == FAMILY.memory.activation_scale
    wl = Workload(1, FAMILY.memory.image_tokens(832, 480, variant) * FAMILY.memory.latent_frames(81), 512)
    unit = wl.tokens * fp.hidden_size * 2
    parts = build_plan(fp, wl, (), 1, True).breakdown["activations"]
    fp.parts_activation_scale = None  # as before parts: the whole block's working set
    whole = build_plan(fp, wl, (), 1, True).breakdown["activations"]
    assert whole - parts == pytest.approx((1 - FAMILY.memory.parts_activation_scale) * TRANSIENT_UNITS * unit, rel=1e-6)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_parts_with_activation_offload_train_like_the_resident_model(backend):
    """Streamed in parts with activation offload (each part its own reentrant checkpoint), eager and compiled: the
    losses and LoRA gradients of two steps equal the resident model's (rtol 1e-4). The modulation vectors and text
    states handed from part to part leave as constants (the time embedding and the text are frozen), so no part
    computes a gradient for them (compiled: AOTAutograd, whose CompiledFunctionBackward once returned the FFN part
    one in the wrong shape on the H100: "invalid gradient at index 1 - got [D] but expected [1, 1, D]")."""
    from helpers import flow_steps
    from lowvram_lora.engine.families.tiny import randomize_zero_inits
    from lowvram_lora.engine.config import LoraSettings
    from lowvram_lora.engine.offload import OffloadConfig, Workload, build_plan
    from lowvram_lora.engine.offload.footprint import measure_footprint
    from lowvram_lora.engine.offload.streamer import InlineCopyEngine, apply_offload
    from lowvram_lora.engine.offload.units import installed_units
    from lowvram_lora.engine.train import compile as compile_mod
    from lowvram_lora.engine.train.lora_attach import attach_lora

    torch.manual_seed(0)
    ref = FAMILY.transformer_class().from_config(FAMILY.load_config(FAMILY.tiny_variant))
    randomize_zero_inits(ref, 0)
    ref.requires_grad_(False)
    ref.enable_gradient_checkpointing()
    attach_lora(ref, FAMILY, LoraSettings(rank=4, alpha=4), 0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model = copy.deepcopy(ref)

    want, want_grads = flow_steps(ref, FAMILY)
    plan = build_plan(measure_footprint(model, FAMILY), Workload(1, 64, 9), (), 1, True)
    handle = apply_offload(model, FAMILY, OffloadConfig(mode="stream"), torch.device("cpu"), plan=plan,
                           _engine_factory=InlineCopyEngine)
    units = installed_units(model)
    assert units is not None and len(units) == 3 * len(model.blocks)
    seen, first, checkpoint = [], units[0][1], model._gradient_checkpointing_func

    def recording(block, *args):  # what the first part's checkpoint hands the next part
        out = checkpoint(block, *args)
        if block is first:
            seen.append([o.requires_grad for o in out])
        return out

    model._gradient_checkpointing_func = recording
    compiled = compile_mod.compile_blocks(model, FAMILY, 1.0, backend=backend) if backend != "eager" else None
    try:
        got, grads = flow_steps(model, FAMILY)
    finally:
        model._gradient_checkpointing_func = checkpoint
        if compiled is not None:
            compiled.remove()
        handle.remove()
    assert seen and seen[0] == [True, False, False, False, False]  # hidden states only
    assert got == pytest.approx(want, rel=1e-5)
    assert grads.keys() == want_grads.keys() and grads
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


#: Measured on an H200, 2026-11-28 (bench/logs/issue39_wan_i2v_8gb_session9_h200x2.log): 832x480x81, 40 of 40 blocks
#: 2xH200, 2026-11-28 (bench/logs/issue39_wan_i2v_8gb_session10_h200x2.log), 832x480x81, blocks streamed in parts with
#: the fp32 slices, eager: (budget GB, prefetch depth, resident blocks, token chunks, AdamW moments on the host,
#: fragmentation the run planned with, activations GB: the step-2 peak less the weights and LoRA its plan printed).
CAPPED_ROWS = {
    "wan2.2-i2v-a14b-high-noise": [(12, 2, 2, 1, False, 2.2, 7.79 - 1.11 - 0.84),
                                   (8, 2, 0, 9, True, 1.4, 6.67 - 0.40 - 0.42)],
    "wan2.1-i2v-14b": [(12, 2, 1, 1, False, 2.2, 7.77 - 0.88 - 1.05), (8, 2, 0, 9, True, 1.2, 6.84 - 0.47 - 0.52)],
}


def _i2v_footprint(variant):
    from lowvram_lora.engine.config import LoraSettings
    from lowvram_lora.engine.families.base import meta_model
    from lowvram_lora.engine.offload import Workload
    from lowvram_lora.engine.offload.footprint import lora_param_count, measure_footprint
    from lowvram_lora.engine.slab.layout import swap_in_int8_linears

    model = meta_model(FAMILY, FAMILY.load_config(variant))
    model.requires_grad_(False)
    trainable = lora_param_count(model, FAMILY, LoraSettings(rank=16, alpha=16.0))
    swap_in_int8_linears(model, FAMILY, 8)  # as the rows ran: an int8 slab
    fp = measure_footprint(model, FAMILY, trainable_params=trainable)
    return fp, Workload(1, FAMILY.memory.image_tokens(832, 480, variant) * FAMILY.memory.latent_frames(81), 512)


@pytest.mark.parametrize("variant", sorted(CAPPED_ROWS))
def test_the_plans_that_trained_at_8_gb_predict_their_peak_and_auto_plans_8_gb(variant):
    """The rows that trained with the fp32 slices, rebuilt on the meta device: each plan predicts the activations it
    measured within 3%, not under them (the same at 1 and 9 token chunks: no chunk reaches the self-attention
    part, ``parts_chunked``). ``auto`` at 8 GB (eager or compiled) now plans with the family's margin, which is no
    more than the larger margin that ran under the 8 GB cap; 7 GB is refused before loading, naming the smallest plan,
    which needs no compiled blocks."""
    from lowvram_lora.engine.errors import ConfigError
    from lowvram_lora.engine.offload import OffloadConfig, build_plan
    from lowvram_lora.engine.offload.plan import allocator_margin, make_plan

    fp, wl = _i2v_footprint(variant)
    ran_margins = []
    for budget, depth, resident, chunks, host_moments, frag, activations in CAPPED_ROWS[variant]:
        plan = build_plan(fp, wl, range(resident), depth, True, budget_bytes=int(budget * 1e9),
                          recompute_chunks=chunks, optimizer_on_host=host_moments)
        assert plan.breakdown["activations"] == pytest.approx(activations * 1e9, rel=0.03)
        assert plan.breakdown["activations"] >= activations * 1e9
        if budget == 8:
            ran_margins.append(allocator_margin(plan.largest_tensor_bytes, frag))
            assert plan.fragmentation == FAMILY.memory.parts_fragmentation  # blocks in parts
    whole = build_plan(fp, wl, (), 2, True, recompute_chunks=9, offload_parts=False)
    assert whole.fragmentation == FAMILY.memory.fragmentation > FAMILY.memory.parts_fragmentation
    one, nine = (fp.working_set_units(True, c) for c in (1, 9))
    assert one == nine == FAMILY.memory.parts_activation_scale * 34.2
    # Compiled below an activation-memory budget of 1: the family's compiled factor at any chunks too.
    assert fp.working_set_units(True, 1, 0.5) == fp.working_set_units(True, 9, 0.5) == pytest.approx(
        FAMILY.memory.compiled_activation_scale * one)
    for compile_ in ("off", "blocks"):
        plan = make_plan(fp, wl, OffloadConfig(mode="auto", vram_budget_gb=8, compile=compile_), int(8e9),
                         compiled=compile_ == "blocks")
        assert plan.predicted_peak_bytes + plan.margin_bytes <= 8e9
        # The unchunked plans' largest tensor is the FFN's hidden state (0.92 GB against 0.68): the same factor.
        assert plan.fragmentation <= max(frag for *_, frag, _ in CAPPED_ROWS[variant])
    with pytest.raises(ConfigError, match=r"below the smallest plan") as refused:
        make_plan(fp, wl, OffloadConfig(mode="auto", vram_budget_gb=7), int(7e9))
    need = float(str(refused.value).split("batch 1 (")[1].split(" GB")[0])
    assert 7 < need <= 8 and "need less" not in str(refused.value)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_parts_in_fp32_token_slices_are_bit_identical_while_training_a_lora(variant, per_token, monkeypatch):
    """As a LoRA run trains (the time embedding, the modulation table and the norms frozen), the parts' fp32 norms
    and gated residuals run in token slices (``fp32_chunks.py``; here slices of a few tokens, so every call makes
    several): bf16 output and the gradients of the hidden state and of the trained weights equal diffusers' block
    exactly."""
    from lowvram_lora.engine.families import fp32_chunks

    model = _model(variant, torch.bfloat16)
    block = model.blocks[1]
    block.requires_grad_(False)
    trained = ("attn1.to_q.weight", "attn1.to_out.0.weight", "attn2.to_k.weight", "ffn.net.2.weight")
    for name in trained:
        block.get_parameter(name).requires_grad_(True)
    hidden, encoder, temb, rope = _block_inputs(model, per_token)
    cot = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(5)).to(hidden.dtype)
    slices = []
    real = fp32_chunks._slices
    monkeypatch.setattr(fp32_chunks, "_slices", lambda x, b: slices.append(len(real(x, b))) or real(x, b))
    monkeypatch.setattr(fp32_chunks, "SLICE_BYTES", hidden.shape[0] * hidden.shape[2] * 4 * 3)  # 3 tokens a slice

    def run(parts):
        h = hidden.detach().clone().requires_grad_(True)
        out = (h, encoder, temb, rope)
        if parts is None:
            out = block(*out)
        else:
            for part in parts:
                out = checkpoint(part, *out, use_reentrant=False)
        block.zero_grad(set_to_none=True)
        (out.float() * cot.float()).sum().backward()
        return out.detach(), {"hidden": h.grad, **{n: block.get_parameter(n).grad.clone() for n in trained}}

    want, want_grads = run(None)
    assert not slices
    got, grads = run([m for _, m in FAMILY.memory.block_parts(block)])
    assert slices and min(slices) > 1  # the sliced path ran, in several slices each time
    assert torch.equal(got, want)
    for name, g in want_grads.items():
        assert torch.equal(grads[name], g), name
