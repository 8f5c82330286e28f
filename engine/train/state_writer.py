"""Resume saves off the training thread: the state is copied to host memory at a step boundary, then written
on a worker thread while training goes on (engine/train/resume.py uses both parts).

    staging = HostStaging()
    host = staging.copy({"lora/x": p, ...})   # the training thread: host copies, taken now
    writer = StateWriter()
    writer.start(step, lambda: write(host))    # returns at once; the files are written on the worker
    ...
    for outcome in writer.finished():          # at each step boundary: the saves that ended, errors included
        ...
    writer.finished(wait=True)                 # at a stop and at the end: waits for the one in flight

Why: a Flux.1 state (LoRA weights and AdamW moments, ~12 bytes per LoRA weight) took 1.5-2.0 s to copy,
serialize, hash and fsync on the training thread, every 25 steps. Only the copy needs the training thread
(the next optimizer step changes the weights and moments in place); serializing, hashing and fsync release
the GIL and run beside the next steps.

``HostStaging``: one flat host buffer holds every tensor of a state (pinned when any tensor is on CUDA, so
the device-to-host copies are asynchronous and end with one synchronisation). It is kept and reused by the
next save: the copy costs no allocation (pinning hundreds of MB takes longer than copying them). Reuse is
safe because only one save is ever in flight and the next copy is taken after it ended.

``StateWriter``: one background write at a time. Its outcome (the path, or the exception) is kept until the
training thread asks for it, so an error on the worker is never lost: it surfaces at the next step boundary,
at the next save, or at the end of the run.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..offload.host import PinnedBuffer

_ALIGN = 64  # bytes: every view starts aligned for any dtype


@dataclass
class SaveOutcome:
    """What became of one background save: ``path`` of its JSON when written, else ``error``."""

    step: int
    path: Path | None
    error: BaseException | None
    seconds: float  # the write on the worker


class HostStaging:
    """Host copies of a state's tensors, taken at a step boundary, in one reused buffer."""

    def __init__(self):
        self._pinned: PinnedBuffer | None = None  # the staging buffer
        self._layout: tuple = ()  # (name, shape, dtype, device) of each tensor the views below were made for
        self._views: dict[str, torch.Tensor] = {}

    def copy(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Contiguous host copies of ``tensors`` (same dtypes and shapes), complete when this returns. The
        copies are views of the staging buffer: valid until the next ``copy``."""
        layout = tuple((name, t.shape, t.dtype, t.device) for name, t in tensors.items())
        if layout != self._layout:  # the first save (later ones have the same tensors: the views are kept)
            self._views = {}  # the old buffer's views let go first, so a larger one does not sit beside it
            self._views = self._make_views(layout)
            self._layout = layout
        on_host, devices = [], set()
        for name, t in tensors.items():
            if t.device.type == "cuda":  # into pinned memory: queued on the device's current stream
                self._views[name].copy_(t.detach(), non_blocking=True)
                devices.add(t.device)
            else:
                on_host.append(name)
        if on_host and torch.cuda.is_available() and torch.cuda.is_initialized():
            # Host tensors may be the target of a device copy still in flight (HostMomentsAdamW copies its
            # moments back with non_blocking=True): without this the copy could take half-updated moments.
            for index in range(torch.cuda.device_count()):
                torch.cuda.synchronize(index)
        if on_host:  # host to host (CPU training, optimizer moments kept on the host): one batched call
            torch._foreach_copy_([self._views[n] for n in on_host], [tensors[n].detach() for n in on_host])
        for device in devices:  # without it the worker could write (and checksum) the buffer before the copies land
            torch.cuda.synchronize(device)
        return dict(self._views)

    def _make_views(self, layout) -> dict[str, torch.Tensor]:
        offsets, total = [], 0
        for _, shape, dtype, _ in layout:
            nbytes = math.prod(shape) * dtype.itemsize
            offsets.append((total, nbytes))
            total += -(-nbytes // _ALIGN) * _ALIGN
        pinned = any(device.type == "cuda" for *_, device in layout)
        if self._pinned is None or self._pinned.tensor.numel() < total or self._pinned.pinned != pinned:
            self._pinned = None  # the old one is given back before the new one is taken
            self._pinned = PinnedBuffer(total, torch.uint8, pin=pinned)  # its exact size (no power-of-two rounding)
        buf = self._pinned.tensor
        views = {}
        for (name, shape, dtype, _), (start, nbytes) in zip(layout, offsets):
            views[name] = (buf[start:start + nbytes].view(dtype).view(shape) if nbytes
                           else torch.empty(shape, dtype=dtype))
        return views

    def release(self) -> None:
        """Give the buffer back (the run is over)."""
        self._pinned, self._layout, self._views = None, (), {}


class StateWriter:
    """Runs one write at a time on a worker thread and keeps its outcome for the training thread.

    The worker is one thread kept for the store's life (a ThreadPoolExecutor of one): starting a thread per
    save made the training thread wait for the new thread to start (Thread.start's handshake, ~15 ms on a busy
    CPU). Python joins the worker at exit, so an interpreter that ends while a state is written lets it finish.
    """

    def __init__(self, name: str = "lowvram-lora-resume-writer"):
        self.name = name
        self._pool: ThreadPoolExecutor | None = None
        self._running: tuple[int, Future] | None = None
        self._ended: list[SaveOutcome] = []  # ended and not yet handed to the training thread

    @property
    def busy(self) -> bool:
        """A write is still in flight."""
        return self._running is not None and not self._running[1].done()

    def start(self, step: int, write: Callable[[], Path | None]) -> None:
        """Run ``write`` on the worker thread and return at once. A write still in flight is waited for first:
        one at a time (the host copies are reused, and states must land in step order)."""
        self.wait()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name)

        def timed() -> tuple[Path | None, float]:
            t0 = time.perf_counter()
            return write(), time.perf_counter() - t0

        self._running = (step, self._pool.submit(timed))

    def wait(self) -> None:
        """Block until the write in flight (if any) ended; its outcome joins the ended ones."""
        if self._running is None:
            return
        step, future = self._running
        try:
            path, seconds = future.result()
            outcome = SaveOutcome(step, path, None, seconds)
        except BaseException as exc:  # kept for the training thread, never lost with the worker
            exc.add_note(f"(while writing the training state of step {step} on the background writer thread)")
            outcome = SaveOutcome(step, None, exc, 0.0)
        self._running = None
        self._ended.append(outcome)

    def finished(self, wait: bool = False) -> list[SaveOutcome]:
        """The writes that ended since the last call, oldest first (with ``wait``: the one in flight too)."""
        if self._running is not None and (wait or self._running[1].done()):
            self.wait()
        ended, self._ended = self._ended, []
        return ended

    def close(self) -> None:
        """Wait for the write in flight (its outcome is kept for ``finished``) and let the worker thread go."""
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
