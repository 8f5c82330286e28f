"""Flux.2's single blocks in token chunks (``parts.single_block_forward_chunked``) on the tiny model, CPU, fp32.

The reference is diffusers' own ``Flux2SingleTransformerBlock.forward`` (with its ``Flux2ParallelSelfAttnProcessor``)
under the model's gradient checkpointing: the chunked model's output and every adapter weight's gradient must equal
it (rtol 1e-5 / 1e-4, fp32), for each weight form a block may have (float Linears, int8 and int4 slab Linears) and
each adapter type on ``to_qkv_mlp_proj`` and ``to_out``, resident and streamed. Then the planner: with the single
blocks chunked, the smallest plan for klein 9B with one 1024² reference (8192 image + 512 text tokens) shrinks.
"""
import copy

import pytest
import torch

from lowvram_lora.engine.config import AdapterConfig, LoraSettings
from lowvram_lora.engine.families.flux2 import FAMILY
from lowvram_lora.engine.families.recompute import ChunkedRecompute
from lowvram_lora.engine.families.tiny import randomize_zero_inits
from lowvram_lora.engine.offload.recompute import install_chunked_recompute
from lowvram_lora.engine.train.lora_attach import attach_lora

CHUNKS = 4


def _model(form="float", adapter="lora", seed=0):
    """The tiny Flux.2 (2 double + 2 single blocks, width 32) in fp32, its block Linears as ``form``, the adapter on
    the default targets (single blocks: attn.to_qkv_mlp_proj, attn.to_out) with every weight random (so each gets a
    gradient), gradient checkpointing on."""
    from lowvram_lora.engine.slab.int4_linear import Int4Linear
    from lowvram_lora.engine.slab.int8_linear import Int8Linear
    from lowvram_lora.engine.slab.layout import block_linears

    torch.manual_seed(seed)
    model = FAMILY.transformer_class().from_config(FAMILY.load_config("flux2-tiny"))
    randomize_zero_inits(model, seed)
    model.requires_grad_(False)
    if form != "float":
        cls = {"int8": Int8Linear, "int4": Int4Linear}[form]
        for name, linear in block_linears(model, FAMILY).items():
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, cls.from_linear(linear))
    model.enable_gradient_checkpointing()
    params = attach_lora(model, FAMILY, LoraSettings(rank=4, alpha=4, adapter=AdapterConfig(type=adapter)), seed)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.train()
    return model, params


def _inputs(seed=0, h=12, w=10):
    """A target and one reference (T = 10) of h x w latents each, 7 text tokens: 247 tokens in the single blocks."""
    g = torch.Generator().manual_seed(seed)
    cfg = FAMILY.load_config("flux2-tiny")
    latents = torch.randn(1, cfg["in_channels"], h, w, generator=g)
    embeds = {"prompt_embeds": torch.randn(1, 7, cfg["joint_attention_dim"], generator=g),
              "control_latents_0": torch.randn(1, cfg["in_channels"], h, w, generator=g)}
    guided = type("M", (), {"config": type("C", (), {"guidance_embeds": True})()})()  # all model_inputs reads
    return FAMILY.model_inputs(guided, latents, embeds, torch.tensor([0.4]), 1.0)


def _rows_seen(model):
    """The row counts each single block's fused projection is called with (hooks, removed by the caller)."""
    seen, handles = [], []
    for block in model.single_transformer_blocks:
        handles.append(block.attn.to_qkv_mlp_proj.register_forward_hook(
            lambda m, args, out: seen.append(args[0].shape[1])))
    return seen, handles


def _loss_and_grads(model, params, inputs):
    out = model(**inputs)[0]
    return out.detach(), torch.autograd.grad(out.square().mean(), params)


@pytest.mark.parametrize("form, adapter", [("float", "lora"), ("int8", "lora"), ("int4", "lora"),
                                           ("float", "loha"), ("float", "lokr"), ("float", "dora"),
                                           ("int8", "dora")])
def test_chunked_single_blocks_equal_whole(form, adapter):
    model, params = _model(form, adapter)
    inputs = _inputs()
    ref, ref_grads = _loss_and_grads(model, params, inputs)
    undo = install_chunked_recompute(model, FAMILY, CHUNKS)
    seen, handles = _rows_seen(model)
    out, grads = _loss_and_grads(model, params, inputs)
    for h in handles:
        h.remove()
    undo.remove()
    tokens = 7 + 2 * 12 * 10
    # every fused projection ran on a chunk's rows: forward, the block's recompute, the chunk's own recompute
    assert len(seen) >= 2 * CHUNKS and set(seen) == {-(-tokens // CHUNKS), tokens - 3 * -(-tokens // CHUNKS)}, seen
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("single_transformer_blocks.0.attn.to_qkv_mlp_proj" in n for n in names)
    assert any("single_transformer_blocks.1.attn.to_out" in n for n in names)
    for name, a, b in zip(names, grads, ref_grads):
        assert b.abs().max() > 0, name  # every adapter weight is trained through the chunked path
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7, msg=name)
    assert not any("forward" in vars(m) for m in model.modules())  # undone


def test_no_grad_forward_and_fp_settings_unchanged():
    """Without autograd (previews) the chunked forward is one plain pass, equal to diffusers'; a block with another
    attention processor is refused by name."""
    model, _ = _model()
    inputs = _inputs(1)
    with torch.no_grad():
        ref = model(**inputs)[0]
        undo = install_chunked_recompute(model, FAMILY, CHUNKS)
        seen, handles = _rows_seen(model)
        out = model(**inputs)[0]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert set(seen) == {7 + 2 * 12 * 10}
    for h in handles:
        h.remove()
    model.single_transformer_blocks[0].attn.processor = object()
    with pytest.raises(Exception, match="Flux2ParallelSelfAttnProcessor.*recompute_chunks to 1"):
        model(**inputs)
    undo.remove()


@pytest.mark.parametrize("act", [False, True])
def test_streamed_chunked_single_blocks_equal_resident_whole(act):
    """Blocks streamed by the real hooks and scheduler (synchronous copies standing in for CUDA), int8 slab Linears,
    chunked: two steps' losses and accumulated LoRA gradients equal the resident model's with whole blocks."""
    from lowvram_lora.engine.offload import OffloadConfig, Workload, build_plan
    from lowvram_lora.engine.offload.footprint import measure_footprint
    from lowvram_lora.engine.offload.streamer import InlineCopyEngine, apply_offload

    ref, _ = _model("int8")
    model = copy.deepcopy(ref)

    def steps(m):
        losses = []
        for seed in (1, 2):
            loss = m(**_inputs(seed))[0].square().mean()
            loss.backward()
            losses.append(loss.item())
        return losses, {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}

    ref_losses, ref_grads = steps(ref)
    plan = build_plan(measure_footprint(model, FAMILY), Workload(1, 240, 7), (), 1, act)
    handle = apply_offload(model, FAMILY, OffloadConfig(mode="stream"), torch.device("cpu"), plan=plan,
                           _engine_factory=InlineCopyEngine)
    undo = install_chunked_recompute(model, FAMILY, CHUNKS)
    losses, grads = steps(model)
    assert handle.stats()["loads"] >= 4
    undo.remove()
    handle.remove()
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert grads.keys() == ref_grads.keys() and grads
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-7, msg=n)


def test_the_klein_9b_edit_plan_shrinks():
    """klein 9B (int8 slab, compiled) at 1024² with one 1024² reference: 8192 image + 512 text tokens. With the single
    blocks chunked the planner's chunked working set is ``chunked_activation_scale`` x Flux.1's line instead of
    ``activation_scale`` x it, so the smallest plan drops (to 3.4 GB with the 0.5 GB headroom, at the scale fitted on
    the H100: 2.90 GB measured in that plan; whole single blocks cannot plan at 3.5 GB); an explicit
    recompute_chunks=1 (nothing chunked) keeps the whole-block figure."""
    from lowvram_lora.engine.families import meta_model
    from lowvram_lora.engine.offload import OffloadConfig, Workload
    from lowvram_lora.engine.offload.footprint import lora_param_count, measure_footprint
    from lowvram_lora.engine.offload.plan import GB, HEADROOM_BYTES, make_plan, transient_units
    from lowvram_lora.engine.slab.layout import swap_in_int8_linears

    memory = FAMILY.memory
    assert memory.chunked_activation_scale < memory.activation_scale
    model = meta_model(FAMILY, FAMILY.load_config("flux2-klein-9b"))
    torch.nn.Module.to(model, dtype=torch.bfloat16)
    model.requires_grad_(False)
    trainable = lora_param_count(model, FAMILY, LoraSettings(rank=16, alpha=16))
    swap_in_int8_linears(model, FAMILY, 8)
    fp = measure_footprint(model, FAMILY, "klein 9B", trainable_params=trainable)
    wl = Workload(1, 8192, 512, "1024x1024+1 control", reference_tokens=4096)
    budget = 3.5 * GB
    plan = make_plan(fp, wl, OffloadConfig(mode="auto", vram_budget_gb=3.5), budget, compiled=True)
    assert plan.recompute_chunks > 1 and plan.predicted_peak_bytes + HEADROOM_BYTES <= budget
    unit = wl.tokens * fp.hidden_size * 2
    chunked = transient_units(plan.recompute_chunks, plan.activation_memory_budget) * unit
    whole = make_plan(fp, wl, OffloadConfig(mode="stream", prefetch_depth=1, activation_offload=True,
                                            recompute_chunks=1), None)
    same = make_plan(fp, wl, OffloadConfig(mode="stream", prefetch_depth=1, activation_offload=True,
                                           recompute_chunks=plan.recompute_chunks, compile="blocks",
                                           activation_memory_budget=plan.activation_memory_budget), None,
                     compiled=True)
    # the chunked plan's activations: the chunked scale on the same Flux.1 line, nothing else changed
    fp_before = copy.copy(fp)
    fp_before.chunked_activation_scale = None
    before = make_plan(fp_before, wl, OffloadConfig(mode="stream", prefetch_depth=1, activation_offload=True,
                                                    recompute_chunks=plan.recompute_chunks, compile="blocks",
                                                    activation_memory_budget=plan.activation_memory_budget), None,
                       compiled=True)
    drop = before.breakdown["activations"] - same.breakdown["activations"]
    assert drop == pytest.approx((memory.activation_scale - memory.chunked_activation_scale) * chunked, rel=1e-6)
    assert whole.breakdown["activations"] > same.breakdown["activations"]
    with pytest.raises(Exception, match="below the smallest plan"):
        make_plan(fp_before, wl, OffloadConfig(mode="auto", vram_budget_gb=3.5), budget, compiled=True)
