"""Latents -> PIL images (or a clip's frames): the VAE on the GPU for the decode only, tiled."""
from __future__ import annotations

import torch


@torch.no_grad()
def decode_latents(vae, family, latents: list[torch.Tensor], device: torch.device, variant: str | None = None):
    """Latents -> PIL images: the VAE of ``variant`` (``family.vae_for``) on ``device`` for the decode only, tiled.
    An image family's latents give one PIL image each; a video family's clip (its decode is (B, 3, F, H, W)) gives
    the list of its F frames (one frame for a one-frame clip)."""
    spec = family.vae_for(variant)
    from PIL import Image

    from ..models.dtypes import release_device_memory

    def pil(frame: torch.Tensor):  # (3, H, W) in [-1, 1]
        arr = ((frame.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
        return Image.fromarray(arr)

    home = next(vae.parameters()).device
    vae.to(device)
    vae.enable_tiling()
    if hasattr(vae, "tile_sample_min_size"):
        # Flux's VAE config says sample_size 1024, so diffusers would decode a 1024² image as one tile (measured:
        # the sampling peak went 0.2 GB above the training peak at 1024²); 256-pixel tiles bound it.
        factor = 2 ** (len(vae.config.block_out_channels) - 1)
        vae.tile_sample_min_size, vae.tile_latent_min_size = 256, 256 // factor
    images = []
    try:
        for lat in latents:
            dtype = next(vae.parameters()).dtype
            img = spec.decode(vae, lat.to(device, dtype))
            images.append([pil(img[0, :, f]) for f in range(img.shape[2])] if img.dim() == 5 else pil(img[0]))
    finally:
        vae.to(home)
        release_device_memory(device)
    return images
