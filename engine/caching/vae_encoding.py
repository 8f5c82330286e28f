"""Images -> VAE latents, one image at a time, tiled for large images."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import torch

from ..errors import ModelLoadError, safetensors_only_message
from ..models.dtypes import release_device_memory


def load_vae(pipeline: Path, dtype: torch.dtype, class_name: str = "AutoencoderKL"):
    import diffusers

    folder = pipeline / "vae"
    if not (folder / "config.json").exists():
        raise ModelLoadError(f"VAE folder '{folder}' is missing; caching needs a diffusers pipeline folder with vae/")
    try:  # use_safetensors: a pickle .bin is never loaded
        vae = getattr(diffusers, class_name).from_pretrained(folder, torch_dtype=dtype, local_files_only=True,
                                                             use_safetensors=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(safetensors_only_message(folder, "VAE", exc)) from None
    return vae.requires_grad_(False).eval()


@torch.no_grad()
def encode_images(
    pipeline: Path | None,
    family,
    images: Iterable[torch.Tensor],
    count: int,
    device: torch.device,
    dtype: torch.dtype,
    progress: Callable[[int, int], None] | None = None,
    vae_loader: Callable[[], torch.nn.Module] | None = None,
    variant: str | None = None,
    condition=None,
    conditions: list | None = None,
) -> list[torch.Tensor]:
    """(3, H, W) images, or (3, F, H, W) clips for a video VAE, in [-1, 1] -> latents as the family's transformer
    takes them (``family.vae_for(variant).encode``: Flux.1 shifted and scaled, Flux.2 patchified and normalised, the
    Wan VAEs (Qwen-Image, Wan) normalised per channel on one frame or on (1, C, F_lat, h, w)).
    We keep the distribution's mean (a deterministic cache). ``variant``: whose VAE (``family.vae_for``).
    ``condition`` (an image-to-video variant's ``FirstFrameCondition``): each item's first-frame conditioning from
    the same loaded VAE, appended to ``conditions`` ({name: tensor without the batch axis}, fp32 on the CPU)."""
    spec = family.vae_for(variant)
    vae = (vae_loader() if vae_loader is not None else load_vae(pipeline, dtype, spec.class_name)).to(device)
    # Tiling bounds VRAM for big images (decoder/encoder activations dominate the VAE).
    vae.enable_tiling()
    latents = []
    try:
        for i, image in enumerate(images):
            pixels = image[None].to(device, dtype)
            latents.append(spec.encode(vae, pixels)[0].float().cpu())
            if condition is not None:
                conditions.append({k: v[0].float().cpu() for k, v in condition.encode_latents(vae, pixels).items()})
            if progress:
                progress(i + 1, count)
    finally:
        del vae
        release_device_memory(device)
    return latents
