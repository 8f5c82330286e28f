"""Wan's two VAEs as latent spaces: the Wan 2.1 VAE (16 channels, 8x spatial) and the Wan 2.2 VAE (TI2V-5B only).

Both are diffusers' ``AutoencoderKLWan`` with per-channel ``(z - latents_mean) / latents_std`` (``WanVaeSpec``);
Wan keeps the frame axis for images too (``video=True``: an image is a one-frame clip, (C, 1, h, w)). The Wan
2.2 VAE (``base_dim 160``, ``z_dim 48``, residual down/up blocks, a 2x2 patchify in front: 16x spatial; diffusers'
``vae22_diffusers_config`` in ``scripts/convert_wan_to_diffusers.py``, shipped as ``configs/vae/wan2.2``) nests
its resnets one level deeper in the original names that ComfyUI's ``wan2.2_vae.safetensors`` keeps
(``encoder.downsamples.X.downsamples.Y.residual.*``; ComfyUI's detection key
``decoder.upsamples.0.upsamples.0.residual.2.weight``). diffusers' single-file ``convert_wan_vae_to_diffusers``
only knows the 2.1 layout, so ``Wan22VaeSpec.convert_original`` applies the rules of that script's
``convert_vae_22`` (the middle, head and quant names are the 2.1 ones and go through diffusers' converter).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..wan_vae import WanVaeSpec

_RESNET = ((".residual.0.gamma", ".norm1.gamma"), (".residual.2.", ".conv1."), (".residual.3.gamma", ".norm2.gamma"),
           (".residual.6.", ".conv2."), (".shortcut.", ".conv_shortcut."))


def wan22_vae_diffusers_key(key: str) -> str | None:
    """An original Wan 2.2 VAE name inside the down/up blocks -> diffusers' name (None: not a down/up-block key)."""
    m = re.fullmatch(r"(encoder\.downsamples|decoder\.upsamples)\.(\d+)\.(?:downsamples|upsamples)\.(\d+)(\..*)", key)
    if m is None:
        return None
    side = "encoder.down_blocks" if m[1].startswith("encoder") else "decoder.up_blocks"
    rest = m[4]
    if rest.startswith((".resample.", ".time_conv.")):
        return f"{side}.{m[2]}.{'downsampler' if side.startswith('encoder') else 'upsampler'}{rest}"
    for a, b in _RESNET:
        if rest.startswith(a):
            return f"{side}.{m[2]}.resnets.{m[3]}{b}{rest[len(a):]}"
    return f"{side}.{m[2]}.resnets.{m[3]}{rest}"


@dataclass(frozen=True)
class Wan22VaeSpec(WanVaeSpec):
    single_file_config: str = "wan2_2"

    def convert_original(self, state: dict) -> dict:
        inner = {k: v for k, v in state.items() if wan22_vae_diffusers_key(k) is None}
        out = super().convert_original(inner) if inner else {}
        out.update({wan22_vae_diffusers_key(k): v for k, v in state.items() if k not in inner})
        return out


#: Wan 2.1 T2V (1.3B, 14B) and both Wan 2.2 A14B experts: ``wan_2.1_vae.safetensors``.
WAN21_VAE = WanVaeSpec(class_name="AutoencoderKLWan", config_package=__package__, single_file_config="wan2_1",
                       video=True)
#: Wan 2.2 TI2V-5B only: ``wan2.2_vae.safetensors``.
WAN22_VAE = Wan22VaeSpec(class_name="AutoencoderKLWan", config_package=__package__, single_file_config="wan2_2",
                         video=True)
