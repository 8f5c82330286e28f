"""The optimizers training builds (TrainConfig.optimizer, OffloadConfig.optimizer_on_host), in one place.

- ``adamw``: torch's AdamW, ``fused`` on CUDA: one multi-tensor kernel per step for the ~1000 LoRA
  tensors instead of a foreach kernel per operation (the resident 512² step is CPU-launch-bound).
- ``adamw8bit``: torchao's AdamW8bit (blockwise 8-bit moments) over ONE flat parameter. torchao steps
  each parameter with its own compiled kernel call; over a Flux LoRA's ~1000 tensors that launch
  overhead cost +0.5 s per step on the H100 (bench/NOTES.md). Here the LoRA weights are views into one
  fp32 buffer, their gradients views into another (autograd accumulates into an existing ``.grad``
  in place), so torchao sees one tensor and makes one call.
- ``optimizer_on_host``: AdamW with its moments in pinned host RAM between steps (host_moments.py).
"""
from __future__ import annotations

import torch

from ..config import TrainConfig
from ..errors import ConfigError

#: torchao quantizes a tensor's moments to 8 bit only if its size is a multiple of this (its default
#: block size); the flat buffer is padded to it (the padding stays zero: zero gradient, zero update).
BLOCK = 256


def make_optimizer(params, train: TrainConfig, host_moments: bool = False):
    if host_moments:
        from .host_moments import HostMomentsAdamW

        return HostMomentsAdamW(params, lr=train.learning_rate, weight_decay=train.weight_decay)
    if train.optimizer == "adamw8bit":
        return flat_adamw8bit(params, lr=train.learning_rate, weight_decay=train.weight_decay)
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=train.learning_rate, weight_decay=train.weight_decay,
                             **({"fused": True} if fused else {}))


def flatten_params(params: list[torch.nn.Parameter], multiple: int = 1) -> torch.nn.Parameter:
    """One fp32 parameter whose data and gradient hold every parameter of ``params`` (which become
    views into it, gradients included). ``params`` must share a device and dtype. Each one starts at
    a multiple of ``multiple`` (zero padding between), so no quantization block of the flat buffer
    mixes two tensors: a block-aligned tensor gets exactly the blocks it would get on its own."""
    devices = {(p.device, p.dtype) for p in params}
    if len(devices) != 1:
        raise ConfigError(f"one flat optimizer buffer needs the trainable weights on one device and dtype, got "
                          f"{sorted(str(d) for d in devices)}; use optimizer='adamw'")
    (device, dtype), = devices
    def padded(n: int) -> int:
        return n + (-n % multiple)

    total = sum(padded(p.numel()) for p in params)
    flat = torch.nn.Parameter(torch.zeros(total, device=device, dtype=dtype))
    flat.grad = torch.zeros_like(flat)
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            flat[offset:offset + n].copy_(p.reshape(-1))
            p.data = flat.data[offset:offset + n].view_as(p)
            p.grad = flat.grad[offset:offset + n].view_as(p)
            offset += padded(n)
    return flat


def flat_adamw8bit(params, lr: float, weight_decay: float):
    try:
        from torchao.optim import (
            AdamW8bit,  # blockwise 8-bit moments, from a well-kept library
        )
    except ImportError as exc:
        raise ConfigError(f"optimizer='adamw8bit' needs torchao ({exc}); pip install torchao") from exc

    class FlatAdamW8bit(AdamW8bit):
        """AdamW8bit on the flat buffer; ``zero_grad`` zeroes it in place (the views must stay)."""

        def zero_grad(self, set_to_none: bool = True) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad.zero_()

    return FlatAdamW8bit([flatten_params(list(params), BLOCK)], lr=lr, weight_decay=weight_decay,
                         block_size=BLOCK)


def lora_bytes_per_param(train: TrainConfig) -> float:
    """GPU bytes per LoRA weight: fp32 weight + fp32 gradient + moments, 8 (fp32) or ~2.1 (8-bit with
    block scales)."""
    return 8 + (2.1 if train.optimizer == "adamw8bit" else 8)


def check_optimizer(train: TrainConfig, device: torch.device) -> None:
    if train.optimizer == "adamw8bit" and device.type != "cuda":
        raise ConfigError(
            "optimizer='adamw8bit' saves GPU memory and runs on CUDA only; training runs on "
            f"{device}: use optimizer='adamw'"
        )
