"""``ControlImages``: how an edit variant takes control images (``ModelFamily.control_images``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ControlImages:
    """How an edit model of a family takes control images (``ModelFamily.control_images``), bound to one variant:
    the family folder's own code, so the cache (``engine/caching/edit_cache.py``) needs no family's name.
    ``max_count``: control images per target (None: any number); ``ident``: what changes their encoding (it goes
    into the cache keys); ``size(width, height)``: a control image's size at the reference-latent area (what
    decides its latent's shape, hence which items share a batch); ``encode_prompts(captions, images, processor,
    parts, drop, dtype)``: each caption with its control images through the vision-language encoder (``parts`` from
    ``engine/caching/vl_text.py``) -> one (L_i, D) tensor per caption; ``encode_latents(vae, images)``: one target's
    control images -> {embedding name: (1, ...) tensor} as ``model_inputs`` takes them."""

    max_count: int | None
    ident: tuple
    size: Callable[[int, int], tuple[int, int]]
    encode_prompts: Callable[..., list]
    encode_latents: Callable[..., dict]


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
    holds it (without the batch axis), for benches and tests that train on synthetic latents."""

    ident: tuple
    encode_latents: Callable[..., dict]
    example: Callable[..., dict]
    image_encoder: "ImageEncoderSpec | None" = None


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
