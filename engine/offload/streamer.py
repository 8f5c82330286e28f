"""Block streaming: transformer blocks live in pinned host memory and are copied into a
ring of preallocated GPU slots just ahead of use, in forward and in backward order.

Why our own and not diffusers' group offloading: diffusers has no backward hooks and
prefetches in forward order only, and it swaps every parameter of a group, the
trainable LoRA ones included, to a pinned snapshot. Measured here in training it
was 2.05x slower than resident and saved no memory (DESIGN.md §5).

How it works:
* ``BlockScheduler`` (schedule.py, pure Python) decides what goes into which slot.
* A forward pre-hook on every block calls ``scheduler.visit(i)`` (``VisitBlock``, named
  ``STREAM_HOOK`` on the block's hook registry, hooks.py). Pre-hooks fire in the forward
  pass and again when gradient checkpointing recomputes the block in backward, which is
  exactly when the block's weights are needed.
* ``CudaCopyEngine`` owns the slots (ONE flat uint8 GPU buffer each, of the loaded
  block's own size, from torch's caching allocator) and a dedicated copy stream. A
  load is one ``cudaMemcpyAsync`` of the block's pinned host buffer into a slot, after
  an event that says the compute stream is past the memory's previous use; the
  block's tensors then point into the slot (``tensor.data = view``).
  The compute stream waits only on the event of the block it is about to run.
* LoRA parameters (requires_grad) and everything outside the blocks stay on the GPU.

``apply_offload`` returns an ``OffloadHandle``; ``remove()`` puts every frozen tensor
back where it was (streamed blocks: their pinned host buffers), so the model can be
trained again, and the pinned memory is reused rather than pinned again.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
from torch import nn

from ..callbacks import TrainingCallback
from ..errors import ConfigError
from .config import OffloadConfig
from .footprint import measure_footprint, named_blocks, outer_modules
from .hooks import HookRegistry, ModelHook
from .disk import DiskUnit
from .host import HostBlock, frozen_tensors, step_constant_tensors
from .hostmem import process_memory, ram_cap_bytes, release_freed_heap
from .plan import GB, Plan, Workload, make_plan
from .schedule import BlockScheduler
from .units import StreamUnits, install_units


class CudaCopyEngine:
    """Slots on the GPU, copies on their own stream, events for every hand-over.

    A slot is a buffer of exactly its block's size, allocated from torch's caching allocator when the
    block is loaded and freed when it is evicted. Flux.1's double blocks are 2.4x its single blocks
    (0.68 vs 0.28 GB bf16), so a ring of fixed slots sized for the largest block would hold 0.8 GB of
    nothing while the single blocks run, which is where a block's activations peak; freed slot memory
    goes to those activations instead (issue 13). The allocator makes this cheap: a freed slot's memory
    is handed to the next allocation on the compute stream (the next slot, or activations) without a
    device call."""

    def __init__(self, hosts: dict[int, HostBlock], num_slots: int, slot_bytes: int, device: torch.device):
        self.hosts, self.device = hosts, device
        self.stream = torch.cuda.Stream(device)
        self.slots: list[Optional[torch.Tensor]] = [None] * num_slots
        self.ready: list[Optional[torch.cuda.Event]] = [None] * num_slots  # copy into the slot landed
        self.released: list[Optional[torch.cuda.Event]] = [None] * num_slots  # compute done with the slot
        self.bytes_copied = 0
        # Timing events since the last harvest (one training step): copy-engine busy time, and the time
        # the compute stream sat waiting for a copy (a stall: the step was copy-bound there).
        self._copy_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._stall_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        # Benches: LOWVRAM_EMULATE_LINK_GBPS paces the copies to a slower link (engine/offload/link.py).
        from .link import pacer_for

        self.pacer = pacer_for(device)
        self.disk = None  # the staging ring of the disk tier (engine/offload/disk.py), when the plan has disk blocks

    def load(self, block: int, slot: int, evicted: Optional[int]) -> None:
        compute = torch.cuda.current_stream(self.device)
        if evicted is not None:
            # Point the evicted block back at host memory: a stray use fails loudly (device mismatch)
            # instead of silently reading the next block's weights.
            self.hosts[evicted].bind_host()
        if self.slots[slot] is not None:
            # The old buffer goes back to the allocator, which hands it to later compute-stream work in
            # stream order. Its copy (on the copy stream) must have landed first; compute has waited for
            # it unless the block was prefetched and never ran (a mispredicted order).
            compute.wait_event(self.ready[slot])
            self.slots[slot] = None
        host = self.hosts[block]
        # A disk unit's bytes come from its staging buffer (read ahead; this waits only if its read is late).
        from_disk = self.disk is not None and block in self.disk.units
        source = self.disk.fetch(block) if from_disk else host.buffer
        buffer = torch.empty(host.nbytes, dtype=torch.uint8, device=self.device)  # on the compute stream
        allocated = torch.cuda.Event()
        allocated.record(compute)
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            # The new buffer's memory may have held tensors that compute work queued so far still reads
            # (an evicted block, freed activations): the copy waits until the compute stream is past them.
            # That point is the previous block's end, as with a fixed ring slot's release.
            self.stream.wait_event(allocated)
            if self.released[slot] is not None:
                self.stream.wait_event(self.released[slot])
            start.record(self.stream)
            buffer.copy_(source, non_blocking=True)
            if self.pacer is not None:  # the copy lands (done) once the emulated link would have carried it
                self.pacer.after_copy(host.nbytes)
            done.record(self.stream)
        if from_disk:  # the staging buffer may be read into again after `done`
            self.disk.copied(block, done)
        self.slots[slot] = buffer
        self.ready[slot] = done
        self.bytes_copied += host.nbytes
        if len(self._copy_events) > 8192:  # nobody harvests (not train_lora): keep the memory bounded
            del self._copy_events[:4096], self._stall_events[:4096]
        self._copy_events.append((start, done))
        host.bind(buffer)

    def wait_ready(self, slot: int) -> None:
        compute = torch.cuda.current_stream(self.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(compute)
        # Without this wait the block would run on a half-copied slot.
        compute.wait_event(self.ready[slot])
        after.record(compute)
        self._stall_events.append((before, after))

    def release(self, slot: int) -> None:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self.released[slot] = ev

    def harvest(self) -> tuple[float, float]:
        """(copy-engine busy s, compute stall s) since the last call; synchronises the device."""
        torch.cuda.synchronize(self.device)
        copy_s = sum(a.elapsed_time(b) for a, b in self._copy_events) / 1e3
        stall_s = sum(a.elapsed_time(b) for a, b in self._stall_events) / 1e3
        self._copy_events.clear()
        self._stall_events.clear()
        return copy_s, stall_s

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        self.slots = [None] * len(self.slots)


class InlineCopyEngine:
    """Synchronous copies between CPU buffers: the same binding, scheduling and slot sizing, no CUDA (tests)."""

    pacer = None  # no emulated link: copies land at once

    def __init__(self, hosts: dict[int, HostBlock], num_slots: int, slot_bytes: int, device: torch.device):
        self.hosts, self.device = hosts, device
        self.slots: list[Optional[torch.Tensor]] = [None] * num_slots
        self.bytes_copied = 0
        self.log: list[tuple] = []
        self.disk = None

    def load(self, block: int, slot: int, evicted: Optional[int]) -> None:
        if evicted is not None:
            self.hosts[evicted].bind_host()
        self.slots[slot] = None
        host = self.hosts[block]
        disk = self.disk is not None and block in self.disk.units
        source = self.disk.fetch(block) if disk else host.buffer
        self.slots[slot] = source.clone().to(self.device)
        if disk:
            self.disk.copied(block, None)
        self.bytes_copied += host.nbytes
        host.bind(self.slots[slot])
        self.log.append(("load", block, slot, evicted))

    def wait_ready(self, slot: int) -> None:
        self.log.append(("wait", slot))

    def release(self, slot: int) -> None:
        self.log.append(("release", slot))

    def harvest(self) -> tuple[float, float]:
        return 0.0, 0.0

    def close(self) -> None:
        self.slots = [None] * len(self.slots)


class OffloadHandle:
    """What ``apply_offload`` did, and how to undo it."""

    def __init__(self, model: nn.Module, plan: Plan, device: torch.device):
        self.model, self.plan, self.device = model, plan, device
        self.scheduler: Optional[BlockScheduler] = None
        self.engine = None
        self.activations = None  # ActivationOffloader when activation offload is on
        self.units: Optional[StreamUnits] = None  # blocks streamed in parts (activation offload only)
        self.outer = None  # HeldOuter: the layers outside the blocks held on the host (plan.outer_on_host)
        self._visited: list[nn.Module] = []  # units carrying our STREAM_HOOK
        self._pass_hooked: Optional[nn.Module] = None  # the model carrying our PASS_HOOK
        self._moved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, its data before apply)
        self._hosts: dict[int, HostBlock] = {}
        self.pin_seconds = 0.0
        self.map_released = 0  # bytes of the slab's map given back after their copies (engine/slab/source.py)
        self.pinned_reused = 0
        self.pinned_bytes = 0  # page-locked host bytes of this handle (blocks, activation buffers)
        self.step_copy_s: list[float] = []  # per training step: copy engine busy
        self.step_stall_s: list[float] = []  # per training step: compute waiting for copies
        self.disk = None  # StagingRing: the disk tier's reads (engine/offload/disk.py)
        self.step_disk_bytes: list[int] = []  # per training step: bytes read from the slab
        self.step_disk_wait_s: list[float] = []  # per training step: the training thread waiting for those reads
        self._removed = False

    def end_step(self) -> None:
        """Call after each optimizer step (the loop synchronises anyway): records its copy timings."""
        if self.engine is not None:
            copy_s, stall_s = self.engine.harvest()
            self.step_copy_s.append(round(copy_s, 4))
            self.step_stall_s.append(round(stall_s, 4))
        if self.disk is not None:
            read, waited = self.disk.harvest()
            self.step_disk_bytes.append(read)
            self.step_disk_wait_s.append(round(waited, 4))

    def stats(self) -> dict:
        """Counters since apply (copies, bytes, synchronous loads = prefetch misses, resyncs) and, per
        training step, copy-engine busy and compute stall seconds (CUDA; see ``end_step``)."""
        out = {"bytes_copied": 0, "pin_seconds": round(self.pin_seconds, 2), "pinned_reused": self.pinned_reused,
               "pinned_gb": round(self.pinned_bytes / GB, 3), "map_released": self.map_released,
               "step_copy_s": self.step_copy_s, "step_stall_s": self.step_stall_s,
               "paced_s": round(self.engine.pacer.paced_s, 3)
               if self.engine is not None and self.engine.pacer is not None else 0.0}
        if self.scheduler is not None:
            out.update(self.scheduler.stats.as_dict())
            out["bytes_copied"] = self.engine.bytes_copied
        if self.activations is not None:
            out.update(self.activations.stats())
        if self.disk is not None:
            out.update(self.disk.stats(), step_disk_bytes=self.step_disk_bytes,
                       step_disk_wait_s=self.step_disk_wait_s)
        return out

    def peak_report(self, step: int = 1, measured_bytes: Optional[int] = None) -> str:
        """Predicted vs measured peak (this device's max allocated since the last reset, unless given).
        Step 1 runs its backward before AdamW has made its moments (trainable x 8 bytes), so it reads
        low; from step 2 on the prediction should hold."""
        if measured_bytes is None:
            measured_bytes = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0
        predicted = self.plan.predicted_peak_bytes
        diff = measured_bytes - predicted
        when = "step 1 (before the AdamW moments exist)" if step == 1 else f"step {step}"
        return (f"peak VRAM after {when}: measured {measured_bytes / GB:.2f} GB, predicted {predicted / GB:.2f} GB "
                f"({'+' if diff >= 0 else '-'}{abs(diff) / GB:.2f} GB, {100 * diff / max(predicted, 1):+.0f}%)")

    def step_report(self, step: int, measured_s: float) -> str:
        """Predicted vs measured step time (engine/offload/steptime.py; from step 3 on, once compiling is over),
        with this step's copy stall: where the model drifts, the log says by how much and on which link."""
        st = self.plan.step_time
        if st is None:
            return f"step {step}: {measured_s:.3f} s (no step-time prediction)"
        diff = measured_s - st.seconds
        stall = f", copy stall {self.step_stall_s[-1]:.3f} s (predicted {st.stall_s:.3f})" if self.step_stall_s else ""
        return (f"step time at step {step}: measured {measured_s:.3f} s, predicted {st.seconds:.3f} s "
                f"({100 * diff / max(st.seconds, 1e-9):+.0f}%) on a {self.plan.machine.describe()}{stall}")

    def remove(self) -> None:
        """Stop streaming; every frozen tensor goes back to where it was before apply (streamed blocks to
        their pinned host buffers, kept for the next apply). Trainable parameters stay on the device."""
        if self._removed:
            return
        self._removed = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for unit in self._visited:
            HookRegistry.of(unit).remove(STREAM_HOOK)
        self._visited.clear()
        if self._pass_hooked is not None:
            HookRegistry.of(self._pass_hooked).remove(PASS_HOOK)
            self._pass_hooked = None
        if self.activations is not None:
            self.activations.remove()
        if self.units is not None:
            self.units.remove()
        if self.outer is not None:
            self.outer.remove()
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        unrestored = []
        for hb in self._hosts.values():
            if isinstance(hb, DiskUnit):  # back to views of the slab's map, read lazily as the loader left them
                why = hb.restore()
                if why:
                    unrestored.append(why)
            else:
                hb.bind_host()
        for t, data in self._moved:
            t.data = data
        self._moved.clear()
        if self.engine is not None:
            self.engine.close()
        self.engine = None
        # Not raised: remove() runs while a run's own error (a slab removed mid-run) may be on its way out. Those
        # blocks stay empty views: a later use fails; a model loaded for this run is dropped anyway.
        self.unrestored = unrestored


def resolve_budget_bytes(cfg: OffloadConfig, device: torch.device) -> Optional[int]:
    """vram_budget_gb, or 90% of the VRAM free now when it is 0 (auto only)."""
    if cfg.mode != "auto":
        return None
    if cfg.vram_budget_gb:
        return int(cfg.vram_budget_gb * GB)
    free, _ = torch.cuda.mem_get_info(device)
    return int(0.9 * free)


@contextlib.contextmanager
def cap_allocator(budget_bytes: Optional[int], device: torch.device, held_before: int,
                  callback: Optional[TrainingCallback] = None):
    """While training under an explicit budget (``budget_bytes``: the plan's, where the user gave one; None: no cap),
    hold torch's caching allocator on ``device`` to what the process held before training plus the budget
    (``torch.cuda.set_per_process_memory_fraction``).

    Why: the allocator keeps freed blocks cached and maps more memory when none of them fits, so without a
    cap it reserves 0.6-1.05 GB more than it hands out (H100, Flux.1-dev streamed; a split's first GPU 12.2-13.0 GB
    at 12, 2x H200, 2026-11-28). A card of the budget's size cannot do that: at its limit the allocator hands its
    cache back and retries. The cap makes a large card behave the same, so a budget is kept in what the driver sees
    (reserved memory), not only in what tensors hold; the planner keeps HEADROOM_BYTES for what cannot be handed
    back. The fraction goes back to 1 afterwards."""
    if not budget_bytes or device.type != "cuda":
        yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    limit = held_before + budget_bytes
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), index)
    (callback or TrainingCallback()).log(
        f"VRAM held to the budget on cuda:{index}: the allocator may reserve {limit / GB:.2f} GB "
        f"({budget_bytes / GB:.2f} GB budget + {held_before / GB:.2f} GB held before training)")
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)


def require_cuda(cfg: OffloadConfig, device: torch.device) -> None:
    if cfg.streams and (device.type != "cuda" or not torch.cuda.is_available()):
        raise ConfigError(
            f"offload mode={cfg.mode!r} streams blocks to a CUDA GPU, but training runs on {device}"
            f"{'' if torch.cuda.is_available() else ' (no CUDA GPU found)'}; CPU training keeps every weight "
            f"resident: use mode='resident'"
        )


def _move(handle: OffloadHandle, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        handle._moved.append((t, t.data))
        t.data = t.data.to(device, non_blocking=False)


def _host_ranges(tensors) -> list[tuple[int, int]]:
    """(address, bytes) of the CPU tensors among ``tensors``: those that may be views of a slab's map."""
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t.device.type == "cpu" and t.numel()]


def apply_offload(model: nn.Module, family, config: OffloadConfig, device: torch.device,
                  callback: Optional[TrainingCallback] = None, workload: Optional[Workload] = None,
                  plan: Optional[Plan] = None, name: str = "",
                  _engine_factory: Optional[Callable] = None,
                  blocks: Optional[list[tuple[str, nn.Module]]] = None) -> OffloadHandle:
    """Stream ``model``'s blocks per ``plan`` (made from ``config`` and ``workload`` when not given).

    The model may sit anywhere (CPU, pinned host, GPU); LoRA must already be attached (its parameters are
    the ones with requires_grad and are moved to ``device`` here, before the optimizer is built).
    ``blocks``: only these (name, module) blocks are this device's (a part of a split model,
    engine/parallel/split.py): only their tensors move, and the plan's block indexes count within them.
    ``_engine_factory`` is for tests: an engine class taking (hosts, num_slots, slot_bytes, device)."""
    cb = callback or TrainingCallback()
    if _engine_factory is None:
        require_cuda(config, device)
    whole = blocks is None
    blocks = named_blocks(model, family) if whole else list(blocks)
    if plan is None:
        if workload is None:
            raise ValueError("apply_offload needs a plan or a workload to plan for")
        fp = measure_footprint(model, family, name or type(model).__name__)
        from .link import resolve_machine

        plan = make_plan(fp, workload, config, resolve_budget_bytes(config, device), ram_cap_bytes(),
                         machine=resolve_machine(device) if _engine_factory is None else None)
    handle = OffloadHandle(model, plan, device)

    # Everything outside the streamed blocks lives on the device for the whole run, except the large layers outside
    # the blocks when the plan holds them on the host (engine/offload/outer.py).
    streamed = set(plan.streamed)
    streamed_tensors = {id(t) for i in streamed for t in list(blocks[i][1].parameters()) + list(blocks[i][1].buffers())}
    held = outer_modules(model, family) if plan.outer_on_host and whole else []
    streamed_tensors |= {id(t) for _, m in held for t in list(m.parameters()) + list(m.buffers())}
    streamed_tensors |= step_constant_tensors(model)  # the modulation window's: it holds them (engine/train/step_window.py)
    owned = [model] if whole else [b for _, b in blocks]
    for t in [t for m in owned for t in list(m.parameters()) + list(m.buffers())]:
        if t.requires_grad:
            if t.device != device:
                t.data = t.data.to(device)  # trainable: stays there; the optimizer is built on these
        elif id(t) not in streamed_tensors:
            _move(handle, t, device)

    if held:
        from .outer import HeldOuter

        handle.outer = HeldOuter(held, device, pin=_engine_factory is None)

    # With activation offload every checkpointed unit is streamed on its own, so large blocks stream in
    # parts (engine/offload/units.py); the plan's indexes count whole blocks, the scheduler's count units.
    units, groups = blocks, [[i] for i in range(len(blocks))]
    if plan.activation_offload and whole:  # partial offload: only the offloaded blocks run in parts
        handle.units = install_units(model, family, blocks, only=set(plan.split_blocks))
        units, groups = handle.units.units, handle.units.groups
    streamed_units = [u for i in plan.streamed for u in groups[i]]

    # Streamed units: frozen tensors to (reused) pinned host buffers; the disk tier's are read from the slab at each
    # load and hold no host copy (engine/offload/disk.py).
    import time

    disk_units = {u for i in plan.disk_blocks for u in groups[i]}
    source = _slab_source(model, disk_units)
    # The slab map's pages behind what was copied to the GPU or into pinned memory are given back after each copy, so
    # the peak RSS holds one unit twice at most, not the whole model (engine/slab/source.py SlabSource.release).
    release = source.release if source is not None else (lambda ranges: 0)
    handle.map_released = release(_host_ranges(data for _, data in handle._moved))
    names = {id(m): n for n, m in model.named_modules()} if disk_units else {}
    t0 = time.perf_counter()
    pin = _engine_factory is None
    for n, u in enumerate(streamed_units):
        unit_name, unit = units[u]
        if u in disk_units:
            hb = DiskUnit(unit, unit_name, source, names)
            for t in hb.kept:  # as loaded, not as stored (a bias converted to another dtype): small, on the GPU
                _move(handle, t, device)
            hb.bind_host()
        else:
            copied = _host_ranges(t for _, _, _, t in frozen_tensors(unit))
            hb, reused = HostBlock.for_block(unit, unit_name, pin=pin)
            handle.pinned_reused += int(reused)
            handle.map_released += release(copied)
        handle._hosts[u] = hb
        cb.on_progress("pinning blocks", n + 1, len(streamed_units))
    release_freed_heap()  # the tensors the blocks were copied from are freed: their heap pages go back too
    handle.pin_seconds = time.perf_counter() - t0

    if plan.streamed:
        engine_cls = _engine_factory or CudaCopyEngine
        handle.engine = engine_cls(handle._hosts, plan.num_slots, plan.slot_bytes, device)
        handle.scheduler = BlockScheduler(len(units), streamed_units, plan.num_slots, plan.prefetch_depth,
                                          handle.engine)
        for u, (_, unit) in enumerate(units):
            HookRegistry.of(unit).register(STREAM_HOOK, VisitBlock(handle.scheduler, u))
            handle._visited.append(unit)
        if whole:  # each forward of the model says whether a backward follows (a part of a split cannot tell)
            HookRegistry.of(model).register(PASS_HOOK, StartPass(handle.scheduler))
            handle._pass_hooked = model
        if disk_units:
            # The disk's rate first (a probe on first use): measured while the ring's first reads run, it reads low.
            rate = _disk_rate(source) if _engine_factory is None else None
            handle.disk = handle.engine.disk = _staging_ring(plan, handle, disk_units, source, pin)
        handle.scheduler.prime()
    if plan.activation_offload:
        from .activations import ActivationOffloader

        handle.activations = ActivationOffloader(
            model, units, device, plan.workload, plan.footprint.hidden_size, inline=_engine_factory is not None,
            passthrough=handle.units.split if handle.units is not None else (),
            offloaded={u for i in plan.offloaded_blocks for u in groups[i]})
    cb.log(plan.describe())
    pinned = sum(hb.nbytes for hb in handle._hosts.values() if not isinstance(hb, DiskUnit))
    if handle.disk is not None:
        _log_disk_tier(plan, handle.disk, source, cb, rate)
    handle.pinned_bytes = (sum(hb.nbytes for hb in handle._hosts.values()
                               if not isinstance(hb, DiskUnit) and hb.pinned)
                           + (handle.outer.nbytes if handle.outer is not None else 0)
                           + (sum(a.buffer.numel() for a in handle.activations.arenas if a is not None)
                              if handle.activations is not None else 0)
                           + (len(handle.disk.buffers) * handle.disk.slot_bytes if handle.disk is not None else 0))
    if plan.streamed:
        split = f", as {len(streamed_units)} units" if len(streamed_units) != len(plan.streamed) else ""
        cb.log(f"  pinned {pinned / GB:.1f} GB of blocks{split} in {handle.pin_seconds:.1f} s "
               f"({handle.pinned_reused} of {len(streamed_units)} reused from an earlier run"
               + (f"; {handle.map_released / GB:.1f} GB of the slab's map given back" if handle.map_released else "")
               + f"); {host_memory_line(plan.predicted_host_peak_bytes, plan.ram_budget_bytes or 0)}")
    if handle.outer is not None:
        cb.log(f"  {handle.outer.nbytes / GB:.2f} GB of layers outside the blocks wait on the host between their runs "
               f"({', '.join(h.name for _, h in handle.outer.hooks)}): copied in once per forward")
    return handle


def host_memory_line(predicted_bytes: int = 0, budget_bytes: int = 0) -> str:
    """This process's host memory now beside the RAM plan's prediction: what cannot be reclaimed (anonymous +
    shared pages, pinned buffers included), the page-locked part, and the file pages mapped (a slab's map: clean
    page cache the kernel can drop, not counted against the plan)."""
    mem = process_memory()
    predicted = (f" (predicted peak {predicted_bytes / GB:.1f} GB"
                 + (f" of a {budget_bytes / GB:.1f} GB budget" if budget_bytes else "") + ")"
                 if predicted_bytes else "")
    return (f"host RAM {mem.unreclaimable / GB:.1f} GB{predicted}, {mem.locked / GB:.1f} GB of it page-locked, "
            f"+ {mem.file / GB:.1f} GB of mapped file pages; machine {ram_cap_bytes() / GB:.0f} GB")


def _slab_source(model: nn.Module, disk_units: set):
    from ..slab.source import slab_source_of

    source = slab_source_of(model)
    if source is None and disk_units:
        raise ConfigError("the plan reads blocks from disk (disk_blocks), but this model was not loaded from an int8 "
                          "slab: only a slab file has each block as one byte range to read. Load a slab, or set "
                          "disk_blocks to 0 (hold every streamed block in RAM)")
    return source


def _staging_ring(plan: Plan, handle: OffloadHandle, disk_units: set, source, pin: bool):
    from .disk import DiskReader, StagingRing, default_staging_slots, pacer_from_env

    wanted = frozenset(disk_units)
    reader = DiskReader(source.path, source.stamp.size, pacer=pacer_from_env())
    try:
        return StagingRing({u: handle._hosts[u] for u in disk_units},
                           plan.staging_slots or default_staging_slots(plan.prefetch_depth), reader,
                           lambda n: handle.scheduler.future_loads(n, wanted), pin)
    except BaseException:
        reader.close()
        raise


def _disk_rate(source) -> float:
    from .disk import disk_rate_for

    return disk_rate_for(source.path)


def _log_disk_tier(plan: Plan, ring, source, cb: TrainingCallback, rate: Optional[float]) -> None:
    from .disk import slow_disk_warning

    stored = sum(ring.units[u].stored_bytes for u in ring.units)
    cb.log(f"  disk tier: {len(plan.disk_blocks)} blocks ({stored / GB:.2f} GB) read from '{source.path}' at each "
           f"load ({ring.reader.mode}), {len(ring.buffers)} staging buffers of {ring.slot_bytes / 1e6:.0f} MB "
           f"pinned")
    if rate is not None:
        warning = slow_disk_warning(plan, rate, source.path)
        cb.log(warning or f"  the slab's disk reads {rate / GB:.2f} GB/s: {plan.disk_bytes_per_step / GB:.2f} GB "
                          f"per step take {plan.disk_bytes_per_step / rate:.2f} s")


#: The name of the streamer's hook on each block (or unit) it schedules.
STREAM_HOOK = "block_streaming"
#: The name of the streamer's hook on the model: each forward tells the scheduler whether a backward follows.
PASS_HOOK = "block_streaming_pass"


class VisitBlock(ModelHook):
    """Before the unit runs (forward, and its recompute in backward): the scheduler makes its weights ready
    and prefetches the next ones."""

    def __init__(self, scheduler: BlockScheduler, index: int):
        self.scheduler, self.index = scheduler, index

    def pre_forward(self, module, args, kwargs):
        self.scheduler.visit(self.index)
        return args, kwargs


class StartPass(ModelHook):
    """Before the model's forward: a forward under ``torch.no_grad`` (sampling) has no backward to follow, so the
    scheduler follows the forward-only cycle and each pass's end prefetches the next pass's first blocks. (Inside
    a training step the blocks may run without grad, in a checkpoint's forward, but the model's forward itself
    runs with grad on.)"""

    def __init__(self, scheduler: BlockScheduler):
        self.scheduler = scheduler

    def pre_forward(self, module, args, kwargs):
        self.scheduler.start_pass(forward_only=not torch.is_grad_enabled())
        return args, kwargs
