"""The disk tier: frozen blocks that do not fit the RAM budget are read from the slab file on every load, into a
small ring of pinned staging buffers, and copied from there into their GPU slot, instead of living in a pinned
host copy (``HostBlock``) for the whole run.

    slab file ──preadv, several reader threads, ahead of use──▶ pinned staging ring ──one H2D copy──▶ GPU slot

* A slab stores each block as one contiguous, 64-byte-aligned byte range (engine/slab/format.py). A streamed
  unit (a block, or a part of one: engine/offload/units.py) is read as the 4096-aligned supersets of its
  tensors' ranges (``DiskUnit.runs``: one run for a whole block), copied to the GPU as they lie, and its tensors
  are bound to views at the slab's own offsets inside the slot. Tensors the model holds in another dtype than
  the slab stores (a bias loaded as fp32) are small: they stay on the GPU for the run.
* Order: reads follow the block scheduler (engine/offload/schedule.py), which knows the forward-then-backward
  cycle: ``BlockScheduler.future_loads`` replays its own state to say which disk units it will load next. The
  staging ring reads the next of them ahead into buffers whose bytes nobody needs sooner; a buffer is reused
  only after its host-to-GPU copy landed (its CUDA event). A unit whose bytes are still staged is not read
  again: around the forward->backward turn a small GPU ring evicts blocks it needs again a few visits later,
  and the staging ring serves those from RAM (``StagingPolicy``, pure Python, which the plan also replays to
  count the disk bytes per step).
* O_DIRECT, not the page cache. The tier exists because RAM is short. Buffered reads would pull every disk block
  through the page cache on every step: under a cgroup v2 limit the page cache counts against ``memory.max``,
  so the container that is short of RAM would fill its limit with cache and reclaim under pressure, and each
  byte would be copied twice (cache, then staging). O_DIRECT DMAs straight into the pinned staging buffer and
  leaves the cache alone; it needs the buffer, the offset and the length aligned to 4096, hence the aligned
  supersets above. Where O_DIRECT is refused (tmpfs, some network filesystems) the tier reads through the page
  cache and drops each range after reading it (``posix_fadvise(DONTNEED)``), and says so.
* Rate: ``disk_rate_for(path)`` probes the slab's device once (O_DIRECT reads of the slab itself) and caches it
  per device and filesystem, beside the link's figure (engine/offload/link.py). ``LOWVRAM_EMULATE_DISK_GBPS``
  (benches) paces the reads so a fast machine behaves like a 3.5 or 7 GB/s NVMe drive, and the rate the
  planner sees is the paced one.
* Activations never go to disk (SSD wear would be terabytes per run): only frozen weights, which are only read.
"""
from __future__ import annotations

import functools
import math
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from ..errors import ConfigError
from .host import Entry, HostBlock, PinnedBuffer, frozen_tensors

ALIGN = 4096  # O_DIRECT: buffer address, file offset and length in multiples of the logical block size (<= 4096)
READERS = 4  # reader threads: an NVMe drive needs several requests in flight to reach its rate
CHUNK_BYTES = 16 << 20  # one read request; a unit's runs are cut into these and spread over the readers
MERGE_GAP = 64 << 10  # tensors closer than this in the file are read as one run (one request beats two)
PROBE_BYTES = 1 << 30
ENV_EMULATE_DISK_GBPS = "LOWVRAM_EMULATE_DISK_GBPS"
GB = 1e9


def default_staging_slots(prefetch_depth: int) -> int:
    """Buffers in the staging ring when the plan does not say: the GPU ring's copies in flight (prefetch depth)
    plus one being read and one being copied, which is also enough to carry the turn's blocks."""
    return prefetch_depth + 2


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose first byte is 4096-aligned (O_DIRECT's buffer rule)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + nbytes]


# --- which bytes a unit is ----------------------------------------------------------------------------------------


def slab_key(names: dict[int, str], module: nn.Module, name: str) -> str:
    """The slab's key of ``module.name``: its state-dict name without peft's ``base_layer`` wrappers."""
    path = names[id(module)]
    parts = [p for p in path.split(".") if p != "base_layer"] if path else []
    return ".".join(parts + [name])


class DiskUnit(HostBlock):
    """A streamed unit whose frozen bytes are read from the slab file: where each tensor lies in the file, and how
    it lies in the staging buffer and the GPU slot (the same layout: the file's runs, back to back).

    Evicted, its tensors are zero-stride CPU views of one element (their shape, no bytes: a stray use on the GPU
    fails loudly, on the device mismatch, as with an evicted RAM block). The tensor objects are kept throughout
    (``tensor.data`` is swapped, as for RAM blocks), so compiled blocks see the same parameters every load."""

    def __init__(self, unit: nn.Module, unit_name: str, source, names: dict[int, str]):
        self.name, self.source = unit_name, source
        spans, self.kept = [], []
        for module, name, is_param, t in frozen_tensors(unit):
            stored = source.tensors.get(slab_key(names, module, name))
            if stored is None or stored.dtype != t.dtype or tuple(stored.shape) != tuple(t.shape):
                self.kept.append(t)  # not as stored (converted to another dtype on load): small, stays on the GPU
            else:
                spans.append((stored.start, stored.end, module, name, is_param, t.dtype, tuple(t.shape),
                              slab_key(names, module, name)))
        spans.sort(key=lambda s: s[0])
        runs: list[list[int]] = []  # [file start, file end], both 4096-aligned
        for start, end, *_ in spans:
            lo, hi = start // ALIGN * ALIGN, -(-end // ALIGN) * ALIGN
            if runs and lo <= runs[-1][1] + MERGE_GAP:
                runs[-1][1] = max(runs[-1][1], hi)
            else:
                runs.append([lo, hi])
        self.runs: list[tuple[int, int, int]] = []  # (file offset, length, offset in the staging buffer / slot)
        dst = 0
        for lo, hi in runs:
            self.runs.append((lo, hi - lo, dst))
            dst += hi - lo
        self.nbytes = dst
        self.entries: list[Entry] = []
        self.keys: list[str] = []
        for start, end, module, name, is_param, dtype, shape, key in spans:
            lo, _, at = next(r for r in self.runs if r[0] <= start < r[0] + r[1])
            self.entries.append(Entry(module, name, is_param, at + start - lo, end - start, dtype, shape))
            self.keys.append(key)
        self.pinned = False
        self._signature = self._signature_of(unit)

    @property
    def stored_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def _put(self, e: Entry, tensor: torch.Tensor) -> None:
        t = e.tensor()
        if t.device.type == "meta" or tensor.device.type == "meta" or \
                not torch._has_compatible_shallow_copy_type(t, tensor):
            new = nn.Parameter(tensor, requires_grad=False) if e.is_param else tensor
            (e.module._parameters if e.is_param else e.module._buffers)[e.name] = new
        else:
            t.data = tensor

    def bind_host(self) -> None:
        """Evicted: the bytes are on disk only."""
        for e in self.entries:
            self._put(e, torch.zeros((), dtype=e.dtype).expand(e.shape))

    def bound_to_host(self) -> bool:
        return False

    def restore(self) -> Optional[str]:
        """After streaming: the tensors back as views of the slab's memory map (read lazily, as the loader left
        them). Returns why not when the file cannot be opened any more (the tensors then stay empty views)."""
        try:
            self.source.check()
            from safetensors import safe_open

            with safe_open(str(self.source.path), framework="pt") as f:
                for e, key in zip(self.entries, self.keys):
                    self._put(e, f.get_tensor(key))
        except Exception as exc:  # noqa: BLE001  (cleanup: report, never mask the run's own outcome)
            self.bind_host()
            return f"{self.name}: {exc}"
        return None


# --- reading ------------------------------------------------------------------------------------------------------


class DiskPacer:
    """Holds reads to ``bytes_per_s`` in total over every reader thread: each read reserves its slot on one shared
    timeline (n / rate seconds after the previous reservation ends) and may not complete before its slot ends."""

    def __init__(self, bytes_per_s: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if not bytes_per_s > 0:
            raise ValueError("the paced disk rate must be positive")
        self.rate, self.clock, self.sleep = bytes_per_s, clock, sleep
        self._lock = threading.Lock()
        self._free_at = 0.0
        self.paced_s = 0.0

    def reserve(self, nbytes: int) -> float:
        with self._lock:
            start = max(self.clock(), self._free_at)
            self._free_at = start + nbytes / self.rate
            return self._free_at

    def hold_until(self, deadline: float) -> None:
        pad = deadline - self.clock()
        if pad > 0:
            with self._lock:
                self.paced_s += pad
            self.sleep(pad)


def pacer_from_env() -> Optional[DiskPacer]:
    from .link import env_gbps

    gbps = env_gbps(ENV_EMULATE_DISK_GBPS)
    return DiskPacer(gbps * GB) if gbps is not None else None


def open_for_reading(path: Path, direct: bool = True) -> tuple[int, bool, str]:
    """(fd, O_DIRECT in use, why not). O_DIRECT is tried with one aligned read: some filesystems accept the open
    and refuse the reads (EINVAL)."""
    flag = getattr(os, "O_DIRECT", 0)
    if direct and flag:
        try:
            fd = os.open(path, os.O_RDONLY | flag)
        except OSError as exc:
            why = f"O_DIRECT refused by the filesystem ({exc.strerror})"
        else:
            try:
                os.preadv(fd, [memoryview(aligned_empty(ALIGN).numpy())], 0)
                return fd, True, ""
            except OSError as exc:
                os.close(fd)
                why = f"O_DIRECT reads refused by the filesystem ({exc.strerror})"
    else:
        why = "O_DIRECT not asked for" if not direct else "O_DIRECT not offered by this OS"
    return os.open(path, os.O_RDONLY), False, why


class DiskReader:
    """One open slab file and a pool of reader threads that fill caller buffers (os.preadv releases the GIL)."""

    def __init__(self, path: Path, size: int, readers: int = READERS, direct: bool = True,
                 pacer: Optional[DiskPacer] = None):
        self.path, self.size, self.pacer = Path(path), size, pacer
        self.fd, self.direct, self.why_buffered = open_for_reading(self.path, direct)
        self.pool = ThreadPoolExecutor(readers, thread_name_prefix="slab-disk")
        # Seconds with at least one read in flight (the union over the reader threads): bytes read / busy_s is the
        # rate the disk really gave during training, which the overlap bound is judged at (the probe reads one
        # sequential range once, before training; a shared or virtual disk may give less under the run).
        self.busy_s, self._in_flight, self._busy_since, self._busy_lock = 0.0, 0, 0.0, threading.Lock()

    def _io(self, starting: bool) -> None:
        with self._busy_lock:
            now = time.perf_counter()
            if starting:
                if self._in_flight == 0:
                    self._busy_since = now
                self._in_flight += 1
            else:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self.busy_s += now - self._busy_since

    @property
    def mode(self) -> str:
        return "O_DIRECT" if self.direct else f"page cache, each range dropped after reading ({self.why_buffered})"

    def _chunks(self, runs: Sequence[tuple[int, int, int]]):
        for offset, length, dst in runs:
            for at in range(0, length, CHUNK_BYTES):
                yield offset + at, min(CHUNK_BYTES, length - at), dst + at

    def submit(self, runs, buffer: torch.Tensor, after=None) -> list[Future]:
        """Read ``runs`` into ``buffer`` on the reader threads, each chunk once ``after`` (a CUDA event: the
        buffer's last copy to the GPU) has completed."""
        view = memoryview(buffer.numpy())
        return [self.pool.submit(self._read, view, offset, length, dst, after)
                for offset, length, dst in self._chunks(runs)]

    def read_now(self, runs, buffer: torch.Tensor, after=None) -> None:
        view = memoryview(buffer.numpy())
        for offset, length, dst in self._chunks(runs):
            self._read(view, offset, length, dst, after)

    def _read(self, view: memoryview, offset: int, length: int, dst: int, after) -> int:
        if after is not None:
            after.synchronize()  # the staging buffer's previous bytes have reached the GPU
        deadline = self.pacer.reserve(length) if self.pacer is not None else None
        want = min(length, self.size - offset)  # the last aligned run may reach past the end of the file
        got = 0
        self._io(True)
        try:
            while got < want:
                n = os.preadv(self.fd, [view[dst + got:dst + length]], offset + got)
                if n <= 0 or (self.direct and got + n < want and n % ALIGN):
                    raise OSError(f"short read at byte {offset + got} ({n} of {want - got} bytes): truncated?")
                got += n
            if deadline is not None:  # an emulated slower disk: the read lasts until its paced deadline
                self.pacer.hold_until(deadline)
        finally:
            self._io(False)
        if not self.direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_DONTNEED)  # keep the page cache from growing
        return got

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# --- the staging ring ---------------------------------------------------------------------------------------------


class StagingPolicy:
    """Which staging buffer holds which disk unit and what to read next, from the predicted order of disk loads
    (``predict(n)``: the next n, after the one being served). Pure Python: the ring follows it, and the plan
    replays it to count disk bytes per step (``simulate_disk_reads``)."""

    def __init__(self, slots: int, predict: Callable[[int], list[int]]):
        if slots < 1:
            raise ValueError("the staging ring needs at least one buffer")
        self.held: list[Optional[int]] = [None] * slots
        self.served: list[bool] = [False] * slots  # its bytes already went to the GPU once
        self.predict = predict
        self.queue: deque[int] = deque()
        self.resyncs = 0

    @property
    def lookahead(self) -> int:
        return 4 * len(self.held) + 8

    def _advance(self, unit: int) -> None:
        if self.queue and self.queue[0] == unit:
            self.queue.popleft()
        else:
            if self.queue:  # called out of the predicted order (a resync of the scheduler): predict again
                self.resyncs += 1
            self.queue = deque(self.predict(self.lookahead))
        if len(self.queue) < 2 * len(self.held):
            self.queue = deque(self.predict(self.lookahead))

    def window(self) -> list[int]:
        out: list[int] = []
        for u in self.queue:
            if u not in out:
                out.append(u)
                if len(out) == len(self.held):
                    break
        return out

    def holding(self, unit: int) -> Optional[int]:
        return self.held.index(unit) if unit in self.held else None

    def victim(self, protect: set) -> Optional[int]:
        """An empty buffer, else the one whose unit is needed farthest ahead (never one of ``protect``)."""
        best, best_key = None, -1.0
        where = {}
        for i, u in enumerate(self.queue):
            where.setdefault(u, i)
        for b, u in enumerate(self.held):
            if u is not None and u in protect:
                continue
            key = math.inf if u is None or u not in where else where[u]
            if key > best_key:
                best, best_key = b, key
        return best

    def serve(self, unit: int) -> tuple[int, bool, bool]:
        """``unit`` is being loaded: (its buffer, whether it must be read now, whether its staged bytes are
        served again without a read)."""
        self._advance(unit)
        b = self.holding(unit)
        read_now = b is None
        if read_now:
            b = self.victim({unit, *self.window()})
            if b is None:
                b = self.victim({unit})
            self.held[b], self.served[b] = unit, False
        reused = self.served[b]
        self.served[b] = True
        return b, read_now, reused

    def readahead(self) -> list[tuple[int, int]]:
        """(unit, buffer) reads to start now: the next units not staged, into buffers nobody needs sooner."""
        window = self.window()
        protect = set(window)
        out = []
        for u in window:
            if u in self.held:
                continue
            b = self.victim(protect)
            if b is None:
                break
            self.held[b], self.served[b] = u, False
            out.append((u, b))
        return out


def simulate_disk_reads(loads: Sequence[int], disk: set, slots: int, steps: int = 3) -> list[int]:
    """The disk units read during one steady-state step, given one step's loads in order (the scheduler's
    ``simulate_step``) and ``slots`` staging buffers."""
    return list(_disk_reads(tuple(u for u in loads if u in disk), slots, steps))


@functools.lru_cache(maxsize=4096)  # auto tries many disk sets over the same few load orders
def _disk_reads(seq: tuple, slots: int, steps: int) -> tuple:
    if not seq:
        return ()
    at = [0]
    policy = StagingPolicy(slots, lambda n: [seq[(at[0] + i) % len(seq)] for i in range(n)])
    reads: list[int] = []
    for _ in range(steps):
        reads = []
        for i, u in enumerate(seq):
            at[0] = i + 1
            _, read_now, _ = policy.serve(u)
            if read_now:
                reads.append(u)
            reads += [v for v, _ in policy.readahead()]
    return tuple(reads)


class _Buffer:
    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.futures: list[Future] = []
        self.event = None  # the last copy out of it (CUDA event; None on the CPU)


class StagingRing:
    """The pinned staging buffers and the reads into them, following ``StagingPolicy``. Called by the copy engine
    (engine/offload/streamer.py) on the training thread only: ``fetch(unit)`` returns the unit's staged bytes
    (waiting for its read: the disk wait), ``copied(unit, event)`` says their copy out is enqueued."""

    def __init__(self, units: dict[int, DiskUnit], slots: int, reader: DiskReader,
                 predict: Callable[[int], list[int]], pin: bool):
        self.units, self.reader = units, reader
        self.source = next(iter(units.values())).source
        self.slot_bytes = max(u.nbytes for u in units.values())
        # one region: one registration (unregistered before the memory can be freed, even without close())
        self._host = PinnedBuffer(slots * self.slot_bytes, torch.uint8, pin,
                                  memory=aligned_empty(slots * self.slot_bytes))
        self.memory = self._host.tensor
        self.buffers = [_Buffer(self.memory[i * self.slot_bytes:(i + 1) * self.slot_bytes]) for i in range(slots)]
        self.policy = StagingPolicy(slots, predict)
        self.bytes_read = self.reads = self.sync_reads = self.reused = 0
        self.wait_s = 0.0
        self._step_bytes, self._step_wait = 0, 0.0

    @property
    def nbytes(self) -> int:
        return self.memory.numel()

    def _settle(self, b: _Buffer) -> None:
        futures, b.futures = b.futures, []
        for f in futures:
            try:
                f.result()
            except Exception as exc:  # noqa: BLE001  (an OSError, or a CUDA error from the event: named below)
                raise self.source.read_failed(exc) from exc

    def _count(self, unit: DiskUnit) -> None:
        n = sum(length for _, length, _ in unit.runs)
        self.bytes_read += n
        self._step_bytes += n
        self.reads += 1

    def fetch(self, unit: int) -> torch.Tensor:
        self.source.check()  # a stat: a replaced or removed slab stops here, before any read of it
        t0 = time.perf_counter()
        index, read_now, reused = self.policy.serve(unit)
        b, du = self.buffers[index], self.units[unit]
        if read_now:
            self._settle(b)  # a mispredicted read still in flight into this buffer
            self.sync_reads += 1
            self._count(du)
            try:
                self.reader.read_now(du.runs, b.tensor, b.event)
            except Exception as exc:  # noqa: BLE001
                raise self.source.read_failed(exc) from exc
        else:
            self._settle(b)
        self.reused += int(reused)
        waited = time.perf_counter() - t0
        self.wait_s += waited
        self._step_wait += waited
        return b.tensor[:du.nbytes]

    def copied(self, unit: int, event) -> None:
        index = self.policy.holding(unit)
        if index is not None:
            self.buffers[index].event = event
        for v, index in self.policy.readahead():
            b = self.buffers[index]
            self._settle(b)
            self._count(self.units[v])
            b.futures = self.reader.submit(self.units[v].runs, b.tensor, b.event)

    def harvest(self) -> tuple[int, float]:
        """(bytes read, seconds the training thread waited for reads) since the last call."""
        out = (self._step_bytes, self._step_wait)
        self._step_bytes, self._step_wait = 0, 0.0
        return out

    def stats(self) -> dict:
        return {"disk_bytes_read": self.bytes_read, "disk_reads": self.reads, "disk_sync_reads": self.sync_reads,
                "disk_reused": self.reused, "disk_resyncs": self.policy.resyncs,
                "disk_wait_s": round(self.wait_s, 3), "disk_busy_s": round(self.reader.busy_s, 3),
                "disk_gbps_busy": round(self.bytes_read / self.reader.busy_s / 1e9, 3) if self.reader.busy_s else None,
                "disk_mode": "O_DIRECT" if self.reader.direct else "page cache",
                "disk_paced_s": round(self.reader.pacer.paced_s, 3) if self.reader.pacer is not None else 0.0,
                "staging_bytes": self.nbytes}

    def close(self) -> None:
        for b in self.buffers:
            for f in b.futures:
                f.cancel()
        self.reader.close()
        self._host.release()


# --- the plan's side ----------------------------------------------------------------------------------------------


def read_bytes_of(nbytes: int) -> int:
    """What reading a stored range of ``nbytes`` costs at most (its 4096-aligned superset)."""
    return -(-nbytes // ALIGN) * ALIGN + ALIGN


def last_streamed(plan, count: int) -> list[int]:
    """The ``count`` streamed blocks that run last in the forward: next to the turn, where the staging ring carries
    a block from the forward into the backward, so they are read the fewest times."""
    if count > len(plan.streamed):
        raise ConfigError(f"disk_blocks={count} but the plan streams only {len(plan.streamed)} blocks; lower "
                          f"disk_blocks or resident_blocks")
    return plan.streamed[len(plan.streamed) - count:] if count else []


def slow_disk_warning(plan, bytes_per_s: float, path) -> Optional[str]:
    """A warning when the plan's disk reads take longer than its compute (the step waits for the disk)."""
    if not plan.disk_blocks or not plan.disk_bytes_per_step or plan.step_time is None:
        return None
    disk_s = plan.disk_bytes_per_step / bytes_per_s
    compute_s = plan.step_time.compute_s
    if disk_s <= compute_s:
        return None
    step = max(plan.predicted_step_s or 0.0, disk_s)
    return (f"warning: slab '{path}' is on a disk that reads {bytes_per_s / GB:.2f} GB/s; this plan reads "
            f"{plan.disk_bytes_per_step / GB:.2f} GB per step from it ({disk_s:.2f} s), more than the step's compute "
            f"({compute_s:.2f} s): predicted step {step:.2f} s. Keep more blocks in RAM (a larger RAM budget), or "
            f"move the slab to a faster disk (NVMe)")


# --- the disk's rate ----------------------------------------------------------------------------------------------


def filesystem_of(path: Path) -> tuple[str, str]:
    """(device "major:minor", filesystem type) of the filesystem holding ``path`` (Linux mountinfo)."""
    dev = os.stat(path).st_dev
    dev_id = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and fields[2] == dev_id and " - " in line:
                    return dev_id, line.split(" - ", 1)[1].split()[0]
    except OSError:
        pass
    return dev_id, "?"


def probe_disk_bytes_per_s(path: Path, nbytes: int = PROBE_BYTES, direct: bool = True,
                           pacer: Optional[DiskPacer] = None) -> tuple[float, bool]:
    """(bytes/s, O_DIRECT) reading the first ``nbytes`` of ``path`` as the tier reads (reader threads, chunks).
    Through the page cache, the file's cached pages are dropped first, so the device is measured."""
    size = os.stat(path).st_size
    n = max(ALIGN, min(nbytes, size) // ALIGN * ALIGN)
    reader = DiskReader(path, size, direct=direct, pacer=pacer)
    try:
        if not reader.direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(reader.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        # One small buffer the readers share (its bytes are thrown away): the probe must not itself take the RAM
        # the tier is there to save.
        window = min(n, READERS * CHUNK_BYTES)
        buffer = aligned_empty(window)
        buffer[::ALIGN].zero_()  # touch the pages first: the probe times the disk, not page faults
        runs = [(at, min(CHUNK_BYTES, n - at), at % window) for at in range(0, n, CHUNK_BYTES)]
        t0 = time.perf_counter()
        for f in reader.submit(runs, buffer):
            f.result()
        return n / max(time.perf_counter() - t0, 1e-9), reader.direct
    finally:
        reader.close()


def disk_cache_path() -> Path:
    from .link import cache_path

    return cache_path().with_name("disk.json")


def raw_disk_rate(path: Path) -> tuple[float, str]:
    """(bytes/s, "cache" | "probe") of the slab's disk, measured once per device and filesystem."""
    from .link import cached_link

    path = Path(path)
    dev, fstype = filesystem_of(path)
    fd, direct, _ = open_for_reading(path)
    os.close(fd)
    key = f"disk {dev} | {fstype} | {'O_DIRECT' if direct else 'page cache'}"
    return cached_link(key, lambda: probe_disk_bytes_per_s(path, direct=direct)[0], disk_cache_path())


def disk_rate_for(path) -> float:
    """Bytes/s the disk tier reads ``path`` at: the measured rate, or the paced one (LOWVRAM_EMULATE_DISK_GBPS)
    where that is lower."""
    from .link import env_gbps

    raw, _ = raw_disk_rate(Path(path))
    emulated = env_gbps(ENV_EMULATE_DISK_GBPS)
    return min(raw, emulated * GB) if emulated is not None else raw
