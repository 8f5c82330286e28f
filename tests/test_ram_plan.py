"""Host RAM as a budget (issue 35): the cgroup/proc readers on a fake file tree, the RAM plan's accounting, and the
choices ``auto`` makes under a VRAM and a RAM budget together. Pure arithmetic on a Flux.1-dev-shaped footprint
(57 blocks: 19 double of 2.4x the bytes of 38 single), no model."""
from __future__ import annotations

import os

from pathlib import Path

import pytest

from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.offload import OffloadConfig
from lowvram_lora.engine.offload import hostmem
from lowvram_lora.engine.offload.plan import (
    GB, MOMENT_BYTES_PER_PARAM, PROCESS_BASE_BYTES, ModelFootprint, Workload, build_plan, make_plan,
)
from lowvram_lora.engine.offload.steptime import Machine

MEMINFO = "MemTotal:       32768000 kB\nMemFree:         1000000 kB\nMemAvailable:   20480000 kB\n"
STATUS = ("Name:\tpython\nVmLck:\t       0 kB\nVmPin:\t    2048 kB\nVmRSS:\t 4194304 kB\nRssAnon:\t 3145728 kB\n"
          "RssFile:\t 1048576 kB\nRssShmem:\t       0 kB\n")


def fake_tree(tmp_path, cgroup_line: str | None = None, files: dict | None = None):
    """A root with proc/meminfo, proc/self/status, proc/self/cgroup and sys/fs/cgroup/... files."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(MEMINFO)
    (tmp_path / "proc/self/status").write_text(STATUS)
    if cgroup_line is not None:
        (tmp_path / "proc/self/cgroup").write_text(cgroup_line)
    for rel, text in (files or {}).items():
        path = tmp_path / "sys/fs/cgroup" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


# --- the readers ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("files, want", [
    ({}, None),  # no cpu.max: the affinity mask
    ({"cpu.max": "max 100000\n", "app/cpu.max": "max 100000\n"}, None),
    ({"app/cpu.max": "300000 100000\n"}, 3),  # the process's own cgroup
    ({"cpu.max": "200000 100000\n", "app/cpu.max": "max 100000\n"}, 2),  # a parent's quota holds too
    ({"app/cpu.max": "50000 100000"}, 1),  # below one CPU: one
    ({"app/cpu.max": "garbled"}, None),
])
def test_usable_cpus_is_the_affinity_within_the_cgroups_cpu_quota(tmp_path, files, want):
    """Worker processes take their share of these (engine/runs/launch.worker_env) as torch threads."""
    cpus = len(os.sched_getaffinity(0))
    root = fake_tree(tmp_path, "0::/app\n", files)
    (root / "sys/fs/cgroup/app").mkdir(parents=True, exist_ok=True)
    assert hostmem.usable_cpus(root) == (cpus if want is None else min(cpus, want))


def test_no_cgroup_reads_meminfo(tmp_path):
    root = fake_tree(tmp_path)
    assert hostmem.physical_ram_bytes(root) == 32768000 * 1024
    assert hostmem.cgroup_limit_bytes(root) is None
    mem = hostmem.process_memory(root)
    assert (mem.rss, mem.anon, mem.file, mem.locked) == (4194304 * 1024, 3145728 * 1024, 1048576 * 1024, 2048 * 1024)
    # others = MemTotal - MemAvailable - this process's unreclaimable pages (anon + shmem)
    others = (32768000 - 20480000 - 3145728) * 1024
    assert hostmem.in_use_by_others(root) == others
    budget = hostmem.resolve_ram_budget(0, root)
    assert budget.bytes == int(hostmem.SAFETY_FRACTION * (32768000 * 1024 - others))
    assert "auto" in budget.describe() and "34 GB RAM" in budget.describe()


def test_cgroup_v2_limit_is_the_smallest_up_the_tree(tmp_path):
    root = fake_tree(tmp_path, "0::/user.slice/app.scope\n", {
        "user.slice/memory.max": str(12 * 2**30) + "\n",
        "user.slice/app.scope/memory.max": "max\n",
        "user.slice/app.scope/memory.current": str(6 * 2**30) + "\n",
        "user.slice/app.scope/memory.stat": f"anon {2 * 2**30}\nfile {2 * 2**30}\nfile_mapped 5\n",
    })
    assert hostmem.cgroup_limit_bytes(root) == 12 * 2**30
    assert hostmem.cgroup_usage_bytes(root) == 4 * 2**30  # page cache (file) is reclaimable: not held
    # others: the cgroup's usage less this process's own 3 GiB of anonymous pages
    assert hostmem.in_use_by_others(root) == 1 * 2**30
    budget = hostmem.resolve_ram_budget(0, root)
    assert budget.limit == 12 * 2**30 and budget.bytes == int(hostmem.SAFETY_FRACTION * 11 * 2**30)
    assert hostmem.ram_cap_bytes(root) == 12 * 2**30
    assert hostmem.resolve_ram_budget(5.5, root).bytes == int(5.5 * GB)  # a set budget is kept as set


def test_cgroup_v2_namespace_root_and_no_limit(tmp_path):
    """Inside a container the process's cgroup is the mount's root ("0::/"); "max" is no limit."""
    root = fake_tree(tmp_path, "0::/\n", {"memory.max": "max\n", "memory.current": "100\n"})
    assert hostmem.cgroup_limit_bytes(root) is None
    root2 = fake_tree(tmp_path / "b", "0::/\n", {"memory.max": "8589934592\n", "memory.current": "0\n"})
    assert hostmem.cgroup_limit_bytes(root2) == 8589934592
    assert hostmem.ram_cap_bytes(root2) == 8589934592  # below the 32 GB of physical RAM


def test_cgroup_v1_limit(tmp_path):
    root = fake_tree(tmp_path, "12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc\n", {
        "memory/docker/abc/memory.limit_in_bytes": str(16 * 2**30),
        "memory/docker/abc/memory.usage_in_bytes": str(5 * 2**30),
        "memory/docker/abc/memory.stat": f"total_cache {1 * 2**30}\n",
        "memory/docker/memory.limit_in_bytes": "9223372036854771712",  # v1's "no limit"
    })
    assert hostmem.cgroup_limit_bytes(root) == 16 * 2**30
    assert hostmem.cgroup_usage_bytes(root) == 4 * 2**30


def test_unreadable_tree_is_not_an_error(tmp_path):
    assert hostmem.process_memory(tmp_path).rss == 0
    assert hostmem.cgroup_limit_bytes(tmp_path) is None
    assert hostmem.physical_ram_bytes(tmp_path) > 0  # sysconf


def test_ram_budget_gb_is_checked():
    with pytest.raises(ConfigError, match="ram_budget_gb"):
        OffloadConfig(ram_budget_gb=-1)
    with pytest.raises(ConfigError, match="ram_budget_gb"):
        OffloadConfig(ram_budget_gb=float("nan"))


# --- the RAM plan ---------------------------------------------------------------------------------------------------

DOUBLE, SINGLE = int(0.34 * GB), int(0.14 * GB)  # Flux.1-dev int8 slab blocks (about)
WL = Workload(batch=1, image_tokens=4096, text_tokens=512, label="1024x1024")
FAST = Machine(link_bytes_per_s=54e9, peak_flops=989e12)
DISK = Machine(link_bytes_per_s=54e9, peak_flops=989e12, disk_bytes_per_s=7e9)


def flux_like(slab: bool = True) -> ModelFootprint:
    return ModelFootprint(name="flux-like", block_names=[f"b{i}" for i in range(57)],
                          block_bytes=[DOUBLE] * 19 + [SINGLE] * 38, other_bytes=int(0.13 * GB),
                          trainable_params=46_700_000, hidden_size=3072, file_backed=slab, disk_capable=slab)


def test_host_accounting_adds_up():
    fp = flux_like()
    plan = build_plan(fp, WL, range(10), 2, True, optimizer_on_host=True, resume_staging=True)
    streamed = sum(fp.block_bytes[i] for i in plan.streamed)
    parts = plan.host_breakdown
    assert parts["process"] == PROCESS_BASE_BYTES
    assert parts["blocks"] == streamed
    assert parts["activations"] == plan.activation_bytes_per_step > 0
    assert parts["moments"] == fp.trainable_params * MOMENT_BYTES_PER_PARAM
    assert parts["resume"] == fp.trainable_params * (4 + 8)  # fp32 weights + two fp32 moments
    assert parts["weights kept"] == fp.other_bytes  # a slab's resident int8 weights are file pages: not counted
    assert plan.host_phases["train"] == sum(parts.values())
    assert plan.host_phases["load"] == PROCESS_BASE_BYTES + fp.other_bytes + streamed
    assert plan.predicted_host_peak_bytes == max(plan.host_phases.values())
    # A checkpoint read into host memory (not a slab) holds every frozen byte while loading, and the streamer keeps
    # the host copies of what it moved to the GPU.
    loaded = build_plan(flux_like(slab=False), WL, range(10), 2, True)
    assert loaded.host_breakdown["weights kept"] == fp.other_bytes + sum(fp.block_bytes[i] for i in loaded.resident)
    assert loaded.host_phases["load"] == PROCESS_BASE_BYTES + fp.other_bytes + fp.total_block_bytes + DOUBLE
    # A preview partner and the caching pass are counted where named.
    extra = build_plan(fp, WL, range(10), 2, False, host_extra={"preview partner": 5 * 10**9, "caching": 3 * 10**9})
    assert extra.host_breakdown["preview partner"] == 5 * 10**9
    assert extra.host_phases["caching"] == PROCESS_BASE_BYTES + 3 * 10**9
    text = extra.describe()
    assert "predicted host RAM peak" in text and "preview partner 5.00" in text
    assert extra.summary()["predicted_host_peak_gb"] == round(extra.predicted_host_peak_bytes / GB, 3)


def test_disk_blocks_leave_host_ram():
    fp = flux_like()
    base = build_plan(fp, WL, [], 1, False)
    disk = build_plan(fp, WL, [], 1, False, disk_blocks=range(30, 57))
    from lowvram_lora.engine.offload.disk import read_bytes_of

    ring = disk.staging_slots * read_bytes_of(SINGLE)  # each slot holds the largest disk block's aligned read
    saved = 27 * SINGLE - ring
    assert disk.host_breakdown["staging"] == ring
    assert base.predicted_host_peak_bytes - disk.predicted_host_peak_bytes == saved
    assert disk.disk_bytes_per_step > 27 * SINGLE  # most disk blocks load twice a step (forward and backward)
    with pytest.raises(ConfigError, match="streamed blocks"):
        build_plan(fp, WL, [50], 1, False, disk_blocks=[50])


def auto(vram, ram=None, machine=FAST, slab=True, **cfg):
    return make_plan(flux_like(slab), WL, OffloadConfig(mode="auto", vram_budget_gb=vram, **cfg), int(vram * GB),
                     64 * 10**9, machine=machine, ram_budget_bytes=int(ram * GB) if ram else None,
                     resume_staging=False)


def test_auto_ram_budget_changes_nothing_when_it_fits():
    free, held = auto(8), auto(8, ram=12)
    assert free.summary()["resident_blocks"] == held.summary()["resident_blocks"]
    assert held.predicted_host_peak_bytes <= 12 * GB and not held.disk_blocks


def test_auto_trades_activation_offload_for_recompute_when_ram_is_short():
    """At 4 GB of VRAM the fastest plan offloads activations; a RAM budget that cannot hold them gets a plan that
    keeps them on the GPU (token chunks where needed), never activations on disk, and says why."""
    free = auto(4, compile="off")
    assert free.activation_offload
    short = auto(4, ram=free.predicted_host_peak_bytes / GB - 1.5, compile="off")
    assert not short.activation_offload and not short.disk_blocks and short.recompute_chunks > 1
    assert short.predicted_host_peak_bytes <= free.predicted_host_peak_bytes - 1.5 * GB
    assert "never written to disk" in short.ram_note and "never written to disk" in short.describe()


def test_partial_activation_offload_counts_its_blocks():
    """Offloading the inputs of some blocks: host RAM and link traffic for those, GPU inputs kept for the rest."""
    fp = flux_like()
    none, part, full = (build_plan(fp, WL, [], 1, act, offload_blocks=blocks)
                        for act, blocks in ((False, None), (True, list(range(19))), (True, None)))
    unit = WL.tokens * fp.hidden_size * 2
    assert (none.offloaded_blocks, len(full.offloaded_blocks)) == ([], 57) and part.offloaded_blocks == list(range(19))
    assert part.partial_offload and not full.partial_offload
    assert part.activation_bytes_per_step == 19 * unit and full.activation_bytes_per_step == 57 * unit
    assert part.host_breakdown["activations"] == 19 * unit
    # the GPU keeps one input set per block not offloaded, beside what offloading keeps in flight
    assert part.breakdown["activations"] - full.breakdown["activations"] == 38 * unit
    assert none.breakdown["activations"] > part.breakdown["activations"] > full.breakdown["activations"]
    assert "activation offload for 19 of 57 blocks" in part.describe()
    assert part.summary()["offloaded_blocks"] == 19
    assert none.step_time is None  # (timed by auto) and the partial plan is timed with only its blocks' traffic
    from lowvram_lora.engine.offload.plan import with_step_time

    t = [with_step_time(p, FAST).step_time for p in (none, part, full)]
    assert t[0].link_busy_s < t[1].link_busy_s < t[2].link_busy_s


def test_whole_block_offload_holds_one_input_set_per_block():
    """A family that streams its large blocks in parts offloads one input set per part; offloading whole blocks holds
    one per block (less host RAM and link traffic) for the whole block's working set on the GPU."""
    fp = flux_like()
    fp.unit_bytes, fp.parts_activation_scale = [[DOUBLE // 2, DOUBLE - DOUBLE // 2]] * 19 + [None] * 38, 0.6
    parts, whole = (build_plan(fp, WL, [], 1, True, offload_parts=p) for p in (True, False))
    unit = WL.tokens * fp.hidden_size * 2
    assert (parts.streamed_units, whole.streamed_units) == (76, 57)
    assert parts.activation_bytes_per_step == 76 * unit and whole.activation_bytes_per_step == 57 * unit
    assert whole.host_breakdown["activations"] == 57 * unit
    assert whole.breakdown["activations"] > parts.breakdown["activations"]  # 1.0 against 0.6 of the working set
    assert "whole blocks, one input set each" in whole.describe() and not whole.split_blocks


@pytest.mark.parametrize("short", [0.7, 0.8])
def test_auto_offloads_some_activations_when_all_do_not_fit_ram(short):
    """At 4 GB of VRAM every block streams; a RAM budget a little below what offloading every block's activations
    needs gets a plan that offloads some (a step between all and none), with the note saying how many stay."""
    free = auto(4, compile="off")
    assert len(free.offloaded_blocks) == 57
    ram = free.predicted_host_peak_bytes / GB - short
    plan = auto(4, ram=ram, compile="off")
    assert plan.partial_offload and 0 < len(plan.offloaded_blocks) < 57 and not plan.disk_blocks
    assert plan.offloaded_blocks == list(range(len(plan.offloaded_blocks)))  # the first blocks (the large ones)
    assert plan.predicted_host_peak_bytes <= ram * GB
    assert "blocks' activations stay on the GPU" in plan.ram_note
    # offloading every block's at the same layout would not fit the RAM budget
    every = build_plan(plan.footprint, WL, plan.resident, plan.prefetch_depth, True, resume_staging=False)
    assert every.predicted_host_peak_bytes > ram * GB


def test_auto_moves_blocks_to_disk_when_ram_is_short():
    plan = auto(6, ram=9, machine=DISK)
    assert plan.disk_blocks and set(plan.disk_blocks) <= set(plan.streamed)
    assert plan.predicted_host_peak_bytes <= 9 * GB
    on_disk = sum(plan.footprint.block_bytes[i] for i in plan.disk_blocks)
    # Each disk block is read once or twice a step (forward, recompute/backward; once where it stays staged at the turn)
    assert on_disk <= plan.disk_bytes_per_step <= 2 * on_disk
    assert plan.step_time.disk_busy_s >= plan.disk_bytes_per_step / DISK.disk_bytes_per_s
    assert "read from the slab file" in plan.describe()
    # no disk rate (not a slab, or not probed): the same budgets are refused, with the pairs that work
    with pytest.raises(ConfigError, match=r"smallest pairs that work: [0-9.]+ GB VRAM \+ [0-9.]+ GB RAM"):
        auto(6, ram=9)
    with pytest.raises(ConfigError, match="int8 slab"):
        auto(6, ram=9, machine=DISK, slab=False)
    # disk_blocks=0 keeps every block off the disk: refused, naming the setting
    with pytest.raises(ConfigError, match="disk_blocks=0 keeps every block off the disk"):
        auto(6, ram=9, machine=DISK, disk_blocks=0)


def test_refusal_names_both_budgets():
    with pytest.raises(ConfigError) as err:
        auto(6, ram=2, machine=DISK)
    msg = str(err.value)
    assert "vram_budget_gb=6" in msg and "ram_budget_gb=2" in msg and "GB RAM" in msg


def test_explicit_plans_are_checked_against_the_ram_budget():
    fp = flux_like()
    with pytest.raises(ConfigError, match=r"mode='stream' needs [0-9.]+ GB of host RAM but ram_budget_gb=5"):
        make_plan(fp, WL, OffloadConfig(mode="stream", activation_offload=True), ram_budget_bytes=5 * 10**9)
    plan = make_plan(fp, WL, OffloadConfig(mode="resident"), ram_budget_bytes=5 * 10**9)
    assert plan.host_breakdown["weights kept"] == 0  # the resident placement moves the model, keeping no copies


def test_disk_pipe_bounds_the_step():
    """A step is at least the disk's bytes over its rate (the third pipe), and a faster disk is never slower."""
    fp = flux_like()
    slow = Machine(link_bytes_per_s=54e9, peak_flops=989e12, disk_bytes_per_s=1e9)
    plans = {}
    for name, machine in (("slow", slow), ("fast", DISK)):
        plan = build_plan(fp, WL, [], 1, False, disk_blocks=range(19, 57))
        from lowvram_lora.engine.offload.plan import with_step_time

        plans[name] = with_step_time(plan, machine)
    slow_plan = plans["slow"]
    assert slow_plan.predicted_step_s >= slow_plan.disk_bytes_per_step / 1e9 * 0.999
    assert plans["fast"].predicted_step_s <= slow_plan.predicted_step_s


# --- the templates' needs (host/template_needs.py) ------------------------------------------------------------------


def test_every_template_names_its_variant_and_its_note_states_its_needs():
    """Each shipped template is planned for (its variant known), and its Note ends with the planner's VRAM and RAM
    figures (the files are what ``python -m lowvram_lora.host.templates`` writes: test_host_templates checks that)."""
    import json

    from lowvram_lora.engine.families import get_family
    from lowvram_lora.host.templates import SHIPPED, WORKFLOWS_DIR

    for name, t in SHIPPED.items():
        assert t.variant, name  # each family's templates.py names the variant its template trains
        family = t.load.get("family")
        if family not in (None, "auto"):
            assert {t.variant, t.partner_variant} - {""} <= set(get_family(family).variants), name
        ui = json.loads((WORKFLOWS_DIR / f"{name}.json").read_text())
        note = next(n for n in ui["nodes"] if n["type"] == "Note")["widgets_values"][0]
        assert "Needs (the planner's prediction" in note and "host RAM" in note and "VRAM budget" in note


# --- the modulation window's weights under a RAM budget (offload/window.py place_window_weights) ---------------------


def _window_planned(ram):
    def planned(extra):
        return make_plan(flux_like(), WL, OffloadConfig(mode="auto", vram_budget_gb=6), 6 * GB, 64 * 10**9,
                         machine=DISK, ram_budget_bytes=int(ram * GB) if ram else None, host_extra=extra,
                         resume_staging=False)
    return planned


def test_window_weights_stay_in_the_slab_map_when_holding_them_would_put_blocks_on_disk():
    from lowvram_lora.engine.offload.window import HOST_KEY, place_window_weights

    extra = {HOST_KEY: int(2 * GB)}
    held_alone = _window_planned(9)(extra)  # held in pinned RAM, the window pushes blocks to the disk tier
    assert held_alone.disk_blocks
    plan, mapped = place_window_weights(_window_planned(9), extra, may_map=True)
    assert mapped and plan.disk_bytes_per_step < held_alone.disk_bytes_per_step
    assert "stay in the slab file's map" in plan.describe()
    assert plan.predicted_host_peak_bytes <= 9 * GB
    # RAM enough: held in pinned memory as before; not a slab (or no disk rate): never mapped
    plan, mapped = place_window_weights(_window_planned(None), extra, may_map=True)
    assert not mapped and not plan.disk_blocks
    plan, mapped = place_window_weights(_window_planned(9), extra, may_map=False)
    assert not mapped and plan.disk_bytes_per_step == held_alone.disk_bytes_per_step


def test_mapped_block_copies_binds_and_gives_the_map_back():
    import torch
    from torch import nn

    from lowvram_lora.engine.offload.host import MappedBlock

    module = nn.Linear(8, 4).requires_grad_(False)
    weight, bias = module.weight.data.clone(), module.bias.data.clone()
    released = []
    block = MappedBlock(module, "mod", lambda ranges: released.append(ranges) or 0)
    flat = torch.zeros(block.nbytes, dtype=torch.uint8)  # stands in for the GPU buffer
    block.copy_to(flat)
    assert sorted(n for _, n in released[0]) == sorted([weight.numel() * 4, bias.numel() * 4])  # every tensor's range
    originals = [t.data_ptr() for t in block.mapped]
    block.bind(flat)
    assert module.weight.data_ptr() == flat.data_ptr() and torch.equal(module.weight, weight)
    assert torch.equal(module.bias, bias)
    block.bind_host()
    assert [module.weight.data_ptr(), module.bias.data_ptr()] == originals


@pytest.mark.skipif(not Path("/proc/self/status").exists() or __import__("platform").libc_ver()[0] != "glibc",
                    reason="reads RssAnon from /proc; glibc's heap")
def test_release_freed_heap_gives_back_what_pinning_freed():
    """What pinning leaves behind: the tensors blocks are copied from, freed, under glibc's mmap threshold (after a
    freed 30 MiB map raised it), stay in the heap; ``release_freed_heap`` returns them. 24 x 16 MiB freed, the last
    one kept (so the heap's top is in use and only a trim of the middle gives pages back): at least 300 of the 386 MB
    come back."""
    import torch

    def anon() -> int:
        return int(next(ln for ln in Path("/proc/self/status").read_text().splitlines()
                        if ln.startswith("RssAnon")).split()[1]) * 1024

    big = torch.ones(30 << 20, dtype=torch.uint8)
    del big
    held = [torch.ones(16 << 20, dtype=torch.uint8) for _ in range(24)]
    keep = held[-1]  # noqa: F841 - the heap's top stays in use
    del held
    before = anon()
    hostmem.release_freed_heap()
    assert before - anon() > 300e6
