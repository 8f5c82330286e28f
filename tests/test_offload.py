"""Offload planning and scheduling: config validation, the ring scheduler against a fake
copy engine that checks every hand-over, and the plan arithmetic. No torch device work."""
import random

import pytest

from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.offload import OffloadConfig, help_text
from lowvram_lora.engine.offload.plan import (
    GB, HEADROOM_BYTES, ModelFootprint, Workload, build_plan, make_plan, resident_order,
)
from lowvram_lora.engine.offload.schedule import BlockScheduler, simulate_step_loads, visit_cycle


# ----------------------------------------------------------------------------- config

@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "swap"}, "auto, resident, stream"),
    ({"mode": "stream", "gradient_checkpointing": False}, "gradient_checkpointing=True"),
    ({"mode": "auto", "gradient_checkpointing": False}, "wrong gradients"),
    ({"mode": "resident", "prefetch_depth": 2}, "only apply to streaming"),
    ({"mode": "stream", "vram_budget_gb": 8}, "only applies to mode='auto'"),
    ({"vram_budget_gb": -1}, "vram_budget_gb"),
    ({"prefetch_depth": 0}, "prefetch_depth"),
    ({"resident_blocks": -2}, "resident_blocks"),
    ({"max_pinned_fraction": 1.0}, "max_pinned_fraction"),
])
def test_bad_offload_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        OffloadConfig(**kwargs)


def test_offload_config_defaults_and_help():
    cfg = OffloadConfig()
    assert cfg.mode == "auto" and cfg.gradient_checkpointing and cfg.streams
    assert not OffloadConfig(mode="resident", gradient_checkpointing=False).streams
    for name in ("mode", "vram_budget_gb", "resident_blocks", "prefetch_depth", "activation_offload",
                 "gradient_checkpointing", "max_pinned_fraction"):
        assert len(help_text(name)) > 40


# -------------------------------------------------------------------------- scheduler

class CheckingEngine:
    """A fake copy engine that plays the GPU: it knows what each slot holds and fails on any
    hand-over the real engine would get wrong."""

    def __init__(self, num_slots):
        self.content = [None] * num_slots
        self.in_use = [False] * num_slots  # a block ran from this slot and its release was not recorded
        self.loads = []

    def load(self, block, slot, evicted):
        assert not self.in_use[slot], f"slot {slot} overwritten with block {block} before its release"
        assert self.content[slot] == evicted
        self.content[slot] = block
        self.loads.append(block)

    def wait_ready(self, slot):
        self.in_use[slot] = True

    def release(self, slot):
        self.in_use[slot] = False


def run(sched, eng, blocks):
    for b in blocks:
        sched.visit(b)
        if b in sched.streamed:
            assert eng.content[sched.where[b]] == b, f"block {b} ran from a slot holding another block"


def make(n=6, streamed=None, k=2, slots=None):
    streamed = list(range(n)) if streamed is None else streamed
    eng = CheckingEngine(slots or k + 1)
    return BlockScheduler(n, streamed, slots or k + 1, k, eng), eng


def test_visit_cycle_merges_turnarounds():
    assert visit_cycle(5) == [0, 1, 2, 3, 4, 3, 2, 1]
    assert visit_cycle(2) == [0, 1] and visit_cycle(1) == [0]


def training_step(n):
    """Pre-hook order of one checkpointed step: forward, then recompute (= backward) in reverse."""
    return list(range(n)) + list(range(n - 1, -1, -1))


def test_prefetch_runs_ahead_in_forward_and_backward_order():
    sched, eng = make(n=6, k=2)
    sched.prime()
    assert eng.loads == [0, 1]  # the first blocks of the step, before it starts
    run(sched, eng, training_step(6))
    # Forward: each visit loads the block two ahead; the turnaround keeps 5, 4, 3 loaded (farthest-use
    # eviction), so backward only copies 2, 1 and 0 (0 is in fact needed next by the next forward).
    assert eng.loads == [0, 1, 2, 3, 4, 5, 2, 1, 0]
    assert sched.stats.sync_loads == 0 and sched.stats.resyncs == 0
    eng.loads.clear()
    run(sched, eng, training_step(6))  # steady state: blocks 0-2 stay loaded across the step boundary
    assert eng.loads == [3, 4, 5, 2, 1, 0]


def test_steady_state_steps_and_accumulation_never_miss():
    sched, eng = make(n=8, k=1)
    sched.prime()
    for _ in range(5):  # 5 micro-batches back to back (accumulation looks the same to the blocks)
        run(sched, eng, training_step(8))
    assert sched.stats.sync_loads == 0 and sched.stats.resyncs == 0
    per_step = simulate_step_loads(8, range(8), 1)
    # Every block twice, minus the turnaround blocks that stay loaded (k=1: two at each end).
    assert sorted(per_step) == sorted([2, 3, 4, 5, 6, 5, 4, 3, 2, 1, 0, 1][:len(per_step)]) or len(per_step) == 12
    assert len(per_step) == 2 * 8 - 4


def test_last_block_is_loaded_once_per_step():
    sched, eng = make(n=5, k=2)
    sched.prime()
    run(sched, eng, training_step(5))
    eng.loads.clear()
    run(sched, eng, training_step(5))
    assert eng.loads.count(4) == 1  # N-1: forward and its recompute are one visit


@pytest.mark.parametrize("k", [1, 2, 3])
def test_resident_blocks_are_never_copied(k):
    sched, eng = make(n=7, streamed=[0, 2, 3, 6], k=k)
    sched.prime()
    for _ in range(3):
        run(sched, eng, training_step(7))
    assert set(eng.loads) <= {0, 2, 3, 6}
    assert sched.stats.sync_loads == 0


def test_out_of_order_calls_load_synchronously_and_resync():
    sched, eng = make(n=6, k=2)
    sched.prime()
    run(sched, eng, range(6))  # an eval forward: no backward
    run(sched, eng, range(6))  # another: block 0 is not what the cycle predicts
    assert sched.stats.resyncs >= 1
    run(sched, eng, [0, 1, 2])  # a step interrupted in its forward
    run(sched, eng, training_step(6))  # then a normal step: resyncs and is right again
    misses = sched.stats.sync_loads
    run(sched, eng, training_step(6))
    assert sched.stats.sync_loads == misses  # back on the cycle: no more misses


def test_forward_only_passes_prefetch_the_next_pass():
    """Sampling between training steps: each no-grad pass's end prefetches the next pass's first blocks, so
    passes after the first never wait for a cold copy; training afterwards is back on its own cycle."""
    sched, eng = make(n=6, k=2)
    sched.prime()
    run(sched, eng, training_step(6))
    sched.start_pass(forward_only=True)
    for _ in range(4):  # 4 forwards (2 denoising steps of 2 forwards)
        run(sched, eng, range(6))
        sched.start_pass(forward_only=True)  # every forward of the model says so; no change: nothing happens
    assert sched.stats.sync_loads == 0 and sched.stats.resyncs == 0
    eng.loads.clear()
    run(sched, eng, range(6))
    assert eng.loads == [2, 3, 4, 5, 0, 1]  # each block once per pass, the next pass's first ones at its end
    sched.start_pass(forward_only=False)
    misses = sched.stats.sync_loads
    for _ in range(2):
        run(sched, eng, training_step(6))
        sched.start_pass(forward_only=False)
    assert sched.stats.sync_loads == misses and sched.stats.resyncs == 0


def test_forward_only_cycle_saves_the_cold_load_of_each_pass():
    """Against the training cycle (the scheduler before start_pass): every pass began with a synchronous load."""
    old, eng_old = make(n=8, k=1)
    old.prime()
    for _ in range(5):
        run(old, eng_old, range(8))
    new, eng_new = make(n=8, k=1)
    new.prime()
    new.start_pass(forward_only=True)
    for _ in range(5):
        run(new, eng_new, range(8))
    assert old.stats.sync_loads >= 4 and new.stats.sync_loads == 0


@pytest.mark.parametrize("seed", range(20))
def test_random_call_orders_keep_every_hand_over_safe(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    streamed = sorted(rng.sample(range(n), rng.randint(1, n)))
    k = rng.randint(1, 3)
    sched, eng = make(n=n, streamed=streamed, k=k, slots=k + 1 + rng.randint(0, 1))
    if rng.random() < 0.5:
        sched.prime()
    for _ in range(30):
        r = rng.random()
        if rng.random() < 0.3:  # the model's forward begins: with or without a backward to follow
            sched.start_pass(forward_only=r >= 0.5)
        run(sched, eng, training_step(n) if r < 0.5 else list(range(n)) if r < 0.7 else [rng.randrange(n)])
    # CheckingEngine asserts every load and every run


# ------------------------------------------------------------------------------- plan

MB = 1e6


def flux_dev_like(trainable=46_700_000):
    """Sizes of Flux.1-dev in bf16: 19 double blocks of 679 MB, 38 single of 283 MB."""
    blocks = [int(679.5 * MB)] * 19 + [int(283.2 * MB)] * 38
    return ModelFootprint("Flux.1 (flux1-dev)", [f"b{i}" for i in range(57)], blocks, int(128 * MB), trainable, 3072)


WL_1024 = Workload(batch=1, image_tokens=4096, text_tokens=512, label="1024x1024")


def test_resident_order_is_largest_first():
    assert resident_order([1, 5, 3, 5]) == [1, 3, 2, 0]


def test_resident_plan_and_stream_plan_numbers():
    fp = flux_dev_like()
    res = make_plan(fp, WL_1024, OffloadConfig(mode="resident"))
    assert res.mode == "resident" and res.streamed == [] and res.streamed_bytes_per_step == 0
    assert res.predicted_peak_bytes > fp.total_block_bytes
    st = make_plan(fp, WL_1024, OffloadConfig(mode="stream", prefetch_depth=2))
    assert st.num_slots == 3 and st.slot_bytes == fp.block_bytes[0]
    assert st.predicted_peak_bytes < 8 * GB
    # Fwd + recompute/bwd: almost twice the weights per step; never more.
    assert 1.8 * fp.total_block_bytes < st.streamed_bytes_per_step < 2 * fp.total_block_bytes
    assert st.pinned_host_bytes == fp.total_block_bytes
    r19 = make_plan(fp, WL_1024, OffloadConfig(mode="stream", resident_blocks=19, prefetch_depth=1))
    assert r19.resident == list(range(19)) and r19.slot_bytes == fp.block_bytes[-1]  # doubles resident
    assert "streamed" in st.describe() and "predicted peak" in st.describe()


def test_auto_keeps_everything_resident_when_it_fits():
    plan = make_plan(flux_dev_like(), WL_1024, OffloadConfig(), budget_bytes=int(70 * GB))
    assert plan.mode == "resident"


def test_auto_picks_more_resident_blocks_for_bigger_budgets():
    fp, cfg = flux_dev_like(), OffloadConfig()
    plans = [make_plan(fp, WL_1024, cfg, budget_bytes=int(b * GB)) for b in (6, 12, 20)]
    for p, b in zip(plans, (6, 12, 20)):
        assert p.mode == "stream" and p.predicted_peak_bytes + HEADROOM_BYTES <= b * GB
    counts = [len(p.resident) for p in plans]
    assert counts == sorted(counts) and counts[0] < counts[-1]
    streamed = [p.streamed_bytes_per_step for p in plans]
    assert streamed == sorted(streamed, reverse=True)


def test_auto_respects_fixed_choices():
    plan = make_plan(flux_dev_like(), WL_1024, OffloadConfig(prefetch_depth=1, activation_offload=False),
                     budget_bytes=int(12 * GB))
    assert plan.prefetch_depth == 1 and not plan.activation_offload


def test_auto_refuses_an_impossible_budget_and_names_the_smallest():
    fp = flux_dev_like()
    with pytest.raises(ConfigError, match=r"vram_budget_gb=1 is below the smallest plan") as err:
        make_plan(fp, WL_1024, OffloadConfig(), budget_bytes=int(1 * GB))
    need = float(str(err.value).split("at least ")[1].split(" GB")[0])
    plan = make_plan(fp, WL_1024, OffloadConfig(), budget_bytes=int(need * GB))  # that budget works
    assert plan.mode == "stream" and plan.prefetch_depth == 1
    assert plan.activation_offload  # the minimal plan moves activations too
    with pytest.raises(ConfigError):
        make_plan(fp, WL_1024, OffloadConfig(), budget_bytes=int((need - 0.2) * GB))


def test_activation_offload_shrinks_the_peak_at_high_resolution():
    fp = flux_dev_like()
    wl = Workload(batch=1, image_tokens=16384, text_tokens=512, label="2048x2048")
    off = build_plan(fp, wl, [], 2, False)
    on = build_plan(fp, wl, [], 2, True)
    saved = off.breakdown["activations"] - on.breakdown["activations"]
    assert saved > 5 * GB  # 55 of 57 blocks' inputs: 55 x 16896 x 3072 x 2 bytes
    # without activation offload the peak comes at the turn into the backward, with single blocks in the ring
    assert off.breakdown["weights"] == fp.other_bytes + 3 * int(283.2 * MB)
    assert on.breakdown["weights"] == fp.other_bytes + 3 * int(679.5 * MB)
    assert on.activation_bytes_per_step == 57 * 16896 * 3072 * 2
    assert on.pinned_host_bytes == fp.total_block_bytes + on.activation_bytes_per_step


def test_pinned_memory_limit():
    with pytest.raises(ConfigError, match="max_pinned_fraction"):
        make_plan(flux_dev_like(), WL_1024, OffloadConfig(mode="stream"), host_ram_bytes=int(16 * GB))
    fp = flux_dev_like()
    plan = make_plan(fp, WL_1024, OffloadConfig(mode="stream"), host_ram_bytes=int(128 * GB))
    # reference: the footprint's own block sizes; the plan pins every streamed block once (exact), within the limit
    assert plan.pinned_host_bytes == fp.total_block_bytes == sum(fp.block_bytes)
    assert plan.pinned_host_bytes <= OffloadConfig().max_pinned_fraction * 128 * GB


def test_too_many_resident_blocks():
    with pytest.raises(ConfigError, match="only 57 blocks"):
        make_plan(flux_dev_like(), WL_1024, OffloadConfig(mode="stream", resident_blocks=60))


def test_an_auto_budget_holds_the_allocator_and_lets_go_afterwards(monkeypatch):
    """The allocator may reserve the budget plus what was held before training, and the limit is lifted afterwards,
    also when training fails; nothing is capped without an explicit auto budget. One GPU (Streamed) and a split
    (each part's device to its own budget, what each held before on top)."""
    import types

    import torch

    from lowvram_lora.engine.callbacks import TrainingCallback
    from lowvram_lora.engine.parallel import ParallelConfig
    from lowvram_lora.engine.train.placement import Split, Streamed

    calls = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: calls.append((round(f, 4), i)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 * GB))
    plan = build_plan(flux_dev_like(), WL_1024, [], 1, True, budget_bytes=int(4 * GB))
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)

    def streamed(cfg, dev, handle=types.SimpleNamespace(plan=plan)):
        placement = Streamed(cfg, dev)
        placement.handle = handle
        return placement

    with pytest.raises(RuntimeError, match="boom"):
        with streamed(OffloadConfig(mode="auto", vram_budget_gb=4), cuda0).cap_allocator({cuda0: int(1 * GB)},
                                                                                          TrainingCallback()):
            assert calls == [(round(5 / 80, 4), 0)]
            raise RuntimeError("boom")
    assert calls[-1] == (1.0, 0)
    calls.clear()
    for placement in [streamed(OffloadConfig(mode="auto"), cuda0),  # budget 0: most of the free memory, no cap
                      streamed(OffloadConfig(mode="stream"), cuda0),
                      streamed(OffloadConfig(mode="auto", vram_budget_gb=4), torch.device("cpu")),
                      streamed(OffloadConfig(mode="auto", vram_budget_gb=4), cuda0, handle=None)]:
        with placement.cap_allocator({cuda0: 0}, TrainingCallback()):
            pass
    assert calls == []

    second = build_plan(flux_dev_like(), WL_1024, [], 1, True, budget_bytes=int(6 * GB))
    for budgets, offload_gb, held, want in [
            ((4.0, 6.0), 0, {cuda0: int(1 * GB), cuda1: int(2 * GB)}, [(5 / 80, 0), (8 / 80, 1)]),
            ((0.0, 6.0), 0, {cuda0: 0, cuda1: 0}, [(6 / 80, 1)]),  # the first GPU's budget from its free memory
            ((0.0, 0.0), 4, {cuda0: 0, cuda1: 0}, [(4 / 80, 0), (6 / 80, 1)])]:  # Offload Config's, for both
        calls.clear()
        split = Split(OffloadConfig(mode="auto", vram_budget_gb=offload_gb), cuda0,
                      ParallelConfig(mode="split", devices=("cuda:0", "cuda:1"), vram_budget_gb=budgets))
        split.handle = types.SimpleNamespace(plan=types.SimpleNamespace(plans=(plan, second)))
        logs = []
        cb = TrainingCallback()
        cb.log = logs.append
        with split.cap_allocator(held, cb):
            assert calls == [(round(f, 4), i) for f, i in want]
        assert calls[len(want):] == [(1.0, i) for _, i in reversed(want)]
        assert len(logs) == len(want) and all("VRAM held to the budget on cuda:" in m for m in logs)
