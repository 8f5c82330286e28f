"""Wan image-to-video (Wan 2.1 I2V 14B, Wan 2.2 I2V-A14B): the first frame's conditioning.

Facts (../../../shared/reference/families-2026-video-facts.md §1.2-1.3; diffusers 0.42.1 ``pipeline_wan_i2v.py``
``prepare_latents`` and ``encode_image``):

- The transformer (``in_channels`` 36) takes ``cat([noisy 16, mask 4, condition 16])`` on the channel axis. The
  condition is ONE VAE encode of the whole clip-length video ``[first frame, zeros x (F - 1)]`` (zeros are mid-grey
  in [-1, 1]), normalised as the latents are: not the first frame's latent padded with zeros (encoding zeros does
  not give zero latents, and the causal VAE's later frames see the first). The mask is 1 on latent frame 0 (all 4
  channels), 0 elsewhere: the first pixel frame repeated 4x, then viewed as 4 channels per latent frame.
  ``image_condition`` here is the pipeline's ``condition``: (B, 20, F', h, w) = ``cat([mask, latents])``.
- Wan 2.1 I2V also takes CLIP ViT-H/14's penultimate hidden state of the first frame (257 x 1280,
  ``encoder_hidden_states_image``) through its image cross-attention (``add_k_proj`` / ``add_v_proj``: native
  ``k_img`` / ``v_img``). Wan 2.2 I2V has no CLIP path.
- Frame 0 stays in the loss: the 14B I2V models predict every latent frame (the pipeline steps all of them, and
  musubi-tuner, diffusion-pipe and DiffSynth all train on every frame for the 36-channel models; only TI2V-5B's
  clean-first-frame mode leaves it out).
"""
from __future__ import annotations

import torch

from ..specs import FirstFrameCondition, ImageEncoderSpec
from .vae import WAN21_VAE

#: The name ``model_inputs`` reads the 20 condition channels under (mask + first-frame video latents).
CONDITION_KEY = "image_condition"
#: The name of Wan 2.1 I2V's CLIP states.
IMAGE_EMBEDS_KEY = "image_embeds"
TEMPORAL = 4  # the Wan 2.1 VAE: the first frame alone, then 4 frames per latent frame


def first_frame_mask(frames: int, latent_height: int, latent_width: int) -> torch.Tensor:
    """(1, 4, F', h, w): WanImageToVideoPipeline's mask: 1 on every pixel frame of latent frame 0, 0 after; the first
    pixel frame repeated ``TEMPORAL`` times, then ``TEMPORAL`` pixel frames folded into the channels."""
    mask = torch.ones(1, 1, frames, latent_height, latent_width)
    mask[:, :, 1:] = 0
    mask = torch.cat([mask[:, :, :1].repeat_interleave(TEMPORAL, dim=2), mask[:, :, 1:]], dim=2)
    return mask.view(1, -1, TEMPORAL, latent_height, latent_width).transpose(1, 2)


def encode_condition(vae, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
    """A window's pixels (1, 3, F, H, W) in [-1, 1] -> {``image_condition``: (1, 20, F', h, w)}: the mask, then the
    normalised latents' mean (the pipeline's ``argmax``) of ``[frame 0, zeros x (F - 1)]``. An image (1, 3, H, W) is
    a one-frame clip."""
    if pixels.dim() == 4:
        pixels = pixels.unsqueeze(2)
    video = torch.zeros_like(pixels)
    video[:, :, :1] = pixels[:, :, :1]
    latents = WAN21_VAE.encode(vae, video)  # (1, 16, F', h, w)
    mask = first_frame_mask(pixels.shape[2], latents.shape[3], latents.shape[4]).to(latents.device, latents.dtype)
    return {CONDITION_KEY: torch.cat([mask, latents], dim=1)}


#: CLIP ViT-H/14's tokens at 224 px: (224 / 14)^2 patches + the class token.
CLIP_TOKENS = 257


def example_condition(config: dict, latent_shape, generator) -> dict[str, torch.Tensor]:
    """Random stand-ins of a window's conditioning (benches, tests): the 20 channels on the latent grid and, where
    the model takes CLIP states (``image_dim``), 257 of them."""
    out = {CONDITION_KEY: torch.randn((int(config["in_channels"]) - latent_shape[0], *latent_shape[1:]),
                                      generator=generator)}
    if config.get("image_dim") is not None:
        out[IMAGE_EMBEDS_KEY] = torch.randn(CLIP_TOKENS, int(config["image_dim"]), generator=generator)
    return out


#: CLIP ViT-H/14 as diffusers' Wan 2.1 I2V pipelines and ComfyUI's ``clip_vision_h.safetensors`` hold it.
CLIP_VISION_H = ImageEncoderSpec(
    cache_key=IMAGE_EMBEDS_KEY, subfolder="image_encoder", processor_subfolder="image_processor",
    architecture="clip_vision_h", hidden_state=-2,
    file_help="clip_vision_h.safetensors (models/clip_vision; ComfyUI's Wan 2.1 image-to-video file)")

#: Wan 2.2 I2V-A14B: the 20 condition channels only.
WAN22_I2V = FirstFrameCondition(ident=("wan-i2v", 1), encode_latents=encode_condition, example=example_condition)
#: Wan 2.1 I2V 14B: the condition channels and CLIP ViT-H's states of the first frame.
WAN21_I2V = FirstFrameCondition(ident=("wan-i2v", 1, "clip-h", -2), encode_latents=encode_condition,
                                example=example_condition, image_encoder=CLIP_VISION_H)
