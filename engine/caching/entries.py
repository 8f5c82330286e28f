"""The text and latents phases of a cache build: compute the entries the cache lacks, write each atomically.

An entry already on disk and readable is reused; a corrupt, truncated or empty one is removed with a notice and
built again (``usable``). Files are written to a temporary name and renamed (``atomic_save``), so an interrupted run
never leaves a half-written entry that looks complete.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..callbacks import TrainingCallback
from ..checkpoint import SafetensorsFile
from ..checkpoint.files import UnreadableSafetensors
from ..data import load_clip_tensor, load_image_tensor
from ..fileio import atomic_write
from .items import CachedItem
from .model_sources import CacheModels
from .encoders import encoder_kind
from .image_encoder import encode_first_frames, frame_image
from .vae_encoding import encode_images


def usable(path: Path, cb: TrainingCallback) -> bool:
    """True for a readable entry. A missing one is False; a corrupt, truncated or empty one
    (a disk problem, a copy gone wrong) is removed with a notice, so it is built again
    instead of failing every later run."""
    if not path.exists():
        return False
    try:
        entry = SafetensorsFile(path)  # checks the header parses and every tensor's bytes are in the file
        if entry.entries:
            return True
        problem = "no tensors"
    except Exception as exc:
        # rebuilt here: no fix to name
        problem = exc.problem if isinstance(exc, UnreadableSafetensors) else f"{type(exc).__name__}: {exc}"
    cb.log(f"dataset-cache entry '{path}' is unreadable ({problem}); rebuilding it")
    path.unlink(missing_ok=True)
    return False


def atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    with atomic_write(path, "a dataset-cache entry") as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


def negative_specs(specs) -> tuple:
    """The specs the empty prompt is encoded with: each family's ``negative_template`` where it has one (Lumina 2
    leaves out its system prompt), as its pipeline tokenizes the negative."""
    return tuple(replace(s, template=s.negative_template) if s.negative_template else s for s in specs)


def build_text(cache_dir: Path, models: CacheModels, specs, items: list[CachedItem], max_len: int,
               cb: TrainingCallback, stats: dict) -> None:
    """Encode every caption whose text entry is missing, each encoder over all of them, then write one entry per
    caption (every encoder's output)."""
    singles = models.singles
    text_dir = cache_dir / "text"
    todo: dict[str, str] = {}
    for it in items:
        if it.text_key not in todo and not usable(text_dir / f"{it.text_key}.safetensors", cb):
            todo.setdefault(it.text_key, it.caption)
    stats["text_reused"] = len({i.text_key for i in items}) - len(todo)
    if not todo:
        return
    keys, captions = list(todo), list(todo.values())
    per_encoder = {}
    for spec in specs:
        kind = encoder_kind(spec.kind)
        stage = f"encode captions ({spec.subfolder})"
        per_encoder[spec.cache_key] = kind.encode(models.pipeline, singles, models.family, spec, captions,
                                                  models.device, models.dtype, kind.caption_length(spec, max_len),
                                                  progress=lambda d, t, s=stage: cb.on_progress(s, d, t))
    for i, key in enumerate(keys):
        atomic_save({name: outs[i] for name, outs in per_encoder.items()}, text_dir / f"{key}.safetensors")
    stats["text_built"] = len(keys)


def build_latents(cache_dir: Path, family, items: list[CachedItem], flip: bool, device, dtype,
                  cb: TrainingCallback, stats: dict, vae_loader, variant: str | None = None,
                  image_encoder_loader=None) -> None:
    """Encode every image (or clip window) whose latent entry is missing with the VAE ``vae_loader`` gives (also
    its mirror image with ``flip``), then write one entry per item. An image-to-video variant
    (``family.first_frame``) also keeps its first-frame conditioning in the entry, beside the latent (a flipped
    copy under ``<name>_flipped``): the condition latents from the same VAE pass, and the image encoder's states of
    the first frame (``image_encoder_loader()`` -> (model, processor)) where the variant takes them."""
    lat_dir = cache_dir / "latents"
    todo = {}
    for it in items:
        if it.latent_key not in todo and not usable(lat_dir / f"{it.latent_key}.safetensors", cb):
            todo.setdefault(it.latent_key, it)
    stats["latents_reused"] = len({i.latent_key for i in items}) - len(todo)
    if not todo:
        return
    jobs = [(it, False) for it in todo.values()] + ([(it, True) for it in todo.values()] if flip else [])
    condition = family.first_frame(variant) if variant else None
    conditions: list[dict] = []
    firsts: list = []  # the first frames, for the image encoder

    def images():
        for it, f in jobs:
            pixels = _pixels(it, f)
            if condition is not None and condition.image_encoder is not None:
                firsts.append(frame_image(pixels))
            yield pixels

    latents = encode_images(None, family, images(), len(jobs), device, dtype, vae_loader=vae_loader,
                            progress=lambda d, t: cb.on_progress("encode images (vae)", d, t), variant=variant,
                            condition=condition, conditions=conditions)
    if firsts:
        _add_image_states(conditions, firsts, condition.image_encoder, image_encoder_loader, device, dtype, cb)
    n = len(todo)
    for i, (key, it) in enumerate(todo.items()):
        tensors = {"latent": latents[i]}
        if flip:
            tensors["latent_flipped"] = latents[n + i]
        if conditions:
            tensors.update(conditions[i])
            if flip:
                tensors.update({f"{k}_flipped": v for k, v in conditions[n + i].items()})
        atomic_save(tensors, lat_dir / f"{key}.safetensors", metadata={"image": it.image})
    stats["latents_built"] = n


def _add_image_states(conditions: list[dict], firsts: list, spec, loader, device, dtype, cb) -> None:
    """Each job's first frame through the image encoder, into its conditioning (``spec.cache_key``)."""
    from ..models.dtypes import release_device_memory

    if loader is None:
        raise ValueError("this image-to-video model takes image-encoder states; build_latents needs its loader")
    model, processor = loader()
    try:
        states = encode_first_frames(model, processor, spec, firsts, device, dtype)
    finally:
        del model
        release_device_memory(device)
    for cond, s in zip(conditions, states, strict=True):
        cond[spec.cache_key] = s
    cb.on_progress("encode first frames (image_encoder)", len(states), len(states))


def _pixels(item: CachedItem, flip: bool) -> torch.Tensor:
    """What the VAE encodes for one item: (3, H, W) for an image, (3, F, H, W) for a video window."""
    if item.frames:
        return load_clip_tensor(Path(item.image), item.frames, item.bucket, flip=flip)
    return load_image_tensor(Path(item.image), item.bucket, flip=flip)


def build_masks(cache_dir: Path, items: list[CachedItem], flip: bool, source: str, cb: TrainingCallback,
                stats: dict) -> None:
    """The masks phase (masked loss): each item's mask at its bucket's pixel size, uint8 (and mirrored with
    ``flip``), one entry per mask key; entries on disk are reused. A clip window's mask has a frame axis, (F, H, W)
    (``data.clip_masks``)."""
    from ..data.clip_masks import load_clip_mask
    from ..data.masks import load_mask

    def load(it: CachedItem, flipped: bool = False):
        if it.frames:
            return load_clip_mask(Path(it.image), source, it.frames, it.bucket, flipped)
        return load_mask(Path(it.image), source, it.bucket, flipped)

    mask_dir = cache_dir / "masks"
    todo = {}
    for it in items:
        if it.mask_key and it.mask_key not in todo and not usable(mask_dir / f"{it.mask_key}.safetensors", cb):
            todo[it.mask_key] = it
    stats["masks_reused"] = len({i.mask_key for i in items if i.mask_key}) - len(todo)
    for done, (key, it) in enumerate(todo.items(), 1):
        tensors = {"mask": load(it)}
        if flip:
            tensors["mask_flipped"] = load(it, True)
        atomic_save(tensors, mask_dir / f"{key}.safetensors", metadata={"image": it.image, "source": source})
        cb.on_progress("masks", done, len(todo))
    stats["masks_built"] = len(todo)
