"""EMA of the adapter weights: ema = decay * ema + (1 - decay) * weight after every optimizer step.

The averages live beside the weights (same device, fp32) and travel with them in the resume state (``named``: saved
and restored as more adapter tensors, under ``ema/`` names), so a resumed run continues them bit for bit. What a run
returns and saves is the average (``swapped``), when on.
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
