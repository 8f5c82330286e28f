"""Which fused attention kernels ``scaled_dot_product_attention`` may pick: one policy for training and one for
forwards without a backward (sampling), so both are decided here.

cuDNN's SDPA backward fails under gradient checkpointing on torch 2.11 + H100 (an illegal memory access), so a
training step runs with flash / memory-efficient / math only. Its forward is fine, and on the H100 it is the fastest
(Flux.1-dev 1024², 4 rows: 1.6 ms per attention call against 3.0 ms for flash; bench/NOTES.md, issue 26), so a
forward without backward may use every backend in torch's own order of preference, as an inference pipeline would.
Both are scoped (context managers), never process-wide flags."""
from __future__ import annotations

import contextlib

import torch


def training_attention(device: torch.device):
    """The backends of a training step: cuDNN's left out (its backward fails under gradient checkpointing)."""
    return _backends(device, "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def forward_attention(device: torch.device):
    """The backends of a forward without backward (sampling): all of them, torch's default priority (which puts
    cuDNN first where it is fastest), also inside a training step's scope, which left cuDNN out."""
    return _backends(device, "CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def _backends(device: torch.device, *names: str):
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, n) for n in names])
