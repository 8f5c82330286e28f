"""bench/bench_parallel.py --plan-only: the split's plans without a GPU (the full-size variants on the meta device; a
tiny one here), one per --virtual-stages, each as the planner gives it."""
import re

import pytest
import torch
from helpers import bench_module

from lowvram_lora.engine.parallel.split import plan_split


def test_plan_only_prints_the_planners_plan_for_each_virtual_stage(capsys, monkeypatch):
    bench = bench_module("bench_parallel")
    seen = []

    def recording(*args, **kw):  # the planner's own plan, to compare with what the script prints
        plan = plan_split(*args, **kw)
        seen.append(plan)
        return plan

    monkeypatch.setattr("lowvram_lora.engine.parallel.split.plan_split", recording)
    assert bench.main(["--plan-only", "--variant", "flux1-tiny", "--res", "128", "--micro-batches", "2",
                       "--virtual-stages", "1", "2", "--budget", "1"]) == 0
    out = capsys.readouterr().out
    heads = re.findall(r"^v = (\d), M = 2: predicted step ([\d.]+) s", out, re.M)
    assert [int(v) for v, _ in heads] == [1, 2] == [p.chunks for p in seen]
    assert all(p.micro_batches == 2 and p.devices == (torch.device("cuda:0"), torch.device("cuda:1")) for p in seen)
    # the first GPU's plan keeps the pipelined first part's terms, the second's not
    for plan in seen:
        assert "first GPU's measured excess" in plan.plans[0].breakdown
        assert "first GPU's measured excess" not in plan.plans[1].breakdown
    assert out.count("first GPU's measured excess") == 2


def test_narrow_keeps_every_block_of_the_variant_at_a_tiny_width():
    """--narrow (train_bench.narrow_config): the variant's depth, so a step runs every operator the full model runs,
    at a width whose kernels take next to no GPU time."""
    import pytest

    from lowvram_lora.engine.families import get_family, meta_model

    train_bench = bench_module("train_bench")
    for family_id, variant in (("flux1", "flux1-dev"), ("flux2", "flux2-dev")):
        family = get_family(family_id)
        full = family.load_config(variant)
        cfg = train_bench.narrow_config(full)
        assert cfg["num_layers"] == full["num_layers"] and cfg["num_single_layers"] == full["num_single_layers"]
        assert cfg["attention_head_dim"] == 32 and sum(cfg["axes_dims_rope"]) == 32
        model = meta_model(family, cfg)
        ops = lambda m: sorted(type(x).__name__ for x in m.modules())  # noqa: E731
        assert ops(model) == ops(meta_model(family, full))  # the same modules, so the same operators
        narrow_params = sum(p.numel() for p in model.parameters())
        assert narrow_params < 1e-3 * sum(p.numel() for p in meta_model(family, full).parameters())
    with pytest.raises(SystemExit, match="attention_head_dim"):
        train_bench.narrow_config({"_class_name": "WanTransformer3DModel", "num_attention_heads": 40})


def test_every_training_row_carries_host_ram_beside_vram():
    """train_bench.host_fields (in every training_row): the process's RSS, read against /proc/self/status's own
    VmRSS (within 5%), and the most host RAM and pinned memory the steps reported."""
    from types import SimpleNamespace

    train_bench = bench_module("train_bench")
    steps = [SimpleNamespace(host_ram_gb=1.5, pinned_host_gb=0.25), SimpleNamespace(host_ram_gb=2.5, pinned_host_gb=0.75)]
    fields = train_bench.host_fields(steps)
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    vm_rss_gb = int(status["VmRSS"].split()[0]) * 1024 / 1e9
    assert abs(fields["host_rss_gb"] - vm_rss_gb) < 0.05 * vm_rss_gb
    assert fields["host_ram_peak_gb"] == 2.5 and fields["pinned_host_gb"] == 0.75


def test_batch_puts_several_images_in_each_micro_batch(monkeypatch):
    """--batch B with --micro-batches M: B images a step in every mode, B / M in each micro-batch (the split's host
    calls are per micro-batch); the plan is made for that batch, and a B that M does not divide is refused."""
    bench = bench_module("bench_parallel")
    assert bench.parse_args(["--micro-batches", "4"]).batch == 4  # one image a micro-batch, as before
    assert bench.parse_args(["--micro-batches", "4", "--batch", "8"]).batch == 8
    seen = []

    def recording(*args, **kw):
        plan = plan_split(*args, **kw)
        if kw.get("suggest", True):  # the script's own call, not the planner's further plans
            seen.append((args[3], plan))
        return plan

    monkeypatch.setattr("lowvram_lora.engine.parallel.split.plan_split", recording)
    assert bench.main(["--plan-only", "--variant", "flux1-tiny", "--res", "128", "--micro-batches", "2",
                       "--batch", "4", "--virtual-stages", "1", "--budget", "1"]) == 0
    (workload, plan), = seen
    assert workload.batch == 4 and plan.micro_batches == 2
    for bad in ("6", "-8"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--micro-batches", "4", "--batch", bad])
