"""Dtype and device names used in configs -> torch objects."""
from __future__ import annotations

import torch

from ..errors import ConfigError

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device={name!r} asks for CUDA but torch sees no CUDA device "
            f"(torch {torch.__version__}); use device='cpu' or install a CUDA build of torch"
        )
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on GPUs (half the memory, fast tensor cores); fp32 on CPU, where bf16
    matmuls are slow and tests want exact comparisons."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(f"dtype={name!r} is not one of auto, {', '.join(_DTYPES)}") from None


def release_device_memory(device: torch.device) -> None:
    """After dropping the last reference to a model: collect it and hand its cached CUDA
    blocks back, so the next stage (caching -> training) starts from free VRAM."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
