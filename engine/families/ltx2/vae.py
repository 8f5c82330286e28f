"""LTX-2's video VAE as a latent space: diffusers' ``AutoencoderKLLTX2Video`` (128 channels, 32x spatial, 8x temporal,
causal encoder: frames 8k + 1), normalised per channel ``(z - latents_mean) * scaling_factor / latents_std`` with the
VAE's own ``latents_mean`` / ``latents_std`` buffers (the checkpoint's ``per_channel_statistics``; diffusers'
``LTX2Pipeline._normalize_latents``). An image is a one-frame clip (B, C, 1, h, w).

Single files: the video VAE bundled in ``ltx-2.3-22b-dev.safetensors`` (``vae.*``) has a 2.3-specific architecture
(block widths (256, 512, 1024, 1024) and its own decoder; facts §2.4) whose diffusers config is not shipped here;
such a file is refused by name and the VAE is read from a diffusers folder's ``vae/``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import ModelLoadError
from ..specs import VaeSpec


@dataclass(frozen=True)
class Ltx2VaeSpec(VaeSpec):
    class_name: str = "AutoencoderKLLTX2Video"

    @staticmethod
    def _stats(vae, like: torch.Tensor):
        shape = (1, -1) + (1,) * (like.dim() - 2)
        mean = vae.latents_mean.view(shape).to(like.device, like.dtype)
        std = vae.latents_std.view(shape).to(like.device, like.dtype)
        return mean, std / float(vae.config.scaling_factor)

    def to_model(self, vae, mean: torch.Tensor) -> torch.Tensor:
        m, s = self._stats(vae, mean)
        return (mean - m) / s

    def to_vae(self, vae, latents: torch.Tensor) -> torch.Tensor:
        m, s = self._stats(vae, latents)
        return latents * s + m

    def encode(self, vae, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) images or (B, 3, F, H, W) clips in [-1, 1] -> normalised latents (B, C, F', h, w); the
        distribution's mode (the pipelines' ``argmax``)."""
        clip = pixels.unsqueeze(2) if pixels.dim() == 4 else pixels
        return self.to_model(vae, vae.encode(clip).latent_dist.mode())

    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """Latents (B, C, F', h, w) -> pixels (B, 3, F, H, W) (an image's one frame: (B, 3, H, W))."""
        image = latents.dim() == 4
        out = vae.decode(self.to_vae(vae, latents.unsqueeze(2) if image else latents), return_dict=False)[0]
        return out[:, :, 0] if image else out

    def load_file(self, path, dtype: torch.dtype, read, companion):
        raise ModelLoadError(f"'{path}': LTX-2's video VAE is read from a diffusers folder (its vae/ with "
                             f"config.json); the VAE bundled in ltx-2.3-22b-dev.safetensors or "
                             f"ltx-2.5-video-vae-bf16.safetensors is not decoded here yet. Give Cache Text Embeds "
                             f"the diffusers pipeline folder instead of a VAE file")


LTX2_VAE = Ltx2VaeSpec()
