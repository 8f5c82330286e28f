"""Caching an edit dataset (Qwen-Image-Edit, Flux.2, Kontext): pairs of a target and its control images -> entries.

A variant with ``ControlImages`` reads its captions as instructions about control images (``engine/data/pairs.py``:
the layouts, ``docs/edit_datasets.md``). For each item the cache holds:

- ``latents/<key>``: the TARGET's latent, as for any image dataset (``cache.py``);
- ``text/<key>``: the multimodal prompt (``prompt_embeds``: the instruction with the control images through the VL
  encoder, ``families/qwen_image/edit_text.py`` over ``vl_text``'s layer-major parts) AND the control images' VAE
  latents (``control_latents_0``, ``_1``, ... each (16, h, w), ``controls.encode_controls``). Both depend on the
  instruction and the control images alone, so they share one entry: ``DatasetCache.load_item`` /
  ``collate_text`` then deliver ``control_latents_k`` in the embeds the family's ``model_inputs`` reads, and
  sampling previews get them the same way. Where the references never enter the text encoder (Flux.2, Kontext:
  ``ControlImages.encode_prompts`` None), the prompt is the caption's ordinary text entry (built and kept under its
  caption key as for an image dataset, ``build_reference_entries``) copied beside the control latents. The key hashes the encoder files, the VAE files, the instruction, each
  control file's bytes (content identity: a renamed control is reused, an edited one rebuilt) and the areas.

Batches: a batch stacks the control latents, so its items need equal control counts and shapes; each item records
its controls' pixel sizes (``control_sizes``, read from the file headers) and the training loop groups batches by
them as it groups by bucket.

Sampling previews: sample prompt line i is drawn against dataset pair i's control images (pairs in target-name
order); more lines than pairs is an error. The negative prompt of each line (the empty instruction) carries the same
control images, as ``QwenImageEditPlusPipeline`` encodes ``negative_prompt`` with ``image``.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch

from ..errors import ConfigError, DatasetError, ModelLoadError
from ..hashing import sha256_file, stable_hash

#: Prompts encoded together: each group reads every language-model layer once from the memory map.
GROUP = 8


def edit_area_ident(family, variant: str) -> list:
    return list(family.control_images(variant).ident)


def control_sizes(controls: Sequence[Path], family, variant: str) -> list[list[int]]:
    """Each control image's (width, height) at the reference-latent area (``ControlImages.size``), from its
    header only: what decides the shape of its cached latent, hence which items may share a batch."""
    from PIL import Image

    size = family.control_images(variant).size
    out = []
    for path in controls:
        with Image.open(path) as img:
            try:
                out.append(list(size(img.width, img.height)))
            except ValueError as exc:  # a size the model's pipeline refuses (Flux.2: under 64 px)
                raise DatasetError(f"control image '{path}': {exc}") from None
    return out


def edit_text_key(text_ident: str, vae_ident: str, caption: str, controls: Sequence[Path], content: dict,
                  areas: list) -> str:
    for c in controls:
        if c not in content:
            content[c] = sha256_file(c)
    return stable_hash([text_ident, vae_ident, caption, [content[c] for c in controls], areas])


def attach_controls(items, pairs, text_ident: str, vae_ident: str, family, variant: str) -> list:
    """``items`` (one per pair's target, in order) with their control files, sizes and the edit text key."""
    areas, content = edit_area_ident(family, variant), {}
    out = []
    for item, pair in zip(items, pairs, strict=True):
        controls = list(pair.controls)
        out.append(replace(item, controls=[str(c) for c in controls],
                           control_sizes=control_sizes(controls, family, variant),
                           text_key=edit_text_key(text_ident, vae_ident, item.caption, controls, content, areas)))
    return out


def sample_items(prompts: Sequence[str], pairs, text_ident: str, vae_ident: str, family, variant: str, item_cls):
    """(sample prompt items, their negative items): line i with pair i's control images."""
    if len(prompts) > len(pairs):
        raise ConfigError(f"{len(prompts)} sample prompts but the edit dataset has {len(pairs)} pair(s): each sample "
                          f"prompt line is drawn against one pair's control images (line 1 with the first target's "
                          f"controls, in file-name order); give at most {len(pairs)} lines")
    areas, content = edit_area_ident(family, variant), {}
    made, negatives = [], []
    for prompt, pair in zip(prompts, pairs):
        controls = list(pair.controls)
        common = dict(image=str(pair.target.image_path), bucket=(0, 0), latent_key="",
                      controls=[str(c) for c in controls], control_sizes=control_sizes(controls, family, variant))
        made.append(item_cls(caption=prompt, text_key=edit_text_key(text_ident, vae_ident, prompt, controls, content,
                                                                    areas), **common))
        negatives.append(item_cls(caption="", text_key=edit_text_key(text_ident, vae_ident, "", controls, content,
                                                                     areas), **common))
    return made, negatives


def _vl_config(path: Path, family, spec):
    """The whole Qwen2.5-VL config (text and vision) of a single file: its companion folder's config.json, else the
    shipped config of ``spec.architecture``."""
    from importlib import resources

    from transformers import AutoConfig

    from ..families import text_architecture_config
    from .single_files import companion_dir

    own = companion_dir(path)
    if (own / "config.json").exists():
        config = AutoConfig.from_pretrained(own, local_files_only=True)
    elif spec.architecture:
        with resources.as_file(text_architecture_config(family, spec.architecture)) as cfg:
            config = AutoConfig.from_pretrained(cfg, local_files_only=True)
    else:
        raise ModelLoadError(f"'{path}': no architecture is known for this text encoder; put its config.json in '{own}/'")
    if getattr(config, "vision_config", None) is None:
        raise ModelLoadError(f"'{path}'s config has no vision tower; Qwen-Image-Edit needs Qwen2.5-VL's whole config "
                             f"(text and vision)")
    return config


def vl_sources(family, spec, pipeline: Path | None, singles, dtype) -> tuple[list[Path], object, Path, Path | None]:
    """(weight files, whole VL config, tokenizer folder, image-processor folder or None) of the edit text encoder."""
    from transformers import AutoConfig

    if singles is not None:
        from .single_files import decoder_lm_source

        path = singles.text_encoders[spec.subfolder]
        files, _, tokenizer_dir = decoder_lm_source(path, family, spec, singles.tokenizer_dirs)
        return files, _vl_config(path, family, spec), tokenizer_dir, None
    folder = pipeline / spec.subfolder
    files = sorted(folder.glob("*.safetensors"))
    if not (folder / "config.json").exists() or not files:
        raise ModelLoadError(f"text encoder folder '{folder}' is missing or has no .safetensors weights; an Edit "
                             f"pipeline folder holds Qwen2.5-VL in text_encoder/")
    processor = pipeline / "processor"
    return (files, AutoConfig.from_pretrained(folder, local_files_only=True), pipeline / spec.tokenizer_subfolder,
            processor if (processor / "preprocessor_config.json").exists() else None)


def make_processor(tokenizer, image_processor_dir: Path | None = None):
    """The Edit pipelines' ``Qwen2VLProcessor``: the tokenizer and a ``Qwen2VLImageProcessor`` (the pipeline folder's
    processor/ settings, else Qwen2.5-VL's defaults: patch 14, merge 2, the same as the released processor config).
    No video processor: transformers builds that only with torchvision, and edit prompts carry images only."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor

    class _ImagesOnlyProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    images = (Qwen2VLImageProcessor.from_pretrained(image_processor_dir, local_files_only=True)
              if image_processor_dir is not None else Qwen2VLImageProcessor())
    return _ImagesOnlyProcessor(image_processor=images, tokenizer=tokenizer)


def _rgb(path: str):
    from PIL import Image, ImageOps

    try:
        with Image.open(path) as img:
            return ImageOps.exif_transpose(img).convert("RGB")
    except OSError as exc:
        raise DatasetError(f"control image '{path}' is unreadable ({exc}); replace or remove it") from None


@torch.no_grad()
def build_reference_entries(cache_dir: Path, models, keys, items, cb, stats: dict) -> None:
    """The text entries of a variant whose references never enter the text encoder: each instruction encoded by the
    family's ordinary text encoders (``entries.build_text``, under its caption key: shared with image datasets),
    then per missing edit entry that embedding with the control images' reference latents
    (``ControlImages.encode_latents``)."""
    from safetensors.torch import load_file

    from ..models.dtypes import release_device_memory
    from .entries import atomic_save, build_text, usable
    from .items import text_item

    text_dir = cache_dir / "text"
    todo: dict[str, object] = {}
    for it in items:
        if it.text_key not in todo and not usable(text_dir / f"{it.text_key}.safetensors", cb):
            todo[it.text_key] = it
    stats["text_reused"] = stats.get("text_reused", 0) + len({i.text_key for i in items}) - len(todo)
    if not todo:
        return
    captions = {it.caption: text_item(it.caption, keys.caption(it.caption)) for it in todo.values()}
    build_text(cache_dir, models, models.specs, list(captions.values()), keys.max_len, cb, {})
    control = models.family.control_images(models.variant)
    vae = models.load_vae().to(models.device)
    try:
        for i, (key, it) in enumerate(todo.items()):
            entry = load_file(str(text_dir / f"{captions[it.caption].text_key}.safetensors"))
            entry.update({k: v[0].float().cpu().to(models.dtype)
                          for k, v in control.encode_latents(vae, [_rgb(c) for c in it.controls]).items()})
            atomic_save(entry, text_dir / f"{key}.safetensors")
            cb.on_progress("encode control images (vae)", i + 1, len(todo))
    finally:
        del vae
        release_device_memory(models.device)
    stats["text_built"] = stats.get("text_built", 0) + len(todo)


@torch.no_grad()
def build_edit_entries(cache_dir: Path, family, variant: str, spec, pipeline, singles, items, device, dtype,
                       vae_loader, save, usable, cb, stats: dict) -> None:
    """Write the text entry (multimodal prompt + control latents) of every item whose entry is missing."""
    from ..models.dtypes import release_device_memory
    from .stacked_text import load_tokenizer
    from .vl_text import vision_language_parts

    text_dir = cache_dir / "text"
    todo: dict[str, object] = {}
    for it in items:
        if it.text_key not in todo and not usable(text_dir / f"{it.text_key}.safetensors", cb):
            todo[it.text_key] = it
    stats["text_reused"] = stats.get("text_reused", 0) + len({i.text_key for i in items}) - len(todo)
    if not todo:
        return
    control = family.control_images(variant)
    jobs = list(todo.items())
    files, config, tokenizer_dir, image_dir = vl_sources(family, spec, pipeline, singles, dtype)
    tokenizer = load_tokenizer(tokenizer_dir) if isinstance(tokenizer_dir, Path) else tokenizer_dir
    processor = make_processor(getattr(tokenizer, "tokenizer", tokenizer), image_dir)
    parts = vision_language_parts(files, config, device, dtype)
    prompts: list[torch.Tensor] = []
    try:
        for start in range(0, len(jobs), GROUP):
            group = [it for _, it in jobs[start:start + GROUP]]
            prompts += control.encode_prompts([it.caption for it in group],
                                              [[_rgb(c) for c in it.controls] for it in group], processor, parts,
                                              drop=spec.drop_tokens, dtype=dtype)
            cb.on_progress("encode instructions with control images (text_encoder)", len(prompts), len(jobs))
    finally:
        parts.close()
        del parts
        release_device_memory(device)
    vae = vae_loader().to(device)
    try:
        for i, (key, it) in enumerate(jobs):
            entry = {spec.cache_key: prompts[i]}
            entry.update({k: v[0].float().cpu().to(dtype)
                          for k, v in control.encode_latents(vae, [_rgb(c) for c in it.controls]).items()})
            save(entry, text_dir / f"{key}.safetensors")
            cb.on_progress("encode control images (vae)", i + 1, len(jobs))
    finally:
        del vae
        release_device_memory(device)
    stats["text_built"] = stats.get("text_built", 0) + len(jobs)
