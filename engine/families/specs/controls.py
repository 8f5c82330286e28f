"""``ControlImages``: how an edit variant takes control images (``ModelFamily.control_images``), and how their cached
reference latents travel to ``model_inputs`` (``CONTROL_KEY``, ``control_latents``, ``control_embeds``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

#: Cached reference latents travel in ``embeds`` as ``f"{CONTROL_KEY}_{k}"`` (k = 0, 1, ...: the control images in
#: the pipeline's order), each (B, ...) shaped as a target latent of the family is (its own spatial size).
CONTROL_KEY = "control_latents"


@dataclass(frozen=True)
class ControlImages:
    """How an edit model of a family takes control images (``ModelFamily.control_images``), bound to one variant:
    the family folder's own code, so the cache (``engine/caching/edit_cache.py``) needs no family's name.
    ``max_count``: control images per target (None: any number); ``ident``: what changes their encoding (it goes
    into the cache keys); ``size(width, height)``: a control image's size at the reference-latent area (what
    decides its latent's shape, hence which items share a batch); ``encode_latents(vae, images)``: one target's
    control images -> {embedding name: (1, ...) tensor} as ``model_inputs`` takes them.

    ``encode_prompts(captions, images, processor, parts, drop, dtype)``: each caption with its control images through
    the vision-language encoder (``parts`` from ``engine/caching/vl_text.py``) -> one (L_i, D) tensor per caption
    (Qwen-Image-Edit); None: the references never enter the text encoder (Flux.2, Kontext), the captions are encoded
    by the family's ordinary text encoders and the references join the transformer's input only.
    ``optional``: the variant also trains on plain captioned images (Flux.2: one model generates and edits), so a
    dataset is read as pairs only where it has control images (a control folder given, or ``control/`` in the
    dataset folder); False: every item needs its control images (Qwen-Image-Edit, Kontext)."""

    max_count: int | None
    ident: tuple
    size: Callable[[int, int], tuple[int, int]]
    encode_latents: Callable[..., dict]
    encode_prompts: Callable[..., list] | None = None
    optional: bool = False


def control_latents(embeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The reference latents in ``embeds`` (``control_latents_0``, ``control_latents_1``, ... in order; a gap is an
    error: the order of the control images is their position index)."""
    found = sorted(int(k[len(CONTROL_KEY) + 1:]) for k in embeds if k.startswith(CONTROL_KEY + "_"))
    if found != list(range(len(found))):
        raise ValueError(f"control latents must be numbered {CONTROL_KEY}_0 .. _{len(found) - 1} without gaps; got "
                         f"{', '.join(f'{CONTROL_KEY}_{i}' for i in found)}")
    return [embeds[f"{CONTROL_KEY}_{i}"] for i in found]


def control_embeds(latents: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``embeds`` entries ``model_inputs`` reads: ``control_latents_k`` for each reference latent."""
    return {f"{CONTROL_KEY}_{k}": lat for k, lat in enumerate(latents)}


def check_control_batch(name: str, controls: Sequence[torch.Tensor], latents: torch.Tensor) -> None:
    """Each reference latent has the batch and channels of the noisy ``latents`` (else a ValueError naming them)."""
    for c in controls:
        if c.shape[0] != latents.shape[0] or c.shape[1] != latents.shape[1]:
            raise ValueError(f"{name} control latents {tuple(c.shape)} do not fit the batch's latents "
                             f"{tuple(latents.shape)} (one (B, {latents.shape[1]}, h, w) tensor per control image)")


@dataclass(frozen=True)
class FirstFrameCondition:
    """How an image-to-video variant is conditioned on the first frame of each clip (``ModelFamily.first_frame``),
    bound to one variant: the family folder's own code, so the cache and the sampler need no family's name. The
    conditioning goes the way an edit model's control latents go (``ControlImages.encode_latents``): tensors with a
    batch axis under names ``model_inputs`` reads from ``embeds``; here they live in each clip window's latent entry
    (they depend on the window's pixels, bucket and frame count, as its latent does), and previews compute them for
    their first frame.

    ``ident``: what changes the encoding (it goes into the latent keys); ``encode_latents(vae, pixels)``: a window's
    pixels (1, 3, F, H, W) in [-1, 1] -> {name: (1, ...) tensor}, the frames after the first unused but counted;
    ``image_encoder``: None, or the image encoder the variant also takes (``ImageEncoderSpec``);
    ``example(config, latent_shape, generator)``: random stand-ins of one item's conditioning, shaped as the cache
    holds it (without the batch axis), for benches and tests that train on synthetic latents.

    ``held``: the conditioning IS the clip's first latent frame(s), under ``HELD_KEY`` as (B, C, k, ...) (LTX-2: the
    first frame encoded alone): those k frames are given clean, kept out of the loss (``held_weights``) and held at
    that value while previews step the rest (``hold_frames``); the family's ``model_inputs`` gives their tokens the
    clean timestep. False: the conditioning enters through other inputs and every frame is predicted (Wan's channels)."""

    ident: tuple
    encode_latents: Callable[..., dict]
    example: Callable[..., dict]
    image_encoder: "ImageEncoderSpec | None" = None
    held: bool = False


#: Where a held first-frame conditioning (``FirstFrameCondition.held``) travels in ``embeds``: (B, C, k, ...).
HELD_KEY = "held_latents"
#: Which samples of a batch hold their first frames (B,) 1.0 / 0.0, where a mixed batch trains the others as
#: text-to-video (LossOptions.first_frame_p < 1, drawn per batch); absent: every sample with ``HELD_KEY`` holds them.
HELD_ON_KEY = "held_on"


def held_weights(embeds: dict, latents: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor | None:
    """Per-latent-frame loss weights (B, F', h, w) that leave out the held frames (``HELD_KEY`` in ``embeds``), times
    ``weights`` (masked loss's, or None); ``weights`` unchanged when nothing is held. The other frames weigh
    F' / (F' - k), so the loss (a mean over every element) is the mean over the predicted frames: Lightricks'
    trainer divides its loss by the loss mask's mean the same way (``text_to_video.py`` ``compute_loss``), and a
    learning rate means what it means in text-to-video training. In a mixed batch (``HELD_ON_KEY``) only the samples
    that hold their frames leave them out, and the mask is divided by its mean over the whole batch, as Lightricks'
    trainer does when ``first_frame_conditioning_p`` conditions some of a batch's samples."""
    held = embeds.get(HELD_KEY)
    if held is None:
        return weights
    b, frames, k = latents.shape[0], latents.shape[2], held.shape[2]
    if k >= frames:
        raise ValueError(f"{k} held latent frame(s) leave nothing to predict in a clip of {frames}; train on clips "
                         f"of more frames (9 or more for LTX-2)")
    on = embeds.get(HELD_ON_KEY)  # (B,) 1 / 0, on the host where the loop draws it
    mask = torch.ones((b, *latents.shape[2:]), device=latents.device)
    mask[:, :k] = 0.0 if on is None else (1.0 - on.to(mask.device, mask.dtype)).view(-1, 1, 1, 1)
    holding = b if on is None else float(on.sum())
    mask *= b * frames / (b * frames - k * holding)  # over the mask's mean (counted, not summed on the device)
    if weights is None:
        return mask
    w = weights.float()
    if w.dim() != latents.dim() - 1:  # an image mask (B, h, w): the same for every frame
        w = w.unsqueeze(1)
    return mask * w


def hold_frames(x: torch.Tensor, held: torch.Tensor | None) -> torch.Tensor:
    """``x`` (B, C, F', ...) with its first frames set to ``held`` (B, C, k, ...) (None: ``x``)."""
    if held is None:
        return x
    return torch.cat([held.to(x.device, x.dtype), x[:, :, held.shape[2]:]], dim=2)


@dataclass(frozen=True)
class ImageEncoderSpec:
    """An image encoder whose states of the first frame the transformer takes (Wan 2.1 I2V: CLIP ViT-H/14's
    penultimate hidden state, (257, 1280)), encoded by ``engine/caching/image_encoder.py``.

    ``cache_key``: the name ``model_inputs`` reads; ``subfolder`` / ``processor_subfolder``: a diffusers pipeline
    folder's parts (``image_encoder/``, ``image_processor/``); ``architecture``: the shipped config of a single file
    (``engine/families/configs/image/<name>/``: model config and processor settings); ``hidden_state``: which of
    ``output_hidden_states`` (-2: the penultimate); ``file_help``: the single file users have, for errors."""

    cache_key: str
    subfolder: str
    processor_subfolder: str
    architecture: str
    hidden_state: int
    file_help: str
