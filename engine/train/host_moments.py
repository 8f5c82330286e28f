"""AdamW with its moments in pinned host memory between steps (OffloadConfig.optimizer_on_host).

During forward and backward the GPU holds the fp32 LoRA weights and their gradients only;
the two moments (8 bytes per weight) come in for ``step()``, when the activations are gone,
and go back out after it. Both copies are issued on the current stream from pinned buffers,
so they are ordered with the step's kernels without a host synchronisation, and the GPU
copies are freed as soon as the copy-out is enqueued (the caching allocator reuses memory
in stream order). Measured cost: see bench/RESULTS.md (bench_memory.py, '-host' rows).

Why not a host-side (CPU) AdamW: it would also move the fp32 weights and gradients every
step and run at CPU memory bandwidth; copying 8 bytes per weight each way is the least
traffic that gets the moments off the GPU.
"""
from __future__ import annotations

import torch

_MOMENTS = ("exp_avg", "exp_avg_sq")


class HostMomentsAdamW(torch.optim.AdamW):
    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self._host: dict[tuple[int, str], torch.Tensor] = {}

    def _each_moment(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state:
                    for name in _MOMENTS:
                        if name in state:
                            yield p, state, name

    def _to_device(self) -> None:
        for p, state, name in self._each_moment():
            if state[name].device != p.device:
                state[name] = state[name].to(p.device, non_blocking=True)

    def _to_host(self) -> None:
        for p, state, name in self._each_moment():
            t = state[name]
            if t.device.type == "cpu":
                continue
            key = (id(p), name)
            host = self._host.get(key)
            if host is None or host.shape != t.shape or host.dtype != t.dtype:
                host = self._host[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            state[name] = host

    @torch.no_grad()
    def step(self, closure=None):
        self._to_device()
        loss = super().step(closure)
        self._to_host()
        return loss

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)  # torch puts the state on each parameter's device
        self._to_host()
