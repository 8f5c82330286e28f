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
