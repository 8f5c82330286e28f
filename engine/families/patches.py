"""2x2 latent patches as tokens, and the resolution-dependent timestep shift, shared by the families whose
pipelines use them (Flux.1's ``_pack_latents`` and Qwen-Image's are the same code; so is their
``calculate_shift``, with each family's own constants)."""
from __future__ import annotations

import torch


def pack_2x2(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): each 2x2 patch becomes a token, channels outermost
    (``FluxPipeline._pack_latents``, ``QwenImagePipeline._pack_latents``)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2)
    x = x.permute(0, 2, 4, 1, 3, 5)  # (B, H/2, W/2, C, 2, 2)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of ``pack_2x2`` for latent height ``h`` and width ``w``."""
    b, _, c4 = tokens.shape
    c = c4 // 4
    x = tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def linear_mu(seq_len: int, base_len: int, max_len: int, base_shift: float, max_shift: float) -> float:
    """The pipelines' ``calculate_shift``: mu linear in the image token count, ``base_shift`` at ``base_len``
    tokens and ``max_shift`` at ``max_len``."""
    slope = (max_shift - base_shift) / (max_len - base_len)
    return seq_len * slope + (base_shift - slope * base_len)
