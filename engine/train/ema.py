"""EMA of the adapter weights: ema = decay * ema + (1 - decay) * weight after every optimizer step.

The averages (fp32, 4 bytes per adapter weight) live beside the weights on their device, or with ``on_host`` in pinned
host memory between steps, where the plan keeps the AdamW moments (engine/offload/plan.py counts them in VRAM or host
RAM: one rule, optimizer_on_host): one flat buffer per device comes in after the optimizer step, the lerp runs on the
device as it would with the averages there (the same values, bit for bit), and it goes back out, non_blocking
(host_flat.py, the moments' pattern). They travel with the weights in the resume state (``named``: saved and restored
as more adapter tensors, under ``ema/`` names, in place), so a resumed run continues them bit for bit. A run returns
both: the last weights and their average (``TrainedLora.ema_state_dict``), and Save LoRA writes each as its own file.
Previews draw with the average when LoRA Adapter's ema_previews says so (``applied``).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .host_flat import HostFlat


class AdapterEma:
    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], decay: float, on_host: bool = False):
        self.decay = decay
        self.params = [p for _, p in named]
        # starts at the initial (or continued) weights
        self.host: Optional[HostFlat] = HostFlat(self.params) if on_host else None
        self.shadow = self.host.views if on_host else [p.detach().clone() for p in self.params]
        self.named = [(f"ema/{n}", s) for (n, _), s in zip(named, self.shadow)]

    @property
    def on_host(self) -> bool:
        return self.host is not None

    @torch.no_grad()
    def update(self) -> None:
        # lerp: ema + (1 - decay) * (w - ema), one fused kernel per device for all tensors
        weights = [p.detach() for p in self.params]
        if self.host is None:
            torch._foreach_lerp_(self.shadow, weights, 1.0 - self.decay)
            return
        torch._foreach_lerp_(self.host.to_device(), weights, 1.0 - self.decay)
        self.host.to_host()

    @contextlib.contextmanager
    def swapped(self):
        """The averages in the adapter's parameters for the duration (to read them out as a state dict)."""
        if self.host is not None:
            self.host.wait()  # the last update's copy out has landed
        kept = [p.data for p in self.params]
        for p, s in zip(self.params, self.shadow):
            p.data = s
        try:
            yield
        finally:
            for p, k in zip(self.params, kept):
                p.data = k

    @contextlib.contextmanager
    def applied(self):
        """The averages copied into the adapter's parameters for the duration (previews), the weights copied back
        after: the parameters keep their storage, so compiled blocks and anything holding them see no new tensor;
        the copy back is exact, so training goes on bit for bit as without the previews."""
        if self.host is not None:
            self.host.wait()  # the last update's copy out has landed (a preview may draw on another stream)
        with torch.no_grad():
            kept = [p.detach().clone() for p in self.params]
            torch._foreach_copy_([p.data for p in self.params], self.shadow)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], kept)
