"""Where a training step's time goes: the breakdown printed after step 2 and reported per step; and where the time
before the first step and after the last goes (``PhaseClock``).

    data        host: reading and moving the cached latents / embeddings of the step
    compute     GPU: forward + backward of every micro-batch (CUDA events around them)
    optimizer   GPU: gradient averaging, clipping, the optimizer step (CUDA events)
    copy stall  GPU: of compute, the time the compute stream waited for a streamed block's copy
                (the block streamer's own events; 0 when nothing streams)
    host        the rest of the wall time: Python, synchronisations, work before the first kernel.
                Idle gaps between kernels inside the compute span count as compute (events mark
                the span, not the kernels): a kernel profile is needed to see a launch-bound step

On the CPU there are no events: compute and optimizer are host time.
Recording two events per step costs microseconds; the loop synchronises after each step anyway.
"""
from __future__ import annotations

import time

import torch


class StepTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self.data_s = 0.0
        self.host_marks = {}
        self.events = {}
        self.mark("start")

    def mark(self, name: str) -> None:
        self.host_marks[name] = time.perf_counter()
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self.events[name] = event

    def add_data(self, seconds: float) -> None:
        self.data_s += seconds

    def _span(self, a: str, b: str) -> float:
        if self.cuda:
            return self.events[a].elapsed_time(self.events[b]) / 1000.0
        return self.host_marks[b] - self.host_marks[a]

    def finish(self, stall_s: float = 0.0) -> dict[str, float]:
        """Seconds per part; call after the step's synchronisation ("backward" and "optimizer" marked)."""
        wall = time.perf_counter() - self.t0
        compute = self._span("start", "backward")
        optimizer = self._span("backward", "optimizer")
        parts = {"data": self.data_s, "compute": compute, "optimizer": optimizer, "copy_stall": min(stall_s, compute)}
        parts["host"] = max(0.0, wall - compute - optimizer - (0.0 if self.cuda else self.data_s))
        parts["wall"] = wall
        return {k: round(v, 4) for k, v in parts.items()}


def describe(parts: dict[str, float], gpu: bool = True) -> str:
    """One line for the log; on a CPU run without the GPU-only parts (copy waits, host time outside GPU work)."""
    wall = parts["wall"] or 1e-9

    def pct(k):
        return f"{parts[k]:.3f} s ({100 * parts[k] / wall:.0f}%)"

    if not gpu:
        return (f"step time {wall:.3f} s: compute {pct('compute')}, optimizer {pct('optimizer')}, "
                f"data {parts['data']:.3f} s")
    return (f"step time {wall:.3f} s: compute {pct('compute')} of which waiting for block copies "
            f"{parts['copy_stall']:.3f} s, optimizer {pct('optimizer')}, data {parts['data']:.3f} s, "
            f"host outside GPU work {pct('host')}")


class PhaseClock:
    """Seconds per named phase of a run's start-up and end (wall clock, host side): ``mark(name)`` closes the phase
    that ran since the previous mark (or since the clock was made). A long start-up (loading an expert, pinning tens
    of GB of host buffers at 1-3 GB/s) is then shown by phase, in the log and in the result's settings."""

    def __init__(self, now=time.perf_counter) -> None:
        self.now = now
        self.last = now()
        self.seconds: dict[str, float] = {}

    def mark(self, name: str) -> float:
        now = self.now()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self.last, 3)
        self.last = now
        return self.seconds[name]

    def total(self) -> float:
        return round(sum(self.seconds.values()), 3)

    def describe(self, what: str) -> str:
        """``what`` and its total, then each phase of at least 0.05 s: one line for the log."""
        parts = ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items() if s >= 0.05)
        return f"{what} {self.total():.1f} s" + (f": {parts}" if parts else "")
