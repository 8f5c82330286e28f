"""AdamW with its moments in pinned host memory between steps (OffloadConfig.optimizer_on_host).

During forward and backward the GPU holds the fp32 LoRA weights and their gradients only;
the two moments (8 bytes per weight) come in for ``step()``, when the activations are gone,
and go back out after it. All moments of a device live in ONE flat pinned buffer, so a step
costs one copy in and one copy out (a per-tensor copy of ~2000 moment tensors was measured
at +0.08 s per step on the H100, mostly launch time); both are issued on the current stream,
so they are ordered with the step's kernels without a host synchronisation, and the GPU
buffer is freed as soon as the copy-out is enqueued (the caching allocator reuses memory in
stream order). The step itself is torch's AdamW (foreach) on views of that buffer.

Why not a host-side (CPU) AdamW: it would also move the fp32 weights and gradients every
step and run at CPU memory bandwidth; 8 bytes per weight each way is the least traffic
that gets the moments off the GPU.
"""
from __future__ import annotations

import torch

_MOMENTS = ("exp_avg", "exp_avg_sq")


class HostMomentsAdamW(torch.optim.AdamW):
    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self._flat: dict[torch.device, torch.Tensor] = {}  # device -> pinned fp32 buffer of its moments
        self._slots: list[tuple[torch.nn.Parameter, str, int, int]] = []  # (param, moment, offset, numel)
        self._gpu: dict[torch.device, torch.Tensor] = {}  # during a step: the flat buffer on the device

    def _moments(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state:
                    for name in _MOMENTS:
                        if name in state:
                            yield p, state, name

    def _to_device(self) -> None:
        for device, host in self._flat.items():
            gpu = self._gpu[device] = host.to(device, non_blocking=True)
            for p, name, offset, n in self._slots:
                if p.device == device:
                    self.state[p][name] = gpu[offset:offset + n].view_as(p)

    def _to_host(self) -> None:
        if not self._slots:  # the first step made the moments: lay out one flat buffer per device
            sizes: dict[torch.device, int] = {}
            for p, state, name in self._moments():
                if state[name].device.type == "cpu":
                    return  # parameters on the CPU: nothing to move
                self._slots.append((p, name, sizes.get(p.device, 0), p.numel()))
                sizes[p.device] = sizes.get(p.device, 0) + p.numel()
            self._flat = {d: torch.empty(n, dtype=torch.float32, pin_memory=True) for d, n in sizes.items()}
        for device, host in self._flat.items():
            mine = [(p, name, o, n) for p, name, o, n in self._slots if p.device == device]
            gpu = self._gpu.pop(device, None)  # the moments are views of it (AdamW updates in place)
            if gpu is None:  # the first step: AdamW made each moment on its own
                gpu = torch.cat([self.state[p][name].reshape(-1).float() for p, name, _, _ in mine])
            host.copy_(gpu, non_blocking=True)
            for p, name, offset, n in mine:
                self.state[p][name] = host[offset:offset + n].view_as(p)

    @torch.no_grad()
    def step(self, closure=None):
        self._to_device()
        loss = super().step(closure)
        self._to_host()
        return loss

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)  # torch puts the state on each parameter's device
        self._slots, self._flat = [], {}
        self._to_host()
