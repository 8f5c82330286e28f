"""The disk tier (engine/offload/disk.py) on the CPU: a real slab written by the slab builder from a tiny Flux.1,
streamed through the real staging ring, reader threads and scheduler, with synchronous copies (InlineCopyEngine)
standing in for CUDA. Checked against the file's own bytes and against RAM streaming of the same slab."""
import copy
import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lowvram_lora.engine.config import LoraSettings
from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.families import get_family
from lowvram_lora.engine.offload import OffloadConfig, Workload, build_plan, make_plan
from lowvram_lora.engine.offload import disk as disk_mod
from lowvram_lora.engine.offload.disk import (
    ALIGN, DiskPacer, DiskReader, StagingPolicy, disk_rate_for, simulate_disk_reads,
)
from lowvram_lora.engine.offload.plan import with_disk_blocks
from lowvram_lora.engine.offload.footprint import measure_footprint
from lowvram_lora.engine.offload.schedule import BlockScheduler, simulate_step, visit_cycle
from lowvram_lora.engine.offload.streamer import InlineCopyEngine, apply_offload
from lowvram_lora.engine.slab import SlabError, build_slab, load_slab_transformer
from lowvram_lora.engine.slab.testing import write_random_checkpoint
from lowvram_lora.engine.train.lora_attach import attach_lora

from helpers import flow_steps

FAMILY = get_family("flux1")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def slab(tmp_path_factory):
    """A tiny Flux.1 with 2 double and 4 single blocks, as a checkpoint and then a slab (the project's builder)."""
    root = tmp_path_factory.mktemp("disk")
    cfg = dict(FAMILY.load_config("flux1-tiny"), num_layers=2, num_single_layers=4)
    ckpt = write_random_checkpoint(root / "ckpt", "flux1", config=cfg, layout="diffusers")
    return build_slab(ckpt, root / "tiny.slab.safetensors", progress=False)


def lora_slab_model(path):
    """The slab's model in fp32 (its plain tensors then differ from the stored bf16 and stay on the device) with a
    LoRA whose B is random, so every LoRA weight gets a gradient."""
    model = load_slab_transformer(path, torch.float32, verify="quick")[0]
    model.enable_gradient_checkpointing()
    attach_lora(model, FAMILY, LoraSettings(rank=4, alpha=4), seed=0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.train()
    return model


def stream(model, disk=0, k=1, act=False, staging=0):
    plan = build_plan(measure_footprint(model, FAMILY), Workload(1, 64, 8), (), k, act)
    with_disk_blocks(plan, plan.streamed[len(plan.streamed) - disk:] if disk else [], staging)
    return apply_offload(model, FAMILY, OffloadConfig(mode="stream"), CPU, plan=plan,
                         _engine_factory=InlineCopyEngine)


class Recorded(DiskReader):
    """The real reader, noting which unit each read is for (by its first file offset)."""

    log: list = []

    def submit(self, runs, buffer, after=None):
        Recorded.log.append(runs[0][0])
        return super().submit(runs, buffer, after)

    def read_now(self, runs, buffer, after=None):
        Recorded.log.append(runs[0][0])
        return super().read_now(runs, buffer, after)


@pytest.fixture
def recorded(monkeypatch):
    Recorded.log = []
    monkeypatch.setattr(disk_mod, "DiskReader", Recorded)
    return Recorded.log


def visit_steps(handle, steps):
    """Drive the scheduler through ``steps`` training steps' visits (no compute)."""
    n = handle.scheduler.num_blocks
    for _ in range(steps):
        for b in visit_cycle(n):
            handle.scheduler.visit(b)


# --- bytes, layout, alignment --------------------------------------------------------------------------------------


def test_disk_units_bind_the_slabs_own_bytes_at_aligned_offsets(slab):
    model = lora_slab_model(slab)
    handle = stream(model, disk=3, k=1)
    ring = handle.disk
    assert ring is not None and ring.memory.data_ptr() % ALIGN == 0 and ring.slot_bytes % ALIGN == 0
    with safe_open(str(slab), framework="pt") as f:
        reference = {k: f.get_tensor(k) for k in f.keys()}
    names = {id(m): n for n, m in model.named_modules()}
    ids = {u: [id(e.tensor()) for e in unit.entries] for u, unit in ring.units.items()}
    checked = 0
    for b in visit_cycle(handle.scheduler.num_blocks):
        handle.scheduler.visit(b)
        for u, unit in ring.units.items():
            for off, length, dst in unit.runs:
                assert off % ALIGN == 0 and length % ALIGN == 0 and dst % ALIGN == 0
            if u not in handle.scheduler.where:
                assert all(e.tensor().device.type == "cpu" and e.tensor().untyped_storage().nbytes() <= 8
                           for e in unit.entries)  # evicted: no bytes anywhere
                continue
            for e, key in zip(unit.entries, unit.keys):
                assert disk_mod.slab_key(names, e.module, e.name) == key
                assert e.offset % 64 == 0
                assert torch.equal(e.tensor(), reference[key]), key  # the slab's bytes, bit for bit
                checked += 1
    assert checked > 0
    # the same tensor objects all along (their data swapped, as for RAM blocks): compiled blocks keep their guards
    assert ids == {u: [id(e.tensor()) for e in unit.entries] for u, unit in ring.units.items()}
    stored = sum(u.stored_bytes for u in ring.units.values())
    assert stored == sum(t.numel() * t.element_size() for u in ring.units.values() for t in
                         (reference[k] for k in u.keys))
    # plain tensors loaded as fp32 (stored bf16) are not streamed from disk: they wait on the device
    assert all(t.dtype == torch.float32 for u in ring.units.values() for t in u.kept)
    handle.remove()
    # after training: the disk blocks are views of the slab's map again, as the loader left them
    for u in ring.units.values():
        for e, key in zip(u.entries, u.keys):
            assert e.tensor().device.type == "cpu" and torch.equal(e.tensor(), reference[key])


def test_disk_streamed_training_equals_ram_streamed(slab):
    """Same slab, same LoRA: gradients with 3 blocks (as 5 units, activation offload) read from disk are exactly
    those of RAM streaming; the RAM plan pins the blocks the disk plan does not."""
    out = {}
    for disk, act in ((0, False), (3, False), (3, True)):
        model = lora_slab_model(slab)
        handle = stream(model, disk=disk, k=2, act=act)
        losses, grads = flow_steps(model, FAMILY)
        losses2, grads2 = flow_steps(model, FAMILY)
        out[(disk, act)] = (losses + losses2, grads2, handle.stats(), handle.plan)
        handle.remove()
    ref_losses, ref_grads, _, ram_plan = out[(0, False)]
    for key in ((3, False), (3, True)):
        losses, grads, stats, plan = out[key]
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7)
        assert stats["disk_reads"] > 0 and stats["disk_bytes_read"] > 0 and stats["sync_loads"] == 0


# --- order, read-ahead, the turn -----------------------------------------------------------------------------------


def test_future_loads_predict_the_scheduler():
    from lowvram_lora.engine.offload.schedule import RecordingCopyEngine

    for k, slots in ((1, 2), (2, 3), (1, 3)):
        eng = RecordingCopyEngine()
        s = BlockScheduler(9, [0, 2, 3, 4, 5, 6, 8], slots, k, eng)
        s.prime()
        cycle = visit_cycle(9)
        for b in cycle[:5]:
            s.visit(b)
        predicted = s.future_loads(12)
        before = len(eng.loaded)
        for b in cycle[5:] + cycle + cycle:
            s.visit(b)
        assert predicted == eng.loaded[before:before + 12]
        assert s.future_loads(6, frozenset({5, 6})) == [b for b in s.future_loads(40) if b in (5, 6)][:6]


def test_reads_follow_the_scheduler_and_the_turn_is_read_once(slab, recorded):
    """k=1 (two GPU slots): the GPU ring loads the blocks next to the turn twice in a few visits; the staging ring
    still holds them, so each is read from disk once per step. Reads happen in the order the scheduler loads, and
    equal what the plan predicts (the same policy replayed)."""
    model = lora_slab_model(slab)
    handle = stream(model, disk=5, k=1, staging=3)
    ring, plan = handle.disk, handle.plan
    offset_of = {unit.runs[0][0]: u for u, unit in ring.units.items()}
    visit_steps(handle, 2)
    recorded.clear()
    loads_before = handle.scheduler.stats.loads
    visit_steps(handle, 1)
    reads = [offset_of[o] for o in recorded]
    n = handle.scheduler.num_blocks
    loads, _, _ = simulate_step(n, plan.streamed, plan.prefetch_depth, plan.num_slots)
    disk_loads = [u for u in loads if u in ring.units]
    assert sorted(reads) == sorted(simulate_disk_reads(loads, set(ring.units), 3))
    assert len(reads) < len(disk_loads)  # some loads were served from staged bytes, not the disk
    assert ring.reused > 0 and ring.policy.resyncs == 0 and handle.scheduler.stats.loads - loads_before == len(loads)
    turn = n - 1  # loaded once per step (the scheduler merges its two visits); two blocks before it, the GPU ring
    # (two slots) loads a block in the forward and again three visits later in the backward: read at most once
    assert disk_loads.count(turn) == 1 and reads.count(turn) <= 1
    assert disk_loads.count(turn - 2) == 2 and reads.count(turn - 2) <= 1
    assert all(reads.count(u) <= disk_loads.count(u) for u in set(reads))
    # each read is the next disk load not yet staged, in the scheduler's order: the reads are a subsequence of the
    # disk loads of this step and the next
    it = iter(disk_loads + disk_loads)
    assert all(any(u == v for v in it) for u in reads)
    read = sum(sum(l for _, l, _ in ring.units[u].runs) for u in reads)
    assert 0 < read <= plan.disk_bytes_per_step  # the plan counts each read's aligned superset at most
    handle.remove()


def test_staging_policy_reads_each_unit_once_when_the_ring_holds_the_cycle():
    seq = [3, 4, 5, 4, 3]
    assert sorted(simulate_disk_reads(seq, {3, 4, 5}, 3)) == []  # all staged: nothing to read in steady state
    assert sorted(simulate_disk_reads(seq, {3, 4, 5}, 1)) == [3, 4, 4, 5]  # the 3 at the wrap is still staged
    p = StagingPolicy(2, lambda n: [1, 2, 1, 2][:n])
    b, read_now, reused = p.serve(1)
    assert read_now and not reused and p.readahead() == [(2, 1 - b)]


# --- O_DIRECT, pacing, the disk's rate ----------------------------------------------------------------------------


def test_o_direct_or_a_stated_fallback(slab, tmp_path, monkeypatch):
    reader = DiskReader(slab, os.stat(slab).st_size)
    try:
        assert reader.direct or "refused" in reader.why_buffered
        buf = disk_mod.aligned_empty(2 * ALIGN)
        reader.read_now([(ALIGN, 2 * ALIGN, 0)], buf)
        assert bytes(buf.numpy()) == slab.read_bytes()[ALIGN:3 * ALIGN]
    finally:
        reader.close()
    odd = tmp_path / "odd.bin"
    odd.write_bytes(os.urandom(3 * ALIGN + 100))
    for refuse in (False, True):
        if refuse:  # a filesystem that refuses O_DIRECT (tmpfs before Linux 6.6, some network filesystems)
            real_open = os.open

            def fake_open(path, flags, *a):
                if flags & getattr(os, "O_DIRECT", 0):
                    raise OSError(22, "Invalid argument")
                return real_open(path, flags, *a)

            monkeypatch.setattr(os, "open", fake_open)
        r = DiskReader(odd, odd.stat().st_size)
        buf = disk_mod.aligned_empty(4 * ALIGN)
        r.read_now([(2 * ALIGN, 2 * ALIGN, 0)], buf)  # reaches past the end of the file: the tail is read
        assert bytes(buf[:ALIGN + 100].numpy()) == odd.read_bytes()[2 * ALIGN:]
        if refuse:
            assert not r.direct and "O_DIRECT refused" in r.mode and "page cache" in r.mode
        r.close()


def test_pacer_holds_every_reader_to_the_rate():
    now = [0.0]
    pacer = DiskPacer(1e6, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    deadlines = [pacer.reserve(250_000) for _ in range(4)]  # four readers at once: one shared timeline
    assert deadlines == pytest.approx([0.25, 0.5, 0.75, 1.0])
    pacer.hold_until(deadlines[-1])
    assert now[0] == pytest.approx(1.0) and pacer.paced_s == pytest.approx(1.0)
    now[0] = 5.0  # idle since: no credit is carried, the next read starts now
    assert pacer.reserve(500_000) == pytest.approx(5.5)


def test_emulated_rate_paces_real_reads(slab, monkeypatch, tmp_path):
    monkeypatch.setenv("LOWVRAM_EMULATE_DISK_GBPS", "0.05")
    monkeypatch.setenv("LOWVRAM_CACHE_DIR", str(tmp_path))
    reader = DiskReader(slab, os.stat(slab).st_size, pacer=disk_mod.pacer_from_env())
    n = min(os.stat(slab).st_size // ALIGN, 1024) * ALIGN
    buf = disk_mod.aligned_empty(n)
    t0 = time.perf_counter()
    for f in reader.submit([(0, n, 0)], buf):
        f.result()
    elapsed = time.perf_counter() - t0
    assert elapsed >= 0.9 * n / 0.05e9
    # The rate the run's disk gave (bytes over the seconds some read was in flight) is the emulated one: the busy
    # time covers the paced reads and nothing else (it is at most the wall time of the reads).
    assert 0.9 * n / 0.05e9 <= reader.busy_s <= elapsed and reader._in_flight == 0
    reader.close()
    calls = []
    real = disk_mod.probe_disk_bytes_per_s
    monkeypatch.setattr(disk_mod, "probe_disk_bytes_per_s", lambda *a, **k: calls.append(1) or real(*a, **k))
    first, second = disk_rate_for(slab), disk_rate_for(slab)
    raw, source = disk_mod.raw_disk_rate(slab)
    assert first == second == min(raw, 0.05e9) and calls == [1] and source == "cache"  # probed once, then cached
    cached = json.loads((tmp_path / "disk.json").read_text())["links"]  # the probe's figure, kept for the next run
    assert [entry["bytes_per_s"] for entry in cached.values()] == [raw]
    monkeypatch.delenv("LOWVRAM_EMULATE_DISK_GBPS")
    assert disk_rate_for(slab) == raw and calls == [1]


# --- faults and config ---------------------------------------------------------------------------------------------


def test_a_changed_or_removed_slab_stops_with_a_clear_error(slab, tmp_path):
    import shutil

    from lowvram_lora.engine.slab import manifest_path_for

    path = tmp_path / slab.name
    shutil.copy(slab, path)
    shutil.copy(manifest_path_for(slab), manifest_path_for(path))
    model = lora_slab_model(path)
    handle = stream(model, disk=3, k=1)
    visit_steps(handle, 1)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(SlabError) as err:
        visit_steps(handle, 1)
    msg = str(err.value)
    assert str(path) in msg and "mtime_ns" in msg and "resume" in msg and "lowvram-lora slab build" in msg
    path.unlink()
    with pytest.raises(SlabError, match="disappeared"):
        visit_steps(handle, 1)
    handle.remove()  # cleanup never raises over the run's own error
    assert handle.unrestored


def test_disk_blocks_config_and_plan(slab):
    with pytest.raises(ConfigError, match="mode='stream'"):
        OffloadConfig(mode="auto", disk_blocks=2)
    with pytest.raises(ConfigError, match="disk_blocks"):
        OffloadConfig(mode="stream", disk_blocks=-1)
    model = load_slab_transformer(slab, torch.bfloat16, verify="quick")[0]
    fp = measure_footprint(model, FAMILY)
    ram = make_plan(fp, Workload(1, 64, 8), OffloadConfig(mode="stream"))
    plan = make_plan(fp, Workload(1, 64, 8), OffloadConfig(mode="stream", disk_blocks=5))
    assert plan.disk_blocks == plan.streamed[-5:] and plan.staging_slots == 4 and plan.disk_bytes_per_step > 0
    sizes = fp.block_bytes
    # the disk blocks' host copies are gone, the staging ring is pinned instead (a tiny model's blocks are smaller
    # than the ring's 4096-byte alignment, so only the accounting is checked here; the GPU bench measures RSS)
    assert plan.pinned_host_bytes == ram.pinned_host_bytes - sum(sizes[1:]) + plan.staging_slots * max(
        disk_mod.read_bytes_of(b) for b in sizes[1:])
    assert "read from the slab on disk" in plan.describe()
    with pytest.raises(ConfigError, match="disk_blocks=99"):
        make_plan(fp, Workload(1, 64, 8), OffloadConfig(mode="stream", disk_blocks=99))
    plain = copy.deepcopy(model)
    plain.__dict__.pop("_lowvram_slab_source")
    with pytest.raises(ConfigError, match="not loaded from an int8 slab"):
        apply_offload(plain, FAMILY, OffloadConfig(mode="stream"), CPU, plan=plan, _engine_factory=InlineCopyEngine)


def test_a_disk_too_slow_for_the_plan_is_warned_with_the_predicted_step(slab):
    from lowvram_lora.engine.offload.steptime import Machine

    model = load_slab_transformer(slab, torch.bfloat16, verify="quick")[0]
    plan = make_plan(measure_footprint(model, FAMILY), Workload(1, 4096, 512), OffloadConfig(mode="stream", disk_blocks=5),
                     machine=Machine())
    compute = plan.step_time.compute_s
    fast = plan.disk_bytes_per_step / compute * 2
    assert disk_mod.slow_disk_warning(plan, fast, slab) is None
    slow = plan.disk_bytes_per_step / compute / 3
    warning = disk_mod.slow_disk_warning(plan, slow, slab)
    assert warning is not None and str(slab) in warning and "predicted step" in warning
    assert f"{max(plan.predicted_step_s, 3 * compute):.2f} s" in warning


def _rss_file() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_ram_blocks_give_back_the_slab_map_after_their_copy(slab):
    """A RAM-streamed block copied into its host buffer no longer holds its pages of the loader's map (it counted
    twice in RSS: bench/NOTES.md); the views left behind still read the file's bytes."""
    model = load_slab_transformer(slab, torch.bfloat16, verify="quick")[0]
    model.enable_gradient_checkpointing()
    with safe_open(str(slab), framework="pt") as f:
        reference = {k: f.get_tensor(k).clone() for k in f.keys()}
    views = [t for t in model.state_dict().values() if t.dtype == torch.int8]
    assert sum(int(t.float().abs().sum() > 0) for t in views)  # touched: the pages are mapped now
    handle = stream(model, disk=2, k=1)
    assert handle.map_released > 0 and handle.stats()["map_released"] == handle.map_released
    names = {id(m): n for n, m in model.named_modules()}
    for u, hb in handle._hosts.items():  # RAM blocks: their host buffers hold the slab's bytes
        if hb in handle.disk.units.values():
            continue
        for e in hb.entries:
            key = disk_mod.slab_key(names, e.module, e.name)
            assert torch.equal(hb.views(hb.buffer)[hb.entries.index(e)], reference[key])
    handle.remove()
    assert all(torch.equal(t, reference[k]) for k, t in model.state_dict().items() if k in reference)
