"""AdamW with its moments in pinned host memory between steps (OffloadConfig.optimizer_on_host).

During forward and backward the GPU holds the fp32 LoRA weights and their gradients only;
the two moments (8 bytes per weight) come in for ``step()``, when the activations are gone,
and go back out after it: one flat pinned buffer per device, one copy each way per step, both
non_blocking on the current stream (host_flat.py, which the adapter's EMA on the host shares).
The step itself is torch's AdamW (foreach) on views of that buffer.

Why not a host-side (CPU) AdamW: it would also move the fp32 weights and gradients every
step and run at CPU memory bandwidth; 8 bytes per weight each way is the least traffic
that gets the moments off the GPU.
"""
from __future__ import annotations

from typing import Optional

import torch

from .host_flat import HostFlat

_MOMENTS = ("exp_avg", "exp_avg_sq")


class HostMomentsAdamW(torch.optim.AdamW):
    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self._store: Optional[HostFlat] = None  # the moments' flat pinned buffers, once the first step made them
        self._slots: list[tuple[torch.nn.Parameter, str]] = []  # (param, moment), in the store's order

    def _moments(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state:
                    for name in _MOMENTS:
                        if name in state:
                            yield p, state, name

    def _to_device(self) -> None:
        if self._store is not None:
            for (p, name), view in zip(self._slots, self._store.to_device()):
                self.state[p][name] = view  # AdamW updates them in place: the device buffer goes back whole

    def _to_host(self) -> None:
        if self._store is None:  # the first step made the moments (or a state was loaded): lay out the buffers
            slots = [(p, name) for p, _, name in self._moments()]
            if not slots or any(self.state[p][name].device.type == "cpu" for p, name in slots):
                return  # parameters on the CPU: nothing to move
            self._slots, self._store = slots, HostFlat([self.state[p][name] for p, name in slots])
        else:
            self._store.to_host()
        for (p, name), view in zip(self._slots, self._store.views):
            self.state[p][name] = view

    @torch.no_grad()
    def step(self, closure=None):
        self._to_device()
        loss = super().step(closure)
        self._to_host()
        return loss

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)  # torch puts the state on each parameter's device
        self._slots, self._store = [], None
        self._to_host()
