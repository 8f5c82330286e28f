"""LTX-2.3 / 2.5 image-to-video: the first frame's conditioning (``FirstFrameCondition`` with ``held``).

Facts (../../../shared/reference/families-2026-video-facts.md §2.6; diffusers 0.42.1 ``pipeline_ltx2_image2video.py``
``prepare_latents`` L836-864 and the loop L1486-1696; Lightricks' trainer ``training-modes.md``):

- The pipeline encodes the image ALONE as a one-frame video (normalised like the latents) and puts it at latent
  frame 0; the other frames start from noise. The video timestep is per token, ``t * (1 - conditioning_mask)``:
  0 on frame 0's tokens; the prompt AdaLN (``sigma``) and the audio get the scalar ``t``. Only frames 1.. are
  stepped; frame 0 stays the image latent to the end.
- Training does the same with each clip's own first frame: clean, timestep 0, out of the loss. Lightricks' trainer
  (``ltx_trainer/training_strategies/text_to_video.py``, ``first_frame_conditioning_p``) takes the clip latent's own
  frame-0 tokens (``torch.where(mask, latents, noisy)``), gives them per-token timestep 0, and divides the masked
  loss by the mask's mean (``held_weights`` does the same); ai-toolkit replaces latent frame 0 and masks it from
  the loss.
- The cache keeps the first frame encoded alone (``HELD_KEY``, one latent frame: 1/F' of the clip's latent). The
  causal VAE's first latent frame reads the first pixel frame only, so it equals the clip latent's frame 0 (<= 6e-7 on
  the tiny VAE, ``test_i2v.py``); keeping it beside the latent makes ``model_inputs`` self-contained (it gets noisy
  latents only) and gives previews the pipeline's very input.
- H.264: the pipeline first re-encodes the image through H.264 (CRF 33 up to 2.3, 18 for 2.5;
  ``apply_image_conditioning_crf``), to make a still photo look like a video frame. Training does not: its
  condition IS a video frame (decoded from the clip, already compressed), and Lightricks' trainer conditions on the
  clip's own latent frame 0 (its dataset latents; no re-encode), as ai-toolkit does.
- Lightricks' ``i2v_lora.yaml`` conditions half the batch (``first_frame_conditioning_p`` 0.5) and trains the rest as
  text-to-video; here every clip is conditioned when the choice is on (a mixed probability is not offered yet). Previews take a frame of a
  training clip too, so they skip it as well: they equal ``LTX2ImageToVideoPipeline(image_crf=0)``.

The same checkpoint does T2V and I2V: the I2V variants (``ltx2.3-i2v`` ...) share the T2V ones' configs, are never
matched by shape, and are chosen by the user (Cache Text Embeds' ``image_to_video``, ``VideoConfig.image_to_video``).
"""
from __future__ import annotations

import torch

from ..specs import HELD_KEY, FirstFrameCondition
from .vae import LTX2_VAE


def encode_first_frame(vae, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
    """A window's pixels (1, 3, F, H, W) in [-1, 1] (or an image (1, 3, H, W)) -> {``HELD_KEY``: (1, C, 1, h, w)}:
    the first frame alone through the VAE, normalised, as the pipeline's ``prepare_latents`` encodes its image."""
    first = pixels[:, :, :1] if pixels.dim() == 5 else pixels.unsqueeze(2)
    return {HELD_KEY: LTX2_VAE.encode(vae, first)}


def example_first_frame(config: dict, latent_shape, generator) -> dict[str, torch.Tensor]:
    """A random stand-in of a window's held first frame (benches, tests): (C, 1, h, w)."""
    return {HELD_KEY: torch.randn((latent_shape[0], 1, *latent_shape[2:]), generator=generator)}


LTX2_I2V = FirstFrameCondition(ident=("ltx2-i2v", 1), encode_latents=encode_first_frame,
                               example=example_first_frame, held=True)


def conditioned_inputs(hidden: torch.Tensor, t: torch.Tensor, held: torch.Tensor, tokens_per_frame: int,
                       on: torch.Tensor | None = None):
    """The packed video input (B, F' h w, C) with its first ``k`` latent frames replaced by ``held`` (B, C, k, h, w),
    and the per-token video timestep (B, F' h w): ``t`` (B,) times ``1 - conditioning_mask`` (0 on the held
    tokens), as ``LTX2ImageToVideoPipeline`` builds both. ``on`` (B,) 1 / 0: in a mixed batch only the samples it
    marks hold their frames; the others keep their noisy frames at ``t`` (text-to-video), as Lightricks' trainer
    builds a batch under ``first_frame_conditioning_p`` (``torch.where(mask, latents, noisy)``)."""
    b = hidden.shape[0]
    n = held.shape[2] * tokens_per_frame
    packed = held.to(hidden.device, hidden.dtype).flatten(2).transpose(1, 2)
    mask = torch.zeros(b, hidden.shape[1], device=t.device, dtype=t.dtype)
    if on is None:
        mask[:, :n] = 1.0
    else:
        on = on.to(hidden.device).view(b, 1, 1) > 0.5
        packed = torch.where(on, packed, hidden[:, :n])
        mask[:, :n] = on.view(b, 1).to(t.device, t.dtype)
    hidden = torch.cat([packed, hidden[:, n:]], dim=1)
    return hidden, t.unsqueeze(-1) * (1 - mask)
