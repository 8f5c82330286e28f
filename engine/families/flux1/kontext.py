"""Flux.1 Kontext's reference image (editing): how ``FluxKontextPipeline`` takes ``image=``.

diffusers 0.42.1 ``pipelines/flux/pipeline_flux_kontext.py`` (``__call__`` step 3, ``prepare_latents``,
``_encode_vae_image``), ../../../shared/reference/families-2026-image-facts.md §3.2:
- Kontext is FLUX.1-dev's transformer (same shapes, same native names, a guidance embedding) trained with one
  reference image; ComfyUI ships it as ``flux1-dev-kontext_fp8_scaled.safetensors``, told apart by its name;
- the reference is resized (Lanczos) to the preferred Kontext resolution nearest its aspect ratio
  (``PREFERRED_KONTEXT_RESOLUTIONS``, ``_auto_resize=True``: 672x1568 .. 1024x1024 .. 1568x672), sides floored to 16;
- encoded as targets are (``latent_dist.mode()``, ``(z - shift) * scale``), packed 2x2 and appended after the
  target's tokens with ids (1, row, col) (``image_ids[..., 0] = 1``) where the target has (0, row, col); it shares
  the target's timestep and guidance; the prediction is cut back to the target's tokens.
The tiny test variant keeps each reference at its own size floored to 16 (the pipeline with ``_auto_resize=False``),
so CPU tests stay seconds long; ``IDENT`` records the rule in the cache keys.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..specs import VaeSpec
from ..specs.controls import control_embeds

#: Sides are floored to this (the VAE's 8x times the 2x2 packing: ``vae_scale_factor * 2``).
MULTIPLE = 16
#: The time-axis id of the reference's tokens (the target's is 0).
REFERENCE_INDEX = 1


def preferred_resolutions() -> list[tuple[int, int]]:
    """The (width, height) Kontext was trained at: the pipeline's own table."""
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    return list(PREFERRED_KONTEXT_RESOLUTIONS)


def reference_size(width: int, height: int, auto_resize: bool = True) -> tuple[int, int]:
    """(width, height) a reference of this pixel size is encoded at: the preferred resolution nearest its aspect
    ratio (ties to the smaller width, as the pipeline's ``min`` over tuples), or with ``auto_resize`` off its own
    size; both floored to 16."""
    if auto_resize:
        aspect = width / height
        _, width, height = min((abs(aspect - w / h), w, h) for w, h in preferred_resolutions())
    return (width // MULTIPLE) * MULTIPLE, (height // MULTIPLE) * MULTIPLE


def reference_pixels(image, auto_resize: bool = True) -> torch.Tensor:
    """A PIL reference (RGB) -> (1, 3, H, W) in [-1, 1] at ``reference_size``, as the pipeline preprocesses it."""
    from diffusers.image_processor import VaeImageProcessor

    processor = VaeImageProcessor(vae_scale_factor=MULTIPLE)
    width, height = reference_size(image.width, image.height, auto_resize)
    return processor.preprocess(processor.resize(image, height, width), height, width)


@torch.no_grad()
def encode_reference(vae, images: Sequence, auto_resize: bool = True) -> dict[str, torch.Tensor]:
    """One target's PIL reference -> ``{control_latents_0: (1, 16, h, w)}`` normalised as targets are."""
    param = next(vae.parameters())
    out = []
    for image in images:
        pixels = reference_pixels(image, auto_resize).to(param.device, param.dtype)
        out.append(VaeSpec().to_model(vae, vae.encode(pixels).latent_dist.mode()))
    return control_embeds(out)
