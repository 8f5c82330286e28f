"""The interleaved pipelined Dual-GPU Split (issue 42: virtual stages): the planner's chunks, step and memory, and the
run on ``cpu,cpu`` against one device."""
from dataclasses import replace

import pytest
import torch
from helpers import assert_grads_close, trained_grads

from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.offload import OffloadConfig, Workload
from lowvram_lora.engine.offload.plan import GB, SAVED_INPUT_UNITS, ModelFootprint
from lowvram_lora.engine.offload.steptime import Machine, peak_flops_for
from lowvram_lora.engine.parallel import ParallelConfig
from lowvram_lora.engine.parallel.one_f_one_b import bound, held_blocks, runnable_schedule, schedule
from lowvram_lora.engine.parallel.split import chunk_shares, part_footprints, pipelined_step_s, plan_split

GPUS = (torch.device("cuda:0"), torch.device("cuda:1"))
H100 = Machine(link_bytes_per_s=50 * GB, peak_flops=peak_flops_for("NVIDIA H100 80GB HBM3"), name="H100",
               source="probe")


def _footprint(n=20, hidden=3072):
    return ModelFootprint(name="m", block_names=[f"b{i}" for i in range(n)], block_bytes=[int(0.5 * GB)] * n,
                          other_bytes=int(0.5 * GB), trainable_params=n * 1000, hidden_size=hidden)


def _plan(v, m=4, budget=30, fp=None, **kw):
    fp = fp or _footprint()
    return plan_split(fp, [1000] * fp.num_blocks, 0, Workload(4, 4096, 512), OffloadConfig(mode="auto"), GPUS,
                      (int(budget * GB),) * 2, machines=(H100, H100), micro_batches=m, virtual_stages=v, **kw)


def test_interleaved_plan_places_every_cut_and_predicts_the_shorter_step():
    one, two = _plan(1), _plan(2)
    assert two.chunks == 2 and len(two.cuts) == 3 and two.cut == two.cuts[0]
    ranges = two.chunk_ranges
    assert [r.start for r in ranges] == [0, *two.cuts] and ranges[-1].stop == 20
    # each device's part holds its chunks' blocks, in order: chunks 0 and 2 on the first, 1 and 3 on the second
    assert two.plans[0].footprint.block_names == [f"b{i}" for c in (0, 2) for i in ranges[c]]
    assert two.plans[1].footprint.block_names == [f"b{i}" for c in (1, 3) for i in ranges[c]]
    # equal blocks: equal chunks, so each op is half its device's part and the makespan is the interleaved closed form
    assert [len(r) for r in ranges] == [5, 5, 5, 5] and two.chunk_shares == pytest.approx((0.5,) * 4)
    parts = [p.step_time.seconds for p in two.plans]
    assert two.predicted_step_s == pytest.approx(pipelined_step_s(parts, 4, two.crossing_s, 1, 2, two.chunk_shares))
    per = max(parts) / 4  # the slower part's time per micro-batch; crossings add a few crossing_s on top
    assert two.predicted_step_s == pytest.approx((4 + 1 / 2) * per, abs=6 * two.crossing_s / 8 + 0.02 * per)
    assert two.predicted_step_s < one.predicted_step_s
    assert sum(parts) / two.predicted_step_s == pytest.approx(bound(4, 2), rel=0.03)  # 1.78x the parts in turn
    text = two.describe()
    assert "virtual_stages 2" in text and "interleaved 1F1B, v = 2" in text and "3 crossings each way" in text
    assert two.summary()["virtual_stages"] == 2 and two.summary()["cuts"] == list(two.cuts)
    assert one.chunks == 1 and one.cuts == () and "interleaved" not in one.describe()  # v = 1: as before


def test_interleaved_first_part_holds_the_chunk_passes_in_flight():
    """Megatron's warm-up keeps five half-size chunk passes on the first GPU at v = 2, M = 4 (2.5 micro-batches'
    block inputs, against two at v = 1): counted in its peak, with the further crossings; no activation offload on
    either part (a chunk holds two micro-batches at once there)."""
    two = _plan(2)
    unit = 1 * 4608 * 3072 * 2  # one micro-batch's B*T*D in bf16
    sizes = {c: len(r) for c, r in enumerate(two.chunk_ranges)}
    for stage, part in enumerate(two.plans):
        held = held_blocks(schedule(4, 2, 2)[stage], sizes, stage)
        n = part.footprint.num_blocks
        assert part.breakdown["pipelined inputs"] == int((held / n - 1) * n * SAVED_INPUT_UNITS * unit)
        assert part.breakdown["interleaved crossings"] == int(2 * unit)
        assert not part.activation_offload
    assert held_blocks(schedule(4, 2, 2)[0], sizes, 0) == 25 and held_blocks(schedule(4, 2, 2)[1], sizes, 1) == 15
    assert "head and crossing" in two.plans[0].breakdown and "head and crossing" not in two.plans[1].breakdown


def test_auto_picks_the_shortest_predicted_step_and_says_why():
    plans = {v: _plan(v) for v in (1, 2, 3)}
    auto = _plan(0)
    best = min(plans, key=lambda v: plans[v].predicted_step_s)
    assert auto.chunks == best > 1 and auto.predicted_step_s == pytest.approx(plans[best].predicted_step_s)
    assert f"virtual_stages auto: {best}" in auto.reason
    odd = _plan(0, m=3, fp=_footprint())
    assert odd.chunks == 1 and "micro_batches 3 is odd" in odd.describe()


def test_chunk_shares_follow_the_blocks_flops():
    fp = _footprint(8)
    fp = replace(fp, block_params=[4, 4, 1, 1, 1, 1, 1, 1])  # two large blocks first
    shares = chunk_shares(fp, Workload(1, 64, 0), (2, 4, 6))
    # the first device's chunks 0 (blocks 0-1) and 2 (blocks 4-5); equal attention per block, Linears by params
    assert shares[0] > shares[2] and shares[0] + shares[2] == pytest.approx(1) and shares[1] == pytest.approx(0.5)
    first, second = part_footprints(fp, [1] * 8, 3, (2, 4, 6))
    assert first.block_params == [4, 4, 1, 1] and second.block_params == [1, 1, 1, 1]
    assert first.trainable_params == 4 + 3 and second.other_bytes == 0 and first.name.endswith("blocks 0-1, 4-5")


@pytest.mark.parametrize("kw, match", [
    (dict(virtual_stages=2, micro_batches=3), "micro_batches to a multiple of 2"),
    (dict(virtual_stages=2, micro_batches=1), "micro_batches to a multiple of 2"),
    (dict(virtual_stages=2, micro_batches=4, cut=5), "leave cut at -1"),
    (dict(virtual_stages=5, micro_batches=4), "from 0 \\(auto\\) to 4"),
    (dict(virtual_stages=2, mode="data_parallel"), "only applies to split"),
])
def test_config_refuses_what_cannot_interleave(kw, match):
    with pytest.raises(ConfigError, match=match):
        ParallelConfig(**{"devices": ("cpu", "cpu"), **kw})
    assert ParallelConfig(devices=("cpu", "cpu")).virtual_stages == 1  # default: not interleaved
    assert ParallelConfig(devices=("cpu", "cpu"), micro_batches=3, virtual_stages=0).virtual_stages == 0  # auto


def test_planner_refuses_what_cannot_interleave():
    with pytest.raises(ConfigError, match="virtual_stages=2 interleaves micro-batches in groups of 2, but "
                                          "micro_batches is 3"):
        _plan(2, m=3)
    with pytest.raises(ConfigError, match="leave cut at -1"):
        _plan(2, cut=5)
    with pytest.raises(ConfigError, match="cuts the model into 8 chunks but it has 6 blocks"):
        _plan(4, fp=_footprint(6))


# -- the runner on two CPU "devices" --------------------------------------------------------------------

CPU2 = (torch.device("cpu"), torch.device("cpu"))


def _tiny(family_id: str, blocks: dict, seed: int = 5):
    """The family's tiny transformer with more blocks (``blocks``: its config's layer counts) and LoRA r4 whose B is
    random (every LoRA weight gets a gradient), gradient checkpointing on."""
    from helpers import tiny_lora_transformer

    model, _, family = tiny_lora_transformer(family_id, blocks, seed)
    return model, family


def _pieces(model, family, n=4):
    """``n`` micro-batches (texts of 7.. tokens, their own noise levels and targets), each loss 1/n of the batch's."""
    from helpers import family_inputs
    from lowvram_lora.engine.families import predict_velocity

    out = []
    for k in range(n):
        latents, embeds, sigma = family_inputs(model, family, length=7 + k, sigma=0.2 + 0.15 * k)
        latents = latents + 0.1 * k
        target = torch.randn(latents.shape, generator=torch.Generator().manual_seed(100 + k))

        def run(latents=latents, embeds=embeds, sigma=sigma, target=target):
            pred = predict_velocity(family, model, latents, embeds, sigma, 1.0)
            loss = torch.nn.functional.mse_loss(pred.float(), target) / n
            return loss, loss
        out.append(run)
    return out


@pytest.mark.parametrize("family_id, blocks, v, stream, n", [
    ("flux1", dict(num_layers=2, num_single_layers=3), 2, False, 4),
    ("flux1", dict(num_layers=2, num_single_layers=4), 3, True, 4),  # both parts streamed, each its chunks' ranges
    ("flux1", dict(num_layers=2, num_single_layers=2), 2, False, 3),  # a smaller batch: an odd count of pieces
    ("flux2", dict(num_layers=2, num_single_layers=2), 2, False, 4),
    ("qwen_image", dict(num_layers=4), 2, False, 4),
    ("wan", dict(num_layers=4), 2, True, 4),
])
def test_interleaved_gradients_equal_one_device(family_id, blocks, v, stream, n):
    """Four micro-batches (three: a smaller batch) through 2v chunks on cpu,cpu in the interleaved order give the
    one-device losses and LoRA gradients (rtol 1e-4), every chunk crossing as it would between two GPUs; each device
    ran its ops in the schedule's order."""
    import copy

    from lowvram_lora.engine.offload.footprint import measure_footprint
    from lowvram_lora.engine.offload.streamer import InlineCopyEngine
    from lowvram_lora.engine.parallel.split import apply_split, trainable_per_block

    model, family = _tiny(family_id, blocks)
    reference = copy.deepcopy(model)
    ref_losses = []
    for run in _pieces(reference, family, n):
        loss, _ = run()
        loss.backward()
        ref_losses.append(loss.item())
    g_ref = trained_grads(reference)
    offload = OffloadConfig(mode="stream", prefetch_depth=1, resident_blocks=0) if stream else \
        OffloadConfig(mode="resident")
    fp = measure_footprint(model, family)
    per_block, outside = trainable_per_block(model, family)
    assert outside == 0
    plan = plan_split(fp, per_block, outside, Workload(4, 64, 7), offload, CPU2, (None, None), micro_batches=4,
                      virtual_stages=v)
    assert plan.chunks == v and len(plan.chunk_ranges) == 2 * v
    if stream:
        assert all(p.streamed for p in plan.plans) and not any(p.activation_offload for p in plan.plans)
    handle = apply_split(model, family, plan, offload, _engine_factory=InlineCopyEngine)
    try:
        losses = handle.pipeline.run(_pieces(model, family, n))
        assert tuple(handle.pipeline.last_order) == tuple(list(ops) for ops in runnable_schedule(n, 2, v))
        stats = handle.stats()
        assert stats["cuts"] == list(plan.cuts)
        if stream:  # each part's streamer loaded its blocks for every chunk pass (both of its ranges)
            for part, part_plan in zip(stats["parts"], plan.plans):
                assert part["visits"] >= n * part_plan.footprint.num_blocks and part["loads"] > 0
    finally:
        handle.remove()
    assert [x.item() for x in losses] == pytest.approx(ref_losses, rel=1e-5)
    g = trained_grads(model)
    assert_grads_close(g, g_ref, rtol=1e-4)


def test_train_lora_interleaved_split_on_cpu_equals_unsplit(tiny_pipeline, tiny_cache):
    """Train LoRA end to end: Dual-GPU Split on cpu,cpu with micro_batches=2 and virtual_stages=2 (the tiny Flux.1's
    four blocks in four chunks), the modulation window on, gives the one-device run's losses and LoRA (rtol 1e-4)."""
    from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.models import load_transformer
    from lowvram_lora.engine.train import train_lora

    cfg = ModelConfig(transformer_path=str(tiny_pipeline))
    lora, train = LoraSettings(rank=4), TrainConfig(steps=2, learning_rate=2e-3, seed=2, device="cpu", batch_size=2)
    base, family, _, variant = load_transformer(tiny_pipeline, dtype=torch.float32)
    split = train_lora(cfg, tiny_cache, lora, train, preloaded=(base, family, variant),
                       offload=OffloadConfig(mode="resident"), step_window=2,
                       split=ParallelConfig(mode="split", devices=("cpu", "cpu"), micro_batches=2, virtual_stages=2))
    plan = split.settings["offload_plan"]
    assert plan["virtual_stages"] == 2 and plan["cuts"] == [1, 2, 3]
    assert split.settings["offload_stats"]["pipelined_micro_batches"] == 4
    whole = train_lora(cfg, tiny_cache, lora, train, preloaded=(base, family, variant), step_window=0)
    assert split.loss_history == pytest.approx(whole.loss_history, rel=1e-4)
    for k, v in whole.state_dict.items():
        torch.testing.assert_close(split.state_dict[k], v, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("v", [1, 2])
def test_the_runner_keeps_no_tensor_that_autograd_let_go(v):
    """Flux.2's last double block returns its text and image streams, which the model only concatenates for the single
    blocks: checkpointed, nothing keeps them after the concatenation, and a pipelined step must not either (the runner
    once kept every block output it recorded for the micro-batch's whole backward: 1.0-1.4 GB more on the first GPU of
    a Flux.2-dev split on 2x H200 than its plan, an out-of-memory under the per-GPU cap). The reference is one device's
    forward, where they are gone once the forward returns."""
    import weakref

    from lowvram_lora.engine.offload.footprint import measure_footprint
    from lowvram_lora.engine.parallel.split import apply_split, trainable_per_block

    def outputs_alive_after_forward(model, family, run_pieces):
        import threading

        last_double = model.transformer_blocks[-1]
        refs, alive = {}, []  # each micro-batch's thread its own outputs (the pipelined forwards overlap)
        hook = last_double.register_forward_hook(
            lambda m, a, out: refs.setdefault(threading.get_ident(), []).extend(weakref.ref(t) for t in out))
        try:
            pieces = _pieces(model, family, 4)

            def watched(run):
                def piece():
                    refs[threading.get_ident()] = []
                    out = run()
                    seen = refs[threading.get_ident()]
                    alive.append((len(seen), sum(r() is not None for r in seen)))
                    return out
                return piece
            run_pieces([watched(p) for p in pieces])
        finally:
            hook.remove()
        return alive

    model, family = _tiny("flux2", dict(num_layers=2, num_single_layers=4))

    def one_device(pieces):
        for p in pieces:
            loss, _ = p()
            loss.backward()
    # (outputs the hook saw, outputs alive): both streams seen, so the hook watched the right block, and none kept
    assert outputs_alive_after_forward(model, family, one_device) == [(2, 0)] * 4
    fp = measure_footprint(model, family)
    per_block, outside = trainable_per_block(model, family)
    plan = plan_split(fp, per_block, outside, Workload(4, 64, 7), OffloadConfig(mode="resident"), CPU2, (None, None),
                      micro_batches=4, virtual_stages=v)
    handle = apply_split(model, family, plan, OffloadConfig(mode="resident"))
    try:
        assert outputs_alive_after_forward(model, family, handle.pipeline.run) == [(2, 0)] * 4
    finally:
        handle.remove()
