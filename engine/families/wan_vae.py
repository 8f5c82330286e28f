"""The Wan 2.1 causal 3-D VAE as a family's latent space: ``WanVaeSpec``.

Qwen-Image's ``AutoencoderKLQwenImage`` and Wan 2.1's ``AutoencoderKLWan`` are one architecture (identical
state-dict names and shapes, new-families-facts §2.5) with one normalisation: per channel
``(z - latents_mean) / latents_std`` from the VAE's config (diffusers' pipelines and training scripts;
ComfyUI's ``latent_formats.Wan21``). An image is one frame: (B, 3, H, W) is encoded as (B, 3, 1, H, W),
and the frame axis is dropped again for families that cache images as (C, H/8, W/8); video keeps it.

ComfyUI keeps the VAE (``qwen_image_vae.safetensors``, ``wan_2.1_vae.safetensors``) under the original Wan
names (``encoder.conv1``, ``decoder.upsamples.N``, ``encoder.middle.0.residual.0.gamma``); diffusers' own
``convert_wan_vae_to_diffusers`` maps them, applied here to the tensors the one checkpoint reader decoded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

import torch

from .specs import VaeSpec


@dataclass(frozen=True)
class WanVaeSpec(VaeSpec):
    class_name: str = "AutoencoderKLWan"
    #: The package whose ``configs/vae/<single_file_config>/config.json`` describes a single file's VAE (the
    #: family's folder: ``type(self).__module__`` of the family that builds the spec).
    config_package: str = __package__
    single_file_config: str = "wan2_1"  # a folder name: no dots (it is a package)
    #: Latents keep their frame axis, an image being one frame (B, C, 1, h, w): video families (Wan). Image
    #: families (Qwen-Image) drop it for images and cache (C, h, w).
    video: bool = False

    @staticmethod
    def _stats(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, vae.config.z_dim) + (1,) * (like.dim() - 2)
        mean = torch.tensor(vae.config.latents_mean, dtype=like.dtype, device=like.device).view(shape)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std, dtype=like.dtype, device=like.device).view(shape)
        return mean, inv_std

    def to_model(self, vae, mean: torch.Tensor) -> torch.Tensor:
        """VAE latent mean -> ``(z - latents_mean) * (1 / latents_std)``, as the pipelines write it."""
        m, inv_std = self._stats(vae, mean)
        return (mean - m) * inv_std

    def to_vae(self, vae, latents: torch.Tensor) -> torch.Tensor:
        m, inv_std = self._stats(vae, latents)
        return latents / inv_std + m

    def encode(self, vae, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) images (one frame each) or (B, 3, F, H, W) clips -> normalised latents, (B, C, h, w) or
        (B, C, F', h, w); images as (B, C, 1, h, w) for a ``video`` spec."""
        image = pixels.dim() == 4
        mean = vae.encode(pixels.unsqueeze(2) if image else pixels).latent_dist.mean
        out = self.to_model(vae, mean)
        return out.squeeze(2) if image and not self.video else out

    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> (B, 3, H, W) for an image (the one frame), (B, 3, F, H, W) for a clip."""
        image = latents.dim() == 4
        out = vae.decode(self.to_vae(vae, latents.unsqueeze(2) if image else latents), return_dict=False)[0]
        return out[:, :, 0] if image else out

    def config(self, companion) -> dict:
        """The single file's VAE config: ``config.json`` beside it (its companion folder), else the shipped one."""
        if (companion / "config.json").exists():
            return json.loads((companion / "config.json").read_text())
        ref = resources.files(self.config_package).joinpath("configs", "vae", self.single_file_config, "config.json")
        return json.loads(ref.read_text())

    def convert_original(self, state: dict) -> dict:
        """Original Wan names -> diffusers': diffusers' own ``convert_wan_vae_to_diffusers`` (the Wan 2.1 layout)."""
        from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

        return convert_wan_vae_to_diffusers(state)

    def load_file(self, path, dtype: torch.dtype, read, companion):
        """The VAE from one file with the original Wan names (ComfyUI's) or diffusers' names, decoded by the
        checkpoint reader (``read``) and renamed by ``convert_original``."""
        import diffusers
        from accelerate import init_empty_weights
        from ..errors import ModelLoadError

        state = read(path)
        if "encoder.conv1.weight" in state:  # the original names
            state = self.convert_original(state)
        elif "encoder.conv_in.weight" not in state:
            raise ModelLoadError(f"'{path}' is not a Wan-2.1-type VAE file (no encoder.conv1 or encoder.conv_in); "
                                 f"{self.class_name} needs the VAE that comes with the model (e.g. qwen_image_vae."
                                 f"safetensors, wan_2.1_vae.safetensors)")
        cls = getattr(diffusers, self.class_name)
        config = {k: v for k, v in self.config(companion).items() if not k.startswith("_")}
        with init_empty_weights():
            vae = cls.from_config(config)
        try:
            vae.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
        except RuntimeError as exc:
            raise ModelLoadError(f"'{path}' does not fit {self.class_name}'s config ({str(exc)[:300]}); is it the "
                                 f"VAE of this model?") from exc
        return vae.to(dtype)
