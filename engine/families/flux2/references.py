"""Flux.2's reference images (editing): how ``Flux2Pipeline`` and ``Flux2KleinPipeline`` take ``image=[...]``.

diffusers 0.42.1 ``pipeline_flux2.py`` / ``pipeline_flux2_klein.py`` (``__call__`` step 4, ``prepare_image_latents``,
``_prepare_image_ids``), ../../../shared/reference/families-2026-image-facts.md §3.1:
- each reference over 1024² pixels is resized (Lanczos) to about 1024² at its own aspect ratio (``int`` of the scaled
  sides), then both sides floored to multiples of 16 and the image centre-cropped to them (``resize_mode="crop"``);
  a smaller reference keeps its size (floored to 16). The target's size never changes a reference's;
- encoded as targets are (``latent_dist.mode()``, 2x2 patchify, the VAE's BatchNorm statistics: ``FLUX2_VAE``):
  (1, 128, H/16, W/16) each, cached as ``control_latents_k``;
- reference k's tokens follow the target's, in order, with position ids (T = 10 + 10k, row, col, 0) where the target
  has T = 0; they share the target's timestep and guidance (Flux.2's modulation is global); the prediction is cut
  back to the target's tokens. References do not enter the text encoder ("[IMG]" is stripped from prompts).
BFL's own sampler lets one reference reach ~4 MP; this follows diffusers (and ComfyUI's 1 MP ``ImageScaleToTotalPixels``
in its edit templates), recorded in ``IDENT`` so a cache says which rule built it.

klein 9B KV (``Flux2KleinKVPipeline``) puts the references FIRST with a fixed timestep; it is refused by name
(``family.variant_from_name``), not trained as this layout.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ..specs.controls import control_embeds

#: A reference over this many pixels is scaled down to it (the pipelines' 1024 * 1024).
MAX_AREA = 1024 * 1024
#: Reference sides are floored to this (the VAE's 8x times the 2x2 patch: ``vae_scale_factor * 2``).
MULTIPLE = 16
#: Reference k's time index: ``SCALE + SCALE * k`` (``_prepare_image_ids(scale=10)``; ComfyUI ``ref_index_scale``).
SCALE = 10
IDENT = ("flux2-references", MAX_AREA, MULTIPLE, "lanczos-crop")


#: The pipelines refuse smaller or narrower references (``Flux2ImageProcessor.check_image_input``).
MIN_SIDE, MAX_ASPECT = 64, 8


def reference_size(width: int, height: int) -> tuple[int, int]:
    """(width, height) a reference of this pixel size is encoded at (the pipelines' step 4); a ValueError for one
    the pipelines refuse (a side under 64 px, an aspect ratio over 8:1)."""
    if width < MIN_SIDE or height < MIN_SIDE:
        raise ValueError(f"a {width}x{height} reference is too small for Flux.2 (each side at least {MIN_SIDE} px); "
                         f"use a larger control image")
    if max(width / height, height / width) > MAX_ASPECT:
        raise ValueError(f"a {width}x{height} reference is too narrow for Flux.2 (at most {MAX_ASPECT}:1); crop it")
    if width * height > MAX_AREA:
        scale = math.sqrt(MAX_AREA / (width * height))
        width, height = int(width * scale), int(height * scale)
    return (width // MULTIPLE) * MULTIPLE, (height // MULTIPLE) * MULTIPLE


def reference_pixels(image) -> torch.Tensor:
    """A PIL reference (RGB) -> (1, 3, H, W) in [-1, 1] at ``reference_size``, as the pipelines preprocess it."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    processor = Flux2ImageProcessor(vae_scale_factor=MULTIPLE)
    if image.width * image.height > MAX_AREA:
        image = processor._resize_to_target_area(image, MAX_AREA)
    width, height = reference_size(image.width, image.height)
    return processor.preprocess(image, height=height, width=width, resize_mode="crop")


@torch.no_grad()
def encode_references(vae, images: Sequence, vae_spec) -> dict[str, torch.Tensor]:
    """One target's PIL references -> ``{control_latents_k: (1, 128, h_k, w_k)}`` normalised as targets are
    (``vae_spec``: the family's ``Flux2VaeSpec``)."""
    param = next(vae.parameters())
    out = []
    for image in images:
        pixels = reference_pixels(image).to(param.device, param.dtype)
        out.append(vae_spec.to_model(vae, vae.encode(pixels).latent_dist.mode()))
    return control_embeds(out)


def reference_ids(references: Sequence[torch.Tensor], device, dtype) -> torch.Tensor:
    """(sum h_k * w_k, 4) position ids of the references in token order: (SCALE + SCALE * k, row, col, 0), as
    ``_prepare_image_ids`` makes them (row-major within each reference)."""
    ids = []
    for k, ref in enumerate(references):
        h, w = ref.shape[-2], ref.shape[-1]
        one = torch.zeros(h, w, 4, device=device, dtype=dtype)
        one[..., 0] = SCALE + SCALE * k
        one[..., 1] = torch.arange(h, device=device, dtype=dtype)[:, None]
        one[..., 2] = torch.arange(w, device=device, dtype=dtype)[None, :]
        ids.append(one.reshape(-1, 4))
    return torch.cat(ids, dim=0)
