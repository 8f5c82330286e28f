"""Qwen-Image-Edit's reference latents: each control image VAE-encoded as the Edit pipelines do it.

diffusers 0.42.1 ``QwenImageEditPlusPipeline.__call__`` / ``prepare_latents`` / ``_encode_vae_image``:
- each control image is resized (Lanczos, ``VaeImageProcessor``) to about 1024² pixels at its own aspect ratio,
  each side a multiple of 32 (``calculate_dimensions(1024 * 1024, w / h)``), whatever the target's size;
  QwenImageEditPipeline (Edit) does the same to its one image;
- to [-1, 1], one frame (B, 3, 1, H, W), ``vae.encode(...).latent_dist.mode()`` (``sample_mode="argmax"``: the
  mean, deterministic; the T2I training script samples, the Edit pipelines do not);
- normalised per channel: ``(z - latents_mean) / latents_std``.
The result, (1, 16, H/8, W/8) with the frame axis dropped, is what ``model_inputs`` takes as ``control_latents_k``
(packed 2x2 there, as ``prepare_latents`` packs ``image_latents``).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .edit_text import VAE_AREA, calculate_dimensions

from ..specs.controls import CONTROL_KEY, control_embeds  # noqa: F401  (the shared names, kept here for callers)


def control_size(width: int, height: int, area: int = VAE_AREA) -> tuple[int, int]:
    """(width, height) a control image of this size is encoded at: about 1024² (``area``), multiples of 32."""
    return calculate_dimensions(area, width / height)


def control_pixels(image, area: int = VAE_AREA) -> torch.Tensor:
    """A PIL control image -> (1, 3, H, W) in [-1, 1] at ``control_size`` (the pipeline's ``image_processor
    .preprocess(img, vae_height, vae_width)``)."""
    from diffusers.image_processor import VaeImageProcessor

    width, height = control_size(image.width, image.height, area)
    return VaeImageProcessor(vae_scale_factor=16).preprocess(image, height, width)


def encode_control(vae, pixels: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] -> (B, 16, H/8, W/8): the distribution's mode, ``(z - mean) / std`` per channel."""
    param = next(vae.parameters())
    z = vae.encode(pixels.to(param.device, param.dtype)[:, :, None]).latent_dist.mode()
    channels = z.shape[1]
    mean = torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1, 1).to(z.device, z.dtype)
    std = torch.tensor(vae.config.latents_std).view(1, channels, 1, 1, 1).to(z.device, z.dtype)
    return ((z - mean) / std)[:, :, 0]


@torch.no_grad()
def encode_controls(vae, images: Sequence, area: int = VAE_AREA) -> list[torch.Tensor]:
    """Each PIL control image (RGB) -> its (1, 16, h, w) reference latent, in order: ``control_latents_0``, ...
    (``area``: 1024², smaller only in tests on tiny images)."""
    return [encode_control(vae, control_pixels(image, area)) for image in images]

