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

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

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
        self._buffer: torch.Tensor | None = None

    def copy(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Contiguous host copies of ``tensors`` (same dtypes and shapes), complete when this returns. The
        copies are views of the staging buffer: valid until the next ``copy``."""
        layout, offset = [], 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            layout.append((name, t, offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        devices = {t.device for t in tensors.values() if t.device.type == "cuda"}
        buffer = self._buffer_of(offset, pinned=bool(devices))
        out = {}
        for name, t, start, nbytes in layout:
            if nbytes == 0:
                out[name] = torch.empty(t.shape, dtype=t.dtype)
                continue
            dst = buffer[start:start + nbytes].view(t.dtype).view(t.shape)
            dst.copy_(t.detach(), non_blocking=True)  # from CUDA into pinned memory: queued, not waited for
            out[name] = dst
        for device in devices:  # the copies were queued on each device's current stream
            torch.cuda.synchronize(device)
        return out

    def _buffer_of(self, nbytes: int, pinned: bool) -> torch.Tensor:
        buf = self._buffer
        if buf is None or buf.numel() < nbytes or buf.is_pinned() != pinned:
            self._buffer = None  # the old one is given back before the new one is taken
            buf = self._buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
        return buf

    def release(self) -> None:
        """Give the buffer back (the run is over)."""
        self._buffer = None


class StateWriter:
    """Runs one write at a time on a worker thread and keeps its outcome for the training thread."""

    def __init__(self, name: str = "lowvram-lora resume writer"):
        self.name = name
        self._thread: threading.Thread | None = None
        self._running: SaveOutcome | None = None  # filled by the worker when its write ends
        self._ended: list[SaveOutcome] = []  # ended and not yet handed to the training thread

    @property
    def busy(self) -> bool:
        """A write is still in flight."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, step: int, write: Callable[[], Path | None]) -> None:
        """Run ``write`` on a worker thread and return at once. A write still in flight is waited for first:
        one at a time (the host copies are reused, and states must land in step order)."""
        self.wait()
        outcome = SaveOutcome(step, None, None, 0.0)

        def work() -> None:
            t0 = time.perf_counter()
            try:
                outcome.path = write()
            except BaseException as exc:  # kept for the training thread, never lost with the worker
                exc.add_note(f"(while writing the training state of step {step} on the background writer thread)")
                outcome.error = exc
            outcome.seconds = time.perf_counter() - t0

        self._running = outcome
        # Not a daemon: an interpreter that exits while a state is being written lets it finish first.
        self._thread = threading.Thread(target=work, name=self.name, daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Block until the write in flight (if any) ended; its outcome joins the ended ones."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        self._ended.append(self._running)
        self._running = None

    def finished(self, wait: bool = False) -> list[SaveOutcome]:
        """The writes that ended since the last call, oldest first (with ``wait``: the one in flight too)."""
        if self._thread is not None and (wait or not self._thread.is_alive()):
            self.wait()
        ended, self._ended = self._ended, []
        return ended
