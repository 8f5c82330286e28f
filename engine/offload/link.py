"""The pinned host-to-GPU link: measured once per machine and cached on disk, so ``auto`` can plan for it
(engine/offload/steptime.py); and, for benches, paced to emulate a slower link.

Why measure: the same plan is compute-bound on an H100's PCIe 5.0 link (~54 GB/s) and copy-bound on the PCIe 4.0
x16 boards most users have (~25 GB/s); a figure per GPU model would be wrong for half the boards. The probe copies
a pinned host buffer of ``PROBE_BYTES`` to the GPU ``PROBE_REPEATS`` times (after one warm-up copy) and keeps the
median rate: well under a second, once per machine (GPU name, PCI address, torch version), cached in
``link.json`` under the user cache dir (``$LOWVRAM_CACHE_DIR``, else ``$XDG_CACHE_HOME/lowvram-lora``, else
``~/.cache/lowvram-lora``). A cache file that cannot be read is measured again and rewritten, never an error.

Overrides (environment): ``LOWVRAM_LINK_GBPS`` (this figure instead of the probe) and ``LOWVRAM_EMULATE_LINK_GBPS``
(benches: the copy engine paces its copies to this rate, ``LinkPacer``, and the planner plans for the paced link,
which is measured through the pacer).
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from ..errors import ConfigError
from .steptime import GB, Machine, peak_flops_for

ENV_CACHE_DIR = "LOWVRAM_CACHE_DIR"
ENV_LINK_GBPS = "LOWVRAM_LINK_GBPS"
ENV_EMULATE_GBPS = "LOWVRAM_EMULATE_LINK_GBPS"
PROBE_BYTES = 256 * 2**20
PROBE_REPEATS = 5
CACHE_VERSION = 1


def cache_path() -> Path:
    """Where measured links are kept (one JSON file for every GPU of this machine)."""
    base = os.environ.get(ENV_CACHE_DIR)
    if base:
        return Path(base) / "link.json"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "lowvram-lora" / "link.json"


def cache_key(gpu_name: str, pci_bus: str = "", torch_version: str = "") -> str:
    """One link per GPU model and slot (two cards of one model can sit on x16 and x8), per torch build."""
    return f"{gpu_name} | pci {pci_bus or '?'} | torch {torch_version or '?'}"


def read_cache(path: Path) -> dict:
    """{key: {"bytes_per_s": ..., "measured": ...}}; {} for a missing, unreadable or foreign file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("links"), dict):
        return {}
    return data["links"]


def write_cache(path: Path, links: dict) -> None:
    """Atomically (a temporary file in the same folder, then a rename): a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".link-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"version": CACHE_VERSION, "links": links}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with_suppressed(lambda: os.unlink(tmp))
        raise


def with_suppressed(fn: Callable[[], None]) -> None:
    try:
        fn()
    except OSError:
        pass


def cached_link(key: str, probe: Callable[[], float], path: Optional[Path] = None) -> tuple[float, str]:
    """(bytes/s, "cache" | "probe"): the cached figure for ``key``, else ``probe()``'s, written back. A cache
    that cannot be written (read-only home) only costs a probe next time."""
    path = path or cache_path()
    links = read_cache(path)
    entry = links.get(key)
    value = entry.get("bytes_per_s") if isinstance(entry, dict) else None
    if isinstance(value, (int, float)) and value > 0:
        return float(value), "cache"
    measured = float(probe())
    if not measured > 0:
        raise RuntimeError(f"the link probe measured {measured} bytes/s for {key}")
    links[key] = {"bytes_per_s": measured, "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with_suppressed(lambda: write_cache(path, links))
    return measured, "probe"


def env_gbps(name: str) -> Optional[float]:
    """A positive GB/s figure from the environment, or None when unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        raise ConfigError(f"{name}={raw!r} must be a positive number of GB/s (e.g. 25), or unset")
    return value


class LinkPacer:
    """Paces a copy stream to ``target`` bytes/s on a link that does ``raw``: after each copy of n bytes, the
    stream is held for n/target - n/raw more (never negative), so back-to-back copies land at the target rate.

    On the GPU the hold is ``torch.cuda._sleep`` (a one-thread spin kernel) enqueued on the copy stream: it
    delays that stream's later copies and the copy's ready event, while the compute stream runs on (it only
    waits for the ready event, as it would for a copy over a slower link). ``spin`` is what holds the stream
    (tests pass a fake clock's)."""

    def __init__(self, target_bytes_per_s: float, raw_bytes_per_s: float, spin: Callable[[float], None]):
        if not target_bytes_per_s > 0 or not raw_bytes_per_s > 0:
            raise ValueError("link rates must be positive")
        self.target, self.raw, self.spin = target_bytes_per_s, raw_bytes_per_s, spin
        self.paced_s = 0.0

    def pad_seconds(self, nbytes: int) -> float:
        return max(0.0, nbytes / self.target - nbytes / self.raw)

    def after_copy(self, nbytes: int) -> None:
        pad = self.pad_seconds(nbytes)
        if pad > 0:
            self.paced_s += pad
            self.spin(pad)


def gpu_spin(device) -> Callable[[float], None]:
    """A spin of ``seconds`` on the current stream: ``torch.cuda._sleep`` cycles, calibrated once against events."""
    import torch

    cycles = 20_000_000
    rates = []
    with torch.cuda.device(device):
        torch.cuda._sleep(cycles // 10)  # warm-up (module load)
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(cycles)
            b.record()
            b.synchronize()
            rates.append(cycles / (a.elapsed_time(b) / 1e3))
    per_s = statistics.median(rates)

    def spin(seconds: float) -> None:
        torch.cuda._sleep(max(1, int(seconds * per_s)))

    return spin


def probe_link_bytes_per_s(device, pacer: Optional[LinkPacer] = None, nbytes: int = PROBE_BYTES,
                           repeats: int = PROBE_REPEATS) -> float:
    """Median rate of pinned host -> ``device`` copies of ``nbytes`` on a side stream (through ``pacer``: the
    paced rate)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    rates = []
    with torch.cuda.stream(stream):
        for i in range(repeats + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            dst.copy_(src, non_blocking=True)
            if pacer is not None:
                pacer.after_copy(nbytes)
            b.record(stream)
            b.synchronize()
            if i:  # the first copy warms up the path
                rates.append(nbytes / (a.elapsed_time(b) / 1e3))
    del src, dst
    return statistics.median(rates)


def _key_for(device) -> tuple[str, str]:
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    pci = ":".join(str(getattr(props, a, "?")) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    return props.name, cache_key(props.name, pci, torch.__version__)


def raw_link_bytes_per_s(device) -> tuple[float, str, str]:
    """(bytes/s, source, GPU name) of the real link: ``LOWVRAM_LINK_GBPS``, the cache, or a probe."""
    name, key = _key_for(device)
    override = env_gbps(ENV_LINK_GBPS)
    if override is not None:
        return override * GB, ENV_LINK_GBPS, name
    value, source = cached_link(key, lambda: probe_link_bytes_per_s(device))
    return value, source, name


def pacer_for(device) -> Optional[LinkPacer]:
    """The pacer for ``LOWVRAM_EMULATE_LINK_GBPS`` on ``device`` (None when unset, or not below the real link)."""
    target = env_gbps(ENV_EMULATE_GBPS)
    if target is None:
        return None
    raw, _, _ = raw_link_bytes_per_s(device)
    if target * GB >= raw:
        return None
    return LinkPacer(target * GB, raw, gpu_spin(device))


def resolve_machine(device) -> Optional[Machine]:
    """The machine the planner predicts for: this CUDA device's link (paced when emulating) and bf16 peak.
    None off CUDA (the planner then assumes a 25 GB/s link)."""
    import torch

    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    raw, source, name = raw_link_bytes_per_s(device)
    pacer = pacer_for(device)
    if pacer is not None:
        paced = probe_link_bytes_per_s(device, pacer)
        return Machine(paced, peak_flops_for(name), name,
                       f"emulated {pacer.target / GB:g} GB/s ({ENV_EMULATE_GBPS}), measured through the pacer; "
                       f"real link {raw / GB:.1f} GB/s ({source})")
    return Machine(raw, peak_flops_for(name), name, f"measured, {source}" if source in ("cache", "probe") else source)
