"""Training state that waits in pinned host memory between steps and comes to its device only to be updated:
AdamW's moments with optimizer_on_host (host_moments.py) and the adapter's EMA beside them (ema.py).

The tensors of each device live in ONE flat fp32 buffer (pinned when the device is a GPU), so a step costs one copy
in and one copy out per device (a per-tensor copy of ~2000 moment tensors was measured at +0.08 s per step on the
H100, mostly launch time). Both copies are issued with non_blocking=True on the device's current stream: they are
ordered with the update's kernels without a host synchronisation, and the device buffer is given back as soon as
the copy out is enqueued (the caching allocator reuses memory in stream order). A reader of the host views on the
host (a state save, a state dict) waits for that copy first (``wait``).
"""
from __future__ import annotations

import weakref

import torch

from ..offload.host import PinnedBuffer


def _wait_for(done: dict) -> None:
    for event in list(done.values()):
        event.synchronize()


def _wait_quietly(done: dict) -> None:
    try:
        _wait_for(done)
    except Exception:  # interpreter shutdown: the driver is going away anyway
        pass


class HostFlat:
    """``tensors`` (fp32 values, any devices) copied into flat host buffers, one per device; ``views``: the host
    tensors, in the order given, each shaped as its source."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.devices = [t.device for t in tensors]
        self.slots: list[tuple[int, int]] = []  # (offset, numel) of each tensor in its device's buffer
        sizes: dict[torch.device, int] = {}
        for t in tensors:
            self.slots.append((sizes.get(t.device, 0), t.numel()))
            sizes[t.device] = sizes.get(t.device, 0) + t.numel()
        # Pinned at their exact size (torch's pinned allocator rounds up to a power of two); kept while this lives.
        self._pinned = {d: PinnedBuffer(n, torch.float32, pin=d.type == "cuda") for d, n in sizes.items()}
        self.flat = {d: b.tensor for d, b in self._pinned.items()}
        self.shapes = [t.shape for t in tensors]
        self.views = self._views(self.flat)
        self._work: dict[torch.device, torch.Tensor] = {}  # between to_device and to_host: the buffers on the device
        self._done: dict[torch.device, torch.cuda.Event] = {}  # the last copy out of each GPU
        # However this is dropped (a run ending in an error, a state loaded over it), the last copies out land before
        # the buffers are unregistered: this finalizer runs before the PinnedBuffers it owns go.
        weakref.finalize(self, _wait_quietly, self._done)
        for device in self.flat:  # the values in: one cat and one copy per device
            self._work[device] = torch.cat([t.detach().reshape(-1).float()
                                            for t, d in zip(tensors, self.devices) if d == device])
        self.to_host()

    def _views(self, flat: dict) -> list[torch.Tensor]:
        return [flat[d][o:o + n].view(s) for d, (o, n), s in zip(self.devices, self.slots, self.shapes)]

    def to_device(self) -> list[torch.Tensor]:
        """The values on their devices (one copy in per device), as views of one buffer there, in order: updated in
        place, then ``to_host``. On the CPU the buffer is a copy too, so the same code runs there."""
        self._work = {d: torch.empty(host.numel(), dtype=host.dtype, device=d).copy_(host, non_blocking=True)
                      for d, host in self.flat.items()}
        return self._views(self._work)

    def to_host(self) -> None:
        """The device buffers back into the host views (one copy out per device, not waited for) and let go."""
        for device, work in self._work.items():
            self.flat[device].copy_(work, non_blocking=True)
            if device.type == "cuda":
                self._done[device] = torch.cuda.Event()
                self._done[device].record(torch.cuda.current_stream(device))
        self._work = {}

    def wait(self) -> None:
        """Until the last copies out have landed: the host views hold the values (before the host reads them)."""
        _wait_for(self._done)
