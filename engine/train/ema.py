"""EMA of the adapter weights: ema = decay * ema + (1 - decay) * weight after every optimizer step.

The averages live beside the weights (same device, fp32) and travel with them in the resume state (``named``: saved
and restored as more adapter tensors, under ``ema/`` names), so a resumed run continues them bit for bit. A run returns
both: the last weights and their average (``TrainedLora.ema_state_dict``), and Save LoRA writes each as its own file.
Previews draw with the average when LoRA Adapter's ema_previews says so (``applied``).
"""
from __future__ import annotations

import contextlib

import torch


class AdapterEma:
    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], decay: float):
        self.decay = decay
        self.params = [p for _, p in named]
        self.shadow = [p.detach().clone() for p in self.params]  # starts at the initial (or continued) weights
        self.named = [(f"ema/{n}", s) for (n, _), s in zip(named, self.shadow)]

    @torch.no_grad()
    def update(self) -> None:
        # lerp: ema + (1 - decay) * (w - ema), one fused kernel per device for all tensors
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1.0 - self.decay)

    @contextlib.contextmanager
    def swapped(self):
        """The averages in the adapter's parameters for the duration (to read them out as a state dict)."""
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
        with torch.no_grad():
            kept = [p.detach().clone() for p in self.params]
            torch._foreach_copy_([p.data for p in self.params], self.shadow)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], kept)
