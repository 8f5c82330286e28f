"""``VaeSpec``: a family's VAE and how its latents become the transformer's input (``ModelFamily.vae_for``)."""
from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import torch

#: The families package: its ``configs/vae/<name>`` holds the shipped VAE configs for single files.
_FAMILIES = __package__.rpartition(".")[0]


@dataclass(frozen=True)
class VaeSpec:
    """The family's VAE and how its latents become the transformer's input.

    The default is diffusers' ``AutoencoderKL`` with ``(z - shift_factor) * scaling_factor``, as Flux.1,
    Z-Image and Lumina 2 use it (the same Flux AE). A family with another normalisation subclasses it.
    ``single_file_config``: the shipped diffusers config folder (``configs/vae/<name>``) for a single VAE
    file such as ComfyUI's ``ae.safetensors``. ``checkpoint_prefix``: where the family's all-in-one checkpoint
    bundles this VAE (LTX-2.3's ``vae.``; "" none): caching from single files then reads it from the model's
    checkpoint when no VAE file is given, and ``load_file``'s ``read(path, prefix)`` reads only those tensors."""

    class_name: str = "AutoencoderKL"
    single_file_config: str = "flux1"
    checkpoint_prefix: str = ""

    def to_model(self, vae, mean: torch.Tensor) -> torch.Tensor:
        """VAE latent mean -> what the transformer takes."""
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        return (mean - shift) * vae.config.scaling_factor

    def to_vae(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """The inverse of ``to_model``: what ``vae.decode`` takes."""
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        return latents / vae.config.scaling_factor + shift

    def encode(self, vae, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels (B, 3, H, W) in [-1, 1] -> the transformer's latents; the distribution's mean (a
        deterministic cache)."""
        return self.to_model(vae, vae.encode(pixels).latent_dist.mean)

    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """The transformer's latents -> pixels (B, 3, H, W) in about [-1, 1]."""
        return vae.decode(self.to_vae(vae, latents), return_dict=False)[0]

    def load_file(self, path, dtype: torch.dtype, read, companion):
        """The VAE from one single file with BFL/LDM names (ComfyUI's ``ae.safetensors``), through diffusers'
        ``from_single_file`` with the config of ``companion`` (a folder beside the file) or the shipped one.
        ``read(path)``: the file's decoded tensors (the checkpoint reader; unused here, diffusers reads it)."""
        import diffusers

        from ...errors import ModelLoadError

        cls = getattr(diffusers, self.class_name)
        try:
            if (companion / "config.json").exists():
                return cls.from_single_file(str(path), config=str(companion), torch_dtype=dtype, local_files_only=True)
            with resources.as_file(resources.files(_FAMILIES).joinpath("configs", "vae", self.single_file_config)) as cfg:
                return cls.from_single_file(str(path), config=str(cfg), torch_dtype=dtype, local_files_only=True)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ModelLoadError(f"'{path}' is not a {self.class_name} file this loader reads ({exc}); it expects "
                                 f"BFL/LDM names (encoder.down.0.block.0...), as ae.safetensors has") from exc
