"""The large layers outside the blocks, held in pinned host memory between their runs (``outer_on_host``).

Some models keep big Linears outside their blocks: Flux.2-dev's global modulation (three projections of the time
embedding, 566 M parameters) and its text embedder (94 M), 0.66 GB in int8; Wan's time and text embedders. The
family lists them (``int8_extra_linears``). Each runs once per forward, on inputs that carry no gradient (the
time embedding, the cached text), before the blocks; during the backward, where the step's memory peaks, nothing
reads them. Resident, they sit on the GPU all step anyway.

Held, each module's frozen tensors live in one pinned host buffer (``HostBlock``, the streamed blocks' layout: one
copy per module). Its forward pre-hook copies the buffer to a fresh GPU buffer on the compute stream (ordered with
the work that uses it; a copy of 0.66 GB is ~12 ms at 55 GB/s) and points the tensors there; its forward hook points
them back at the host buffer, and the GPU buffer returns to the caching allocator once the kernels queued on that
stream have used it. A module whose output needs a gradient (a LoRA or a trained layer before it) would have its
weights read again in the backward, so holding it is refused with a message instead of computing a wrong gradient.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .hooks import HookRegistry, ModelHook
from .host import HostBlock

#: The name of the hook on each held module.
OUTER_HOOK = "outer_on_host"


class HeldModule(ModelHook):
    """One held module: on the GPU only while its forward runs."""

    def __init__(self, name: str, module: nn.Module, device: torch.device, pin: bool):
        self.name, self.device = name, device
        self.host, self.reused = HostBlock.for_block(module, name, pin=pin)
        self.copies = 0

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        gpu = torch.empty(self.host.nbytes, dtype=torch.uint8, device=self.device)
        gpu.copy_(self.host.buffer, non_blocking=self.host.pinned)
        self.host.bind(gpu)
        self.copies += 1
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        self.host.bind_host()  # the GPU buffer is freed on its stream, after the kernels that read it
        if torch.is_grad_enabled() and any(isinstance(o, torch.Tensor) and o.requires_grad
                                           for o in (output if isinstance(output, (tuple, list)) else (output,))):
            raise ConfigError(
                f"{self.name} runs on inputs that carry a gradient here (a LoRA or a trained layer before it), so "
                f"the backward reads its weights again: it cannot wait on the host. Set outer_on_host=False in "
                f"Offload Config")
        return output


class HeldOuter:
    """Every held module of one model, and how to stop holding them (tensors stay bound to their host buffers,
    as streamed blocks do after ``OffloadHandle.remove``)."""

    def __init__(self, modules: list[tuple[str, nn.Module]], device: torch.device, pin: bool):
        self.hooks: list[tuple[nn.Module, HeldModule]] = []
        for name, module in modules:
            hook = HeldModule(name, module, device, pin)
            HookRegistry.of(module).register(OUTER_HOOK, hook)
            self.hooks.append((module, hook))

    @property
    def nbytes(self) -> int:
        return sum(h.host.nbytes for _, h in self.hooks)

    def remove(self) -> None:
        for module, _ in self.hooks:
            HookRegistry.of(module).remove(OUTER_HOOK)
        self.hooks.clear()
