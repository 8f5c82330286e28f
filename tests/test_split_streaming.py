"""Dual-GPU Split with streaming and activation offload, on the CPU (InlineCopyEngine stands in for CUDA).

On the GPU, a split on cuda:0,cuda:0 with ``mode='stream', activation_offload=True`` stopped with
"1 slots cannot hold the running block and 1 prefetched ones": the parts' plans counted the double blocks as
two streaming units (as a whole model streams them) while a part streams whole blocks, and a part holding one
double block got one slot for two units. Also covered: a whole model whose only streamed block is in parts.
"""
import copy

import pytest
import torch

from lowvram_lora.engine.offload import OffloadConfig, Workload, build_plan
from lowvram_lora.engine.offload.footprint import measure_footprint, named_blocks
from lowvram_lora.engine.offload.streamer import InlineCopyEngine, apply_offload
from lowvram_lora.engine.parallel.split import apply_split, plan_split, trainable_per_block

from helpers import assert_grads_close
from helpers import trained_grads as grads
from test_offload_streaming import CALLS, FAMILY, lora_model, run_steps

CPU2 = (torch.device("cpu"), torch.device("cpu"))
STREAM_ACT = OffloadConfig(mode="stream", prefetch_depth=1, activation_offload=True)


def _split_plan(model, cut=None, offload=STREAM_ACT):
    fp = measure_footprint(model, FAMILY)
    per_block, outside = trainable_per_block(model, FAMILY)
    return plan_split(fp, per_block, outside, Workload(1, 64, 7), offload, CPU2, (None, None), cut=cut)


def test_split_plans_stream_whole_blocks_at_every_cut():
    model, _ = lora_model()  # 2 double blocks (two units each when a whole model streams them) + 3 single
    assert measure_footprint(model, FAMILY).unit_bytes[0]  # the double blocks do have parts
    best = _split_plan(model)  # tries every cut, among them the parts of one double block alone
    for cut in range(1, 5):
        plan = _split_plan(model, cut)
        for part in plan.plans:
            assert part.streamed_units == len(part.streamed)  # a part streams whole blocks, as apply_offload does
            assert part.num_slots == min(part.prefetch_depth + 1, len(part.streamed))
    assert best.cut in range(1, 5)


@pytest.mark.parametrize("cut", [1, 2, 4])
def test_split_streams_both_parts_like_the_resident_model(cut):
    ref, _ = lora_model(seed=5)
    model = copy.deepcopy(ref)
    ref_losses = run_steps(ref, CALLS)
    plan = _split_plan(model, cut)
    assert all(p.mode == "stream" and p.activation_offload for p in plan.plans)
    handle = apply_split(model, FAMILY, plan, STREAM_ACT, _engine_factory=InlineCopyEngine)
    try:
        losses = run_steps(model, CALLS)
    finally:
        stats = handle.stats()
        handle.remove()
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    g_ref, g = grads(ref), grads(model)
    assert_grads_close(g, g_ref, rtol=1e-5)
    for part, n_blocks in zip(stats["parts"], (cut, len(named_blocks(model, FAMILY)) - cut)):
        assert part["loads"] >= n_blocks and part["activation_bytes_out"] > 0


def test_one_streamed_block_in_parts_gets_a_slot_per_part():
    """A whole model whose only streamed block is a double block (two units) needs two slots."""
    ref, _ = lora_model(num_double=1, num_single=2, seed=2)
    model = copy.deepcopy(ref)
    fp = measure_footprint(model, FAMILY)
    plan = build_plan(fp, Workload(1, 64, 7), [1, 2], 1, True)  # block 0 (the double block) streams
    assert plan.streamed == [0] and plan.streamed_units == 2 and plan.num_slots == 2
    handle = apply_offload(model, FAMILY, OffloadConfig(mode="stream"), torch.device("cpu"), plan=plan,
                           _engine_factory=InlineCopyEngine)
    try:
        losses = run_steps(model, CALLS)
    finally:
        handle.remove()
    assert losses == pytest.approx(run_steps(ref, CALLS), rel=1e-6)
    for name, g in grads(ref).items():
        torch.testing.assert_close(grads(model)[name], g, rtol=1e-5, atol=1e-7, msg=name)
