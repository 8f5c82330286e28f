"""Block streaming and activation offload on the CPU: the real hooks, binding, scheduler and
checkpoint function, with synchronous copies (InlineCopyEngine) standing in for CUDA.
A slot overwritten while a block's backward still needs it would change the gradients,
so equality with the resident model is the test."""
import copy
import types

import pytest
import torch

from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.families import get_family
from lowvram_lora.engine.offload import OffloadConfig, Workload, build_plan
from lowvram_lora.engine.offload.footprint import footprint_before_loading, measure_footprint, named_blocks
from lowvram_lora.engine.offload.host import HostBlock
from lowvram_lora.engine.offload.streamer import InlineCopyEngine, apply_offload
from lowvram_lora.engine.offload.units import installed_units, parts_of
from lowvram_lora.engine.train import train_lora
from lowvram_lora.engine.train.lora_attach import attach_lora, detach_lora

from helpers import assert_grads_close, tiny_lora_model
from helpers import trained_grads as grads

FAMILY = get_family("flux1")


def lora_model(num_double=2, num_single=3, seed=0):
    """A small Flux.1 (tiny widths, more blocks) with LoRA whose B is random (tests/helpers.tiny_lora_model)."""
    return tiny_lora_model("flux1", num_double, num_single, seed)


def inputs(seed, h=8, w=8):
    g = torch.Generator().manual_seed(seed)
    lat = torch.randn(1, 4, h, w, generator=g)
    emb = {"prompt_embeds": torch.randn(1, 7, 32, generator=g), "pooled_prompt_embeds": torch.randn(1, 32, generator=g)}
    target = torch.randn(1, (h // 2) * (w // 2), 16, generator=g)
    return FAMILY.model_inputs(GUIDED, lat, emb, torch.tensor([0.4]), 1.0), target


GUIDED = types.SimpleNamespace(config=types.SimpleNamespace(guidance_embeds=True))  # all model_inputs reads


def run_steps(model, calls):
    """Each call: ("train", seed, h, w) accumulates a backward; ("eval", seed) is a no-grad forward."""
    losses = []
    for kind, seed, *hw in calls:
        inp, target = inputs(seed, *hw)
        if kind == "eval":
            with torch.no_grad():
                losses.append(model(**inp)[0].square().mean().item())
        else:
            loss = torch.nn.functional.mse_loss(model(**inp)[0], target)
            loss.backward()
            losses.append(loss.item())
    return losses


def streamed(model, resident=(), k=1, act=False):
    fp = measure_footprint(model, FAMILY)
    plan = build_plan(fp, Workload(1, 64, 7), resident, k, act)
    return apply_offload(model, FAMILY, OffloadConfig(mode="stream"), torch.device("cpu"), plan=plan,
                         _engine_factory=InlineCopyEngine)


CALLS = [("train", 1, 8, 8), ("eval", 2), ("train", 3, 8, 12), ("train", 4, 8, 8)]  # accumulation, eval, 2 buckets


@pytest.mark.parametrize("resident, k, act", [
    ((), 1, False), ((), 3, False), ((0, 3), 1, False), ((), 1, True), ((2, 4), 2, True),
])
def test_streamed_gradients_equal_resident(resident, k, act):
    ref, _ = lora_model()
    model = copy.deepcopy(ref)
    ref_losses = run_steps(ref, CALLS)
    handle = streamed(model, resident, k, act)
    losses = run_steps(model, CALLS)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    g_ref, g = grads(ref), grads(model)
    assert_grads_close(g, g_ref, rtol=1e-5)
    stats = handle.stats()
    n = len(named_blocks(model, FAMILY))
    assert stats["loads"] >= n - len(resident)  # every streamed block really was copied in
    if act:
        assert stats["activation_bytes_out"] > 0 and stats["activation_bytes_in"] > 0
    handle.remove()


def test_partial_activation_offload_trains_like_all_and_none():
    """Some blocks' inputs offloaded (a double block, in parts, and a single block), the others recomputed with their
    inputs on the GPU: the losses and LoRA gradients equal the all-recompute and the all-offload runs', and those of
    offloading every block whole (no parts)."""
    ref, _ = lora_model()
    runs = {}
    for name, act, blocks, parts in (("none", False, None, True), ("all", True, None, True),
                                      ("partial", True, [0, 3], True), ("whole", True, None, False)):
        model = copy.deepcopy(ref)
        plan = build_plan(measure_footprint(model, FAMILY), Workload(1, 64, 7), (), 1, act, offload_blocks=blocks,
                          offload_parts=parts)
        handle = apply_offload(model, FAMILY, OffloadConfig(mode="stream"), torch.device("cpu"), plan=plan,
                               _engine_factory=InlineCopyEngine)
        units = [n for n, _ in installed_units(model) or []]
        runs[name] = (run_steps(model, CALLS), grads(model), handle.stats(), units)
        handle.remove()
    losses, g, stats, units = runs["partial"]
    # only the offloaded double block streams in parts; the other double block runs whole
    assert units[:3] == ["transformer_blocks.0.attention", "transformer_blocks.0.feed_forward", "transformer_blocks.1"]
    assert 0 < stats["activation_bytes_out"] < runs["all"][2]["activation_bytes_out"]
    assert stats["activation_bytes_in"] == stats["activation_bytes_out"]
    # whole blocks: no parts, one input set per block (fewer bytes out than the parts' three for two double blocks)
    assert runs["whole"][3][:2] == ["transformer_blocks.0", "transformer_blocks.1"]
    assert 0 < runs["whole"][2]["activation_bytes_out"] < runs["all"][2]["activation_bytes_out"]
    for other in ("none", "all", "whole"):
        assert losses == pytest.approx(runs[other][0], rel=1e-6)
        assert g.keys() == runs[other][1].keys() and g
        for n in g:
            torch.testing.assert_close(g[n], runs[other][1][n], rtol=1e-5, atol=1e-7, msg=f"{other}: {n}")


@pytest.mark.parametrize("act", [False, True])
def test_no_grad_passes_follow_the_forward_cycle(act):
    """Sampling's no-grad forwards, back to back between training steps, as the sampler runs them: the model's
    forward tells the scheduler no backward follows, so after the first pass no block is loaded synchronously,
    the outputs equal the resident model's, and training afterwards equals it too."""
    ref, _ = lora_model()
    model = copy.deepcopy(ref)
    handle = streamed(model, (), 2, act)
    calls = [("train", 1, 8, 8)] + [("eval", s) for s in (2, 3, 4, 5)] + [("train", 6, 8, 8), ("train", 7, 8, 8)]
    ref_losses = run_steps(ref, calls[:2])
    losses = run_steps(model, calls[:2])
    misses = handle.stats()["sync_loads"]
    ref_losses += run_steps(ref, calls[2:])
    losses += run_steps(model, calls[2:])
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert handle.stats()["sync_loads"] == misses and handle.stats()["resyncs"] == 0
    for name, g in grads(ref).items():
        torch.testing.assert_close(grads(model)[name], g, rtol=1e-5, atol=1e-7, msg=name)
    handle.remove()
    from lowvram_lora.engine.offload.hooks import HookRegistry

    assert HookRegistry.find(model) is None  # the pass hook went with the handle


def test_remove_restores_the_model_and_the_host_copy_is_reused():
    ref, _ = lora_model(seed=3)
    model = copy.deepcopy(ref)
    handle = streamed(model, resident=(1,), k=2, act=True)
    run_steps(model, CALLS[:1])
    handle.remove()
    blocks = named_blocks(model, FAMILY)
    for i, (_, block) in enumerate(blocks):
        # with activation offload the double blocks stream as their parts (engine/offload/units.py)
        parts = [m for _, m in parts_of(FAMILY, block)] if i < 2 else [block]
        for unit in parts:
            hb = getattr(unit, "_lowvram_host_block", None)
            assert (hb is not None and hb.bound_to_host()) == (i != 1)
    assert all("forward" not in vars(b) for _, b in blocks) and installed_units(model) is None
    # the model computes what it did before, without hooks, with torch's checkpointing again
    inp, _ = inputs(9)
    with torch.no_grad():
        torch.testing.assert_close(model(**inp)[0], ref(**inp)[0])
    assert model._gradient_checkpointing_func is not None and model.gradient_checkpointing
    # a second run reuses the pinned host copies instead of pinning again
    again = streamed(model, k=1, act=True)
    assert again.stats()["pinned_reused"] == len(blocks) - 1 + 1  # block 1 was resident; block 0 is two parts
    again.remove()
    detach_lora(model)
    assert not any(p.requires_grad for p in model.parameters())


def test_host_block_layout_is_aligned_and_round_trips():
    model, _ = lora_model(1, 1)
    _, block = named_blocks(model, FAMILY)[0]
    before = {n: p.clone() for n, p in block.named_parameters() if not p.requires_grad}
    hb, reused = HostBlock.for_block(block, "transformer_blocks.0", pin=False)
    assert not reused and all(e.offset % 256 == 0 for e in hb.entries)
    assert hb.bound_to_host() and hb.nbytes >= sum(t.numel() * t.element_size() for t in before.values())
    slot = torch.zeros(hb.nbytes, dtype=torch.uint8)
    slot.copy_(hb.buffer)
    hb.bind(slot)
    after = {n: p for n, p in block.named_parameters() if not p.requires_grad}
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert not hb.bound_to_host()
    hb.bind_host()
    assert hb.bound_to_host()


def test_streaming_needs_cuda(tiny_pipeline, tiny_cache):
    if torch.cuda.is_available():
        pytest.skip("machine has CUDA")
    with pytest.raises(ConfigError, match="streams blocks to a CUDA GPU.*mode='resident'"):
        train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), tiny_cache, LoraSettings(rank=2),
                   TrainConfig(steps=1), offload=OffloadConfig(mode="stream"))
    model, _ = lora_model(1, 1)
    with pytest.raises(ConfigError, match="CUDA"):
        apply_offload(model, FAMILY, OffloadConfig(mode="auto"), torch.device("cpu"), workload=Workload(1, 16, 7))


def test_resident_offload_config_trains_on_cpu(tiny_pipeline, tiny_cache):
    result = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), tiny_cache, LoraSettings(rank=2),
                        TrainConfig(steps=2), offload=OffloadConfig(mode="resident"))
    assert result.steps == 2 and result.settings["offload"]["mode"] == "resident"
    # checkpointing off is honoured (one home: OffloadConfig)
    off = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), tiny_cache, LoraSettings(rank=2),
                     TrainConfig(steps=2), offload=OffloadConfig(mode="resident", gradient_checkpointing=False))
    assert off.steps == 2 and off.settings["offload"]["gradient_checkpointing"] is False


def test_cpu_training_is_held_to_the_ram_budget(tiny_single_file, tiny_cache):
    """On the CPU the model, LoRA and activations are host memory: a RAM budget below them is refused before loading,
    naming the need; a budget above trains."""
    from lowvram_lora.engine.checkpoint import identify
    from lowvram_lora.engine.offload.plan import PROCESS_BASE_BYTES, cpu_resident_plan, GB
    from lowvram_lora.engine.train.placement import Resident

    fp, _, _ = footprint_before_loading(tiny_single_file, torch.float32, LoraSettings(rank=4))
    plan = cpu_resident_plan(fp, Workload(1, 64, 7), None, resume_staging=False)
    # the process, and the model + LoRA + AdamW + activations a GPU would hold (the checkpoint is read into memory)
    assert plan.host_phases["train"] == PROCESS_BASE_BYTES + plan.predicted_peak_bytes
    assert plan.predicted_peak_bytes > fp.other_bytes + fp.total_block_bytes
    with pytest.raises(ConfigError, match=r"on the CPU .* needs [0-9.]+ GB of host RAM .* ram_budget_gb=1 allows"):
        Resident(OffloadConfig(mode="resident", ram_budget_gb=1.0), torch.device("cpu")).plan_before_loading(
            identify(tiny_single_file), "auto", tiny_cache, LoraSettings(rank=4), TrainConfig(), torch.float32)
    need = plan.predicted_host_peak_bytes / GB
    Resident(OffloadConfig(mode="resident", ram_budget_gb=need + 1), torch.device("cpu")).plan_before_loading(
        identify(tiny_single_file), "auto", tiny_cache, LoraSettings(rank=4), TrainConfig(), torch.float32)


def test_impossible_budget_is_refused_from_the_header_alone(tiny_single_file, tiny_cache):
    from lowvram_lora.engine.checkpoint import identify
    from lowvram_lora.engine.train.placement import Streamed

    found = footprint_before_loading(tiny_single_file, torch.bfloat16,
                                     LoraSettings(rank=4))
    fp, family, variant = found
    assert variant == "flux1-tiny" and fp.num_blocks == 4 and fp.trainable_params > 0
    with pytest.raises(ConfigError, match=r"vram_budget_gb=0.01 is below the smallest plan .* raise the budget to at least \d+\.\d GB"):
        Streamed(OffloadConfig(vram_budget_gb=0.01), torch.device("cuda")).plan_before_loading(
            identify(tiny_single_file), "auto", tiny_cache, LoraSettings(rank=4), TrainConfig(), torch.bfloat16)


def test_footprint_from_header_matches_the_loaded_model(tiny_pipeline):
    from lowvram_lora.engine.models import load_transformer

    fp, _, _ = footprint_before_loading(tiny_pipeline, torch.float32,
                                        LoraSettings(rank=4))
    model, family, _, _ = load_transformer(tiny_pipeline, dtype=torch.float32)
    attach_lora(model, family, LoraSettings(rank=4), 0)
    real = measure_footprint(model, family)
    assert fp.block_bytes == real.block_bytes and fp.other_bytes == real.other_bytes
    assert fp.trainable_params == real.trainable_params and fp.hidden_size == real.hidden_size


def test_int8_slab_blocks_stream_as_stored():
    """Blocks whose Linears are the slab's Int8Linear (int8 weight + fp32 scale buffers) stream their bytes
    as stored: same dtypes on both sides, same gradients as resident."""
    from peft.tuners.lora import Linear as LoraLinear

    from lowvram_lora.engine.slab import Int8Linear

    ref, _ = lora_model(seed=5)
    for _, block in named_blocks(ref, FAMILY):
        for module in block.modules():
            if isinstance(module, LoraLinear):
                module.base_layer = Int8Linear.from_linear(module.base_layer)
    model = copy.deepcopy(ref)
    ref_losses = run_steps(ref, CALLS)
    handle = streamed(model, resident=(1,), k=1)
    hb = named_blocks(model, FAMILY)[0][1]._lowvram_host_block
    assert {e.dtype for e in hb.entries} >= {torch.int8, torch.float32}
    assert run_steps(model, CALLS) == pytest.approx(ref_losses, rel=1e-6)
    g_ref, g = grads(ref), grads(model)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-5, atol=1e-7, msg=name)
    handle.remove()


def test_footprint_from_a_slab_header_counts_int8_blocks(tiny_pipeline, tmp_path):
    from lowvram_lora.engine.models import load_transformer
    from lowvram_lora.engine.slab import build_slab

    slab = build_slab(tiny_pipeline, tmp_path / "slab", progress=False)
    fp, _, variant = footprint_before_loading(slab, torch.bfloat16,
                                              LoraSettings(rank=4))
    model, family, _, _ = load_transformer(slab, dtype=torch.bfloat16)
    real = measure_footprint(model, family, trainable_params=fp.trainable_params)
    assert variant == "flux1-tiny" and "int8" in fp.name
    assert fp.block_bytes == real.block_bytes and fp.other_bytes == real.other_bytes
    bf16, _, _ = footprint_before_loading(tiny_pipeline, torch.bfloat16,
                                          LoraSettings(rank=4))
    assert sum(fp.block_bytes) < 0.7 * sum(bf16.block_bytes)  # int8 weights: about half of bf16
    assert fp.trainable_params == bf16.trainable_params
