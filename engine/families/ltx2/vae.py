"""LTX-2's video VAE as a latent space: diffusers' ``AutoencoderKLLTX2Video`` (128 channels, 32x spatial, 8x temporal,
causal encoder: frames 8k + 1), normalised per channel ``(z - latents_mean) * scaling_factor / latents_std`` with the
VAE's own ``latents_mean`` / ``latents_std`` buffers (the checkpoint's ``per_channel_statistics``; diffusers'
``LTX2Pipeline._normalize_latents``). An image is a one-frame clip (B, C, 1, h, w).

Single files: the video VAE bundled in ComfyUI's all-in-one ``ltx-2.3-22b-dev(-fp8).safetensors`` under ``vae.``
(``checkpoint_prefix``), in Lightricks' original names: LTX-2.3's architecture (block widths (256, 512, 1024, 1024),
a 4-level decoder; facts §2.4) with diffusers' converter config (``configs/vae/ltx2.3.json``, from
``get_ltx2_video_vae_config("2.3")``), renamed by diffusers' ``LTX_2_3_VIDEO_VAE_RENAME_DICT`` (``_RENAMES``; diffusers'
``single_file_utils.convert_ltx2_vae_to_diffusers`` has only 2.0's rules: no ``up_blocks.7`` / ``.8`` of 2.3's fourth
decoder level). Caching from single files takes it from the model's checkpoint when no VAE file is given
(``engine/caching/single_files.sources_for``). LTX-2.5's separate ``ltx-2.5-video-vae-bf16.safetensors`` is not read yet
(refused by name).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

import torch

from ...errors import ModelLoadError
from ..specs import VaeSpec

#: Original -> diffusers, applied in this order (diffusers' ``LTX_2_3_VIDEO_VAE_RENAME_DICT``: the encoder's
#: resnet / downsampler levels interleaved as down_blocks.0-7 and its mid block as 8; the decoder's mid block as
#: up_blocks.0, then upsampler / resnet pairs).
_RENAMES = (
    ("down_blocks.0", "down_blocks.0"), ("down_blocks.1", "down_blocks.0.downsamplers.0"),
    ("down_blocks.2", "down_blocks.1"), ("down_blocks.3", "down_blocks.1.downsamplers.0"),
    ("down_blocks.4", "down_blocks.2"), ("down_blocks.5", "down_blocks.2.downsamplers.0"),
    ("down_blocks.6", "down_blocks.3"), ("down_blocks.7", "down_blocks.3.downsamplers.0"),
    ("down_blocks.8", "mid_block"),
    ("up_blocks.0", "mid_block"), ("up_blocks.1", "up_blocks.0.upsamplers.0"), ("up_blocks.2", "up_blocks.0"),
    ("up_blocks.3", "up_blocks.1.upsamplers.0"), ("up_blocks.4", "up_blocks.1"),
    ("up_blocks.5", "up_blocks.2.upsamplers.0"), ("up_blocks.6", "up_blocks.2"),
    ("last_time_embedder", "time_embedder"), ("last_scale_shift_table", "scale_shift_table"),
    ("res_blocks", "resnets"),
    ("per_channel_statistics.mean-of-means", "latents_mean"), ("per_channel_statistics.std-of-means", "latents_std"),
    ("up_blocks.7", "up_blocks.3.upsamplers.0"), ("up_blocks.8", "up_blocks.3"),
)
#: Where the all-in-one checkpoint keeps the video VAE.
VAE_PREFIX = "vae."


def diffusers_vae_state(original: dict) -> dict:
    """A video VAE's tensors under Lightricks' names (without ``vae.``) -> ``AutoencoderKLLTX2Video``'s. The
    statistics the model does not hold (``channel``, ``mean-of-stds``, ...) are dropped, as diffusers does."""
    out = {}
    for key, value in original.items():
        name = key
        for old, new in _RENAMES:
            name = name.replace(old, new)
        if not name.startswith("per_channel_statistics."):
            out[name] = value
    return out


@dataclass(frozen=True)
class Ltx2VaeSpec(VaeSpec):
    class_name: str = "AutoencoderKLLTX2Video"
    #: ``configs/vae/<name>.json``: the VAE's diffusers config for a single file ("" : none read yet, LTX-2.5).
    single_file_config: str = "ltx2.3"
    checkpoint_prefix: str = VAE_PREFIX

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
        """The video VAE bundled in the all-in-one checkpoint (``vae.`` + Lightricks' names), read through the
        checkpoint reader (``read(path, prefix)``: only those tensors), renamed (``diffusers_vae_state``) and loaded
        strictly into ``AutoencoderKLLTX2Video`` of the companion folder's config.json or the shipped one. The
        decoder's timestep conditioning (distilled checkpoints) is read off the file's tensors."""
        import diffusers
        from accelerate import init_empty_weights

        if not self.single_file_config:
            raise ModelLoadError(f"'{path}': this LTX-2 version's video VAE file is not read here yet (LTX-2.3's "
                                 f"all-in-one checkpoint is); give Cache Text Embeds the diffusers pipeline folder")
        state = read(path, VAE_PREFIX)
        if not state:
            raise ModelLoadError(f"'{path}' holds no video VAE (no '{VAE_PREFIX}' tensors): LTX-2.3's VAE is read from "
                                 f"the all-in-one checkpoint (ltx-2.3-22b-dev.safetensors or ltx-2.3-22b-dev-fp8."
                                 f"safetensors, models/checkpoints) or from a diffusers pipeline folder's vae/")
        state = diffusers_vae_state(state)
        if (companion / "config.json").exists():
            config = json.loads((companion / "config.json").read_text())
        else:
            ref = resources.files(__package__).joinpath("configs", "vae", f"{self.single_file_config}.json")
            config = json.loads(ref.read_text())
        config = {k: v for k, v in config.items() if not k.startswith("_")}
        config["timestep_conditioning"] = any(k.startswith("decoder.time_embedder.") for k in state)
        with init_empty_weights():
            vae = getattr(diffusers, self.class_name).from_config(config)
        try:
            vae.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
        except RuntimeError as exc:
            raise ModelLoadError(f"'{path}': its '{VAE_PREFIX}' tensors do not fit {self.class_name} of LTX-2's "
                                 f"'{self.single_file_config}' config ({str(exc)[:300]}); is it this model's "
                                 f"checkpoint?") from exc
        return vae.to(dtype)


#: LTX-2.3's (the all-in-one checkpoint's VAE), the tiny model's, and LTX-2.5's (its VAE file not read yet).
LTX2_VAE = Ltx2VaeSpec()
LTX2_TINY_VAE = Ltx2VaeSpec(single_file_config="ltx2-tiny")
LTX25_VAE = Ltx2VaeSpec(single_file_config="", checkpoint_prefix="")
