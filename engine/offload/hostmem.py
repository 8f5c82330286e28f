"""Host RAM as a budget: the one home for what the machine and this process hold in host memory.

The planner holds a RAM budget beside the VRAM one (engine/offload/plan.py). What it needs to know:

* how much RAM the process may use: the smaller of the machine's physical RAM and the memory limit of the process's
  own cgroup (a container, a systemd slice), since inside a container ``/proc/meminfo`` shows the host's RAM and a
  plan checked against it is OOM-killed;
* how much of it others hold now (other processes, ComfyUI's own models in another process, the OS);
* what this process holds: resident set (anonymous, file-backed, shared) and page-locked bytes.

Every reader takes ``root`` (default ``/``): the file tree that holds ``proc/`` and ``sys/fs/cgroup/``, so tests run
them on a fake tree under a temporary folder.

cgroup v2: ``/proc/self/cgroup`` has one line ``0::<path>``; the limit is ``memory.max`` of that folder under
``/sys/fs/cgroup`` and of every folder above it (the smallest wins; ``max`` = none). cgroup v1: the line whose
controllers include ``memory`` names the folder under ``/sys/fs/cgroup/memory``; ``memory.limit_in_bytes`` (a value
near 2^63 = none). Usage: ``memory.current`` (v2) / ``memory.usage_in_bytes`` (v1), less the page cache
(``file`` of ``memory.stat``), which the kernel reclaims before it OOM-kills anything.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

GB = 1e9
#: The share of what is free that auto's RAM budget (``ram_budget_gb`` = 0) gives the run. The rest is left for what
#: the plan cannot see: the page cache of the slab and dataset files being read (it is charged to the cgroup, and a
#: cgroup with no room for it thrashes), glibc arena fragmentation of the many small host allocations, and other
#: programs that grow while a run of hours goes on (a browser, ComfyUI loading another model). Page-locked memory
#: cannot be swapped or reclaimed, so an overrun is an OOM kill of the run, not a slowdown: 15% (4.8 GB of 32 GB)
#: is the margin.
SAFETY_FRACTION = 0.85
#: v1 writes "no limit" as the largest page-aligned 64-bit value; anything this large is no limit.
_NO_LIMIT = 1 << 60


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _kv_bytes(text: Optional[str], key: str, scale: int = 1) -> Optional[int]:
    """``key value [kB]`` lines (/proc/meminfo, /proc/self/status, memory.stat): the value in bytes."""
    for line in (text or "").splitlines():
        name, _, rest = line.partition(":") if ":" in line else line.partition(" ")
        if name.strip() == key:
            parts = rest.split()
            if parts and parts[0].isdigit():
                return int(parts[0]) * (1024 if len(parts) > 1 and parts[1].lower() == "kb" else scale)
    return None


def physical_ram_bytes(root: str | Path = "/") -> int:
    """The machine's RAM: MemTotal of ``<root>/proc/meminfo`` (sysconf where that cannot be read)."""
    total = _kv_bytes(_read(Path(root) / "proc/meminfo"), "MemTotal")
    if total:
        return total
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class Cgroup:
    version: int  # 1 | 2
    path: Path  # the process's own cgroup folder (under root)
    top: Path  # the hierarchy's mount point (ancestors up to it are read for limits)


def own_cgroup(root: str | Path = "/") -> Optional[Cgroup]:
    """The process's memory cgroup folder, from ``<root>/proc/self/cgroup``; None where there is none."""
    root = Path(root)
    text = _read(root / "proc/self/cgroup")
    if not text:
        return None
    v1 = v2 = None
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    if v1 is not None:  # a hybrid host mounts memory under v1 even when a v2 line exists
        top = root / "sys/fs/cgroup/memory"
        folder = top / v1.lstrip("/")
        if folder.is_dir():
            return Cgroup(1, folder, top)
        if (top / "memory.limit_in_bytes").exists():  # inside a container: its own cgroup is the mount's root
            return Cgroup(1, top, top)
    if v2 is not None:
        top = root / "sys/fs/cgroup"
        folder = top / v2.lstrip("/")
        if folder.is_dir():
            return Cgroup(2, folder, top)
        return Cgroup(2, top, top)  # a cgroup namespace: the container's cgroup is mounted as the root
    return None


def _limit_file(cg: Cgroup) -> str:
    return "memory.max" if cg.version == 2 else "memory.limit_in_bytes"


def cgroup_limit_bytes(root: str | Path = "/") -> Optional[int]:
    """The memory limit the process lives under: the smallest limit of its cgroup and of every cgroup above it
    (None: no limit, or no cgroup)."""
    cg = own_cgroup(root)
    if cg is None:
        return None
    best = None
    for folder in _up_to_top(cg):
        raw = (_read(folder / _limit_file(cg)) or "").strip()
        if raw.isdigit() and int(raw) < _NO_LIMIT:
            best = int(raw) if best is None else min(best, int(raw))
    return best


def _up_to_top(cg: Cgroup):
    """The process's cgroup folder, then each one above it up to the hierarchy's mount point (a limit anywhere on
    the way holds)."""
    folder = cg.path
    while True:
        yield folder
        if folder == cg.top or cg.top not in folder.parents:
            return
        folder = folder.parent


def usable_cpus(root: str | Path = "/") -> int:
    """The CPUs this process may run on: its affinity mask, within the CPU quota (cgroup v2 ``cpu.max``,
    "<quota> <period>" or "max <period>") of its cgroup and of every cgroup above it. (The cgroup readers live
    here; cgroup v1's CPU quota is not read.)"""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        count = os.cpu_count() or 1
    cg = own_cgroup(root)
    for folder in _up_to_top(cg) if cg is not None and cg.version == 2 else ():
        quota, _, period = (_read(folder / "cpu.max") or "").strip().partition(" ")
        if quota.isdigit() and period.strip().isdigit() and int(period):
            count = min(count, int(quota) // int(period))
    return max(1, count)


def cgroup_usage_bytes(root: str | Path = "/") -> Optional[int]:
    """What the process's cgroup holds now, less its page cache (clean file pages are dropped before anything is
    OOM-killed; a slab read by the previous run sits there and would otherwise count as held); None without a
    cgroup."""
    cg = own_cgroup(root)
    if cg is None:
        return None
    raw = (_read(cg.path / ("memory.current" if cg.version == 2 else "memory.usage_in_bytes")) or "").strip()
    if not raw.isdigit():
        return None
    stat = _read(cg.path / "memory.stat")
    cache = _kv_bytes(stat, "file" if cg.version == 2 else "total_cache") or 0
    return max(0, int(raw) - cache)


@dataclass(frozen=True)
class ProcessMemory:
    """This process's host memory now (bytes, /proc/self/status)."""

    rss: int  # VmRSS: every resident page (anonymous + file-backed + shared)
    anon: int  # RssAnon: heap, torch's host tensors, pinned buffers made from them
    file: int  # RssFile: mapped file pages (a slab's memory map); clean, so the kernel can drop them
    shmem: int  # RssShmem: shared memory (cudaHostAlloc's pinned pages show here on some drivers)
    locked: int  # VmLck + VmPin: page-locked

    @property
    def unreclaimable(self) -> int:
        """What the kernel cannot take back without swap: anonymous + shared (the figure plans are held to)."""
        return self.anon + self.shmem


def process_memory(root: str | Path = "/") -> ProcessMemory:
    """This process's resident and locked bytes (zeros where /proc cannot be read)."""
    text = _read(Path(root) / "proc/self/status")
    get = lambda key: _kv_bytes(text, key) or 0  # noqa: E731
    return ProcessMemory(get("VmRSS"), get("RssAnon"), get("RssFile"), get("RssShmem"), get("VmLck") + get("VmPin"))


def host_rss_bytes(root: str | Path = "/") -> int:
    """Resident set size of this process (0 where /proc cannot be read)."""
    return process_memory(root).rss


def in_use_by_others(root: str | Path = "/") -> int:
    """Bytes held now by everything but this process, within what limits it: the cgroup's usage less the
    process's own resident set under a limit; else the machine's used memory (MemTotal - MemAvailable: the kernel's
    own estimate, reclaimable cache excluded) less the process's."""
    own = process_memory(root)
    if cgroup_limit_bytes(root) is not None:
        usage = cgroup_usage_bytes(root)
        if usage is not None:
            return max(0, usage - own.unreclaimable)
    meminfo = _read(Path(root) / "proc/meminfo")
    total, available = _kv_bytes(meminfo, "MemTotal"), _kv_bytes(meminfo, "MemAvailable")
    if total is None or available is None:
        return 0
    return max(0, total - available - own.unreclaimable)


@dataclass(frozen=True)
class RamBudget:
    """The RAM a run may use, and where the figure came from (for the plan's text)."""

    bytes: int
    source: str  # "set" | "auto"
    physical: int = 0
    limit: Optional[int] = None  # the cgroup's
    others: int = 0  # held by others when resolved

    def describe(self) -> str:
        if self.source == "set":
            return f"{self.bytes / GB:.1f} GB RAM budget (set)"
        cap = f"cgroup limit {self.limit / GB:.1f} GB" if self.limit is not None else f"{self.physical / GB:.0f} GB RAM"
        return (f"{self.bytes / GB:.1f} GB RAM budget (auto: {SAFETY_FRACTION:.0%} of {cap} less "
                f"{self.others / GB:.1f} GB held by others)")


def resolve_ram_budget(ram_budget_gb: float, root: str | Path = "/") -> RamBudget:
    """``ram_budget_gb`` in bytes, or with 0 the auto budget: SAFETY_FRACTION x (min(physical RAM, cgroup limit) -
    what others hold now)."""
    if ram_budget_gb:
        return RamBudget(int(ram_budget_gb * GB), "set")
    physical, limit = physical_ram_bytes(root), cgroup_limit_bytes(root)
    cap = min(physical, limit) if limit is not None else physical
    others = in_use_by_others(root)
    return RamBudget(int(SAFETY_FRACTION * max(0, cap - others)), "auto", physical, limit, others)


def ram_cap_bytes(root: str | Path = "/") -> int:
    """The most RAM this process could have: min(physical, cgroup limit) (what max_pinned_fraction is a share of)."""
    physical, limit = physical_ram_bytes(root), cgroup_limit_bytes(root)
    return min(physical, limit) if limit is not None else physical


def release_freed_heap() -> None:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``). Pinning copies each block into one
    buffer of its own and frees the tensors it came from; those under glibc's mmap threshold (32 MiB: every 4096-wide
    int8 Linear) were heap allocations, and glibc keeps freed heap pages in the process. Measured on eight LTX-2.3
    blocks quantized on the host, then pinned: 0.97 of their 3.1 GB stayed resident until trimmed (31%); the full
    model's GPU row held 6.4 GB more host RAM than its plan (2026-11-28). A slab loaded from its file has no such
    copies (its bytes come from the file's map); a model quantized on the host does. Not glibc: nothing to do."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass

