"""Blocks streamed in parts (engine/offload/units.py): the parts compute what the block computes, the
streamed gradients equal the resident ones for Flux.1 and Flux.2, and the planner's ring shrinks."""
import copy

import pytest
import torch

from lowvram_lora.engine.families import get_family
from lowvram_lora.engine.offload import OffloadConfig, Workload, build_plan
from lowvram_lora.engine.offload.footprint import measure_footprint, named_blocks
from lowvram_lora.engine.offload.plan import ModelFootprint
from lowvram_lora.engine.offload.streamer import InlineCopyEngine, apply_offload
from lowvram_lora.engine.offload.units import installed_units, parts_of

from helpers import tiny_lora_model


def tiny(family_id: str, seed: int = 0):
    return tiny_lora_model(family_id, 2, 2, seed)[0], get_family(family_id)


def batch(model, family, seed: int):
    g = torch.Generator().manual_seed(seed)
    c = model.config.in_channels if family.id == "flux2" else model.config.in_channels // 4
    lat = torch.randn(1, c, 8, 8, generator=g)
    dim = model.config.joint_attention_dim
    emb = {"prompt_embeds": torch.randn(1, 7, dim, generator=g)}
    if family.id == "flux1":
        emb["pooled_prompt_embeds"] = torch.randn(1, model.config.pooled_projection_dim, generator=g)
    return family.model_inputs(model, lat, emb, torch.tensor([0.4]), 1.0)


def train_twice(model, family):
    """Two accumulated backward passes and one no-grad forward; returns (losses, LoRA grads)."""
    losses = []
    for seed in (1, 2):
        out = model(**batch(model, family, seed))[0]
        loss = out.square().mean()
        loss.backward()
        losses.append(loss.item())
    with torch.no_grad():
        losses.append(model(**batch(model, family, 3))[0].square().mean().item())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family_id", ["flux1", "flux2"])
def test_parts_stream_and_train_like_the_resident_model(family_id):
    ref, family = tiny(family_id)
    model = copy.deepcopy(ref)
    ref_losses, ref_grads = train_twice(ref, family)
    fp = measure_footprint(model, family)
    assert fp.unit_bytes[0] is not None and fp.unit_bytes[-1] is None  # double blocks in parts, singles whole
    plan = build_plan(fp, Workload(1, 16, 7), [], 1, True)
    handle = apply_offload(model, family, OffloadConfig(mode="stream"), torch.device("cpu"), plan=plan,
                           _engine_factory=InlineCopyEngine)
    units = installed_units(model)
    assert [n for n, _ in units][:2] == ["transformer_blocks.0.attention", "transformer_blocks.0.feed_forward"]
    assert plan.streamed_units == len(units) == 2 * 2 + 2
    losses, grads = train_twice(model, family)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    # every part was checkpointed and streamed on its own
    stats = handle.stats()
    assert stats["loads"] >= len(units) and stats["activation_bytes_out"] > 0
    handle.remove()
    assert installed_units(model) is None and all("forward" not in vars(b) for _, b in named_blocks(model, family))


@pytest.mark.parametrize("family_id", ["flux1", "flux2"])
def test_each_part_holds_its_own_tensors_and_the_chain_is_the_block(family_id):
    model, family = tiny(family_id)
    model.eval()
    blocks = named_blocks(model, family)
    for _, block in blocks:
        parts = parts_of(family, block)
        if parts is None:
            continue
        ids = [id(t) for _, p in parts for t in list(p.parameters()) + list(p.buffers())]
        assert sorted(ids) == sorted(id(t) for t in list(block.parameters()) + list(block.buffers()))
        assert parts_of(family, block) is parts  # made once: the pinned host copies are reused
        assert not any(n.startswith("_lowvram") for n, _ in model.named_modules())
    with torch.no_grad():
        inp = batch(model, family, 5)
        expected = model(**inp)[0]
        from lowvram_lora.engine.offload.units import install_units

        undo = install_units(model, family, blocks)  # keyword calls (no checkpointing) through the chain
        try:
            torch.testing.assert_close(model(**inp)[0], expected, rtol=0, atol=0)
        finally:
            undo.remove()


def test_the_plan_counts_the_ring_per_unit():
    gb = 1e9
    fp = ModelFootprint("flux1-dev", [f"b{i}" for i in range(57)], [int(0.68 * gb)] * 19 + [int(0.28 * gb)] * 38,
                        int(0.13 * gb), 46_700_000, 3072,
                        unit_bytes=[[int(0.38 * gb), int(0.30 * gb)]] * 19 + [None] * 38)
    wl = Workload(1, 16384, 512)
    whole = build_plan(fp, wl, [], 1, False)
    parts = build_plan(fp, wl, [], 1, True)
    assert whole.ring_bytes == int(0.68 * gb) * 2  # two double blocks at once
    assert parts.ring_bytes == int(0.38 * gb) + int(0.30 * gb)  # a part and the next: one double block
    assert parts.streamed_units == 19 * 2 + 38
    # each part's inputs leave and come back: 19 more sets than blocks
    assert parts.activation_bytes_per_step == (57 + 19) * 16896 * 3072 * 2
    assert "as 76 units" in parts.describe()
