"""The on-disk dataset cache: text embeddings and VAE latents, computed once.

Layout under ``cache_dir``::

    text/<key>.safetensors      one caption's embeddings (every encoder's output)
    latents/<key>.safetensors   one image's latent at its bucket size (+ flipped); for a video dataset, one
                                window's latent (C, F_lat, h, w): each window of a clip is its own entry
    datasets/<hash>.json        manifest: the items of one dataset + settings

An edit model (a text spec with ``control_images``: Qwen-Image-Edit) caches pairs: the target's latent as above, and
in its text entry the multimodal prompt plus the control images' latents (``edit_cache.py``).

Each item's key hashes what it depends on (encoder files + caption + length;
VAE files + image bytes + bucket + flip), so a rerun with the same inputs
reuses everything and a changed caption, image or model rebuilds just that.
Files are written to a temporary name and renamed, so an interrupted run never
leaves a half-written entry that looks complete.

``build_dataset_cache`` runs as named phases, each in its own module: sources (``model_sources``: the family and
its model files), records (``records/``: images, clip windows or edit pairs, the one source chosen once), keys
(``keys``), text and latent entries (``entries``; an edit model's text in ``edit_cache``), then the manifest (here,
beside ``open_dataset_cache`` that reads it back).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch
from safetensors.torch import load_file

from ..callbacks import TrainingCallback
from ..config import DataConfig, ModelConfig
from ..data import VideoConfig, expand_repeats, make_buckets
from ..data.options import DatasetOptions
from ..errors import CacheError, ConfigError
from ..fileio import write_json_atomic
from ..families import ModelFamily, get_family
from ..hashing import stable_hash
from .caption_entries import caption_entries
from .entries import build_latents, build_masks, build_text, negative_specs
from .items import CachedItem, SampleItems
from .keys import CacheKeys, cache_keys
from .task_choice import choose_task
from .model_sources import CacheModels, open_models, resolve_pipeline_folder
from .multi_resolution import other_sizes
from .records import record_source
from .single_files import load_vae_file
from .validation_split import regularization_items, validation_items

MANIFEST_VERSION = 1

__all__ = ["CachedItem", "DatasetCache", "MANIFEST_VERSION", "build_dataset_cache", "open_dataset_cache",
           "resolve_pipeline_folder"]


@dataclass
class DatasetCache:
    """Handle to a built cache (what flows on the LOWVRAM_DATASET edge)."""

    cache_dir: Path
    manifest_path: Path
    dataset_hash: str
    family: str
    variant: str
    items: list[CachedItem]
    repeats: int = 1
    flip: bool = False
    stats: dict = field(default_factory=dict)  # built/reused counts of the last build
    # Prompts for samples during training, encoded with the captions: [(prompt, text key)]
    sample_prompts: list = field(default_factory=list)
    # The empty prompt's text key, for families that sample with classifier-free guidance ("" if none).
    negative_text_key: str = ""
    # Where the VAE comes from (sampling decodes with it): a pipeline folder, or a single VAE file.
    pipeline: Optional[str] = None
    vae_file: Optional[str] = None
    # An edit dataset's per-prompt negatives (the empty instruction with that prompt's control images), parallel to
    # sample_prompts; empty for other families (they share ``negative_text_key``).
    sample_negative_keys: list = field(default_factory=list)
    # Each sample prompt's own settings from its line (--w --h ...: engine/sampling/prompt_lines.py), parallel to
    # sample_prompts; empty dicts: Train LoRA's settings.
    sample_settings: list = field(default_factory=list)
    # Held out of training (Dataset Options' validation split): cached like the items, never trained on.
    validation_items: list = field(default_factory=list)
    # Regularization images (Dataset Options' reg_folder): class images with their own captions, mixed into
    # training by LossOptions.reg_ratio.
    reg_items: list = field(default_factory=list)
    mask_source: str = "none"  # where the items' loss masks came from (engine/data/masks.py); "none": no masks
    caption_dropout: float = 0.0  # the chance a training item is given the empty caption (``empty_text_key``)
    empty_text_key: str = ""
    # Differential output preservation's class prompt (Dataset Options' preservation_prompt) and its text key; "": none.
    preservation_prompt: str = ""
    preservation_text_key: str = ""

    def negative_keys(self) -> list[str]:
        """The negative prompt's text key for each sample prompt ("" where the family samples without one)."""
        if self.sample_negative_keys:
            return list(self.sample_negative_keys)
        return [self.negative_text_key] * len(self.sample_prompts)

    def load_item(self, item: CachedItem, flipped: bool = False,
                  text_key: str | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(latent (C, h, w), or (C, F_lat, h, w) for a video window; {embedding name: tensor}) for one item;
        ``text_key``: another of its captions (``caption_key``) instead of the one as written."""
        lat = _load_entry(self.cache_dir / "latents" / f"{item.latent_key}.safetensors", item)
        text = _load_entry(self.cache_dir / "text" / f"{text_key or item.text_key}.safetensors", item)
        latent = lat["latent_flipped"] if flipped and "latent_flipped" in lat else lat["latent"]
        return latent, text | _conditioning(lat, flipped)

    @property
    def captions_vary(self) -> bool:
        return self.caption_dropout > 0 or any(i.text_variants for i in self.items)

    def caption_key(self, item: CachedItem, rng: torch.Generator) -> str:
        """The caption a training step gives ``item``: the empty one with probability ``caption_dropout``, else one
        of its cached orders (as written or shuffled), uniformly; drawn from ``rng``."""
        if self.caption_dropout > 0 and torch.rand(1, generator=rng).item() < self.caption_dropout:
            return self.empty_text_key
        keys = [item.text_key] + list(item.text_variants)
        return keys[int(torch.randint(0, len(keys), (1,), generator=rng))] if len(keys) > 1 else item.text_key

    def load_mask(self, item: CachedItem, flipped: bool = False) -> torch.Tensor | None:
        """The item's loss mask at its bucket's pixel size, (H, W) uint8 (a clip window's (F, H, W)), mirrored with its
        latent; None without masked loss. ``data.masks.latent_mask`` brings it to the latent grid."""
        if not item.mask_key:
            return None
        entry = _load_entry(self.cache_dir / "masks" / f"{item.mask_key}.safetensors", item)
        mask = entry["mask_flipped"] if flipped and "mask_flipped" in entry else entry["mask"]
        if item.frames and mask.shape[0] == 1 < len(item.frames):  # a clip's still mask: the same on every frame
            mask = mask.expand(len(item.frames), *mask.shape[1:])  # so a batch of windows stacks as (B, F, H, W)
        return mask

    def text_widths(self) -> dict[str, int]:
        """Last-axis width of each cached embedding, from the first caption entry's header."""
        from ..checkpoint import SafetensorsFile

        if not self.items:
            return {}
        entry = SafetensorsFile(self.cache_dir / "text" / f"{self.items[0].text_key}.safetensors")
        return {k: e.shape[-1] for k, e in entry.entries.items() if e.shape}

    def check_fits(self, family: ModelFamily, config: dict | None) -> None:
        """Refuse a cache made for another family or another text width, before the model loads
        (a Flux.2-dev cache, 15360 wide, on a klein 4B model, 7680 wide, would fail mid-forward)."""
        if family.id != self.family:
            raise ConfigError(
                f"the dataset cache was built for {self.family} but the model is {family.id}; "
                f"run Cache Text Embeds again with this model's text encoders")
        if not config:
            return
        variant = family.variant_for_config(config)
        if variant != "custom" and family.first_frame(variant) is not None and family.first_frame(self.variant) is None:
            raise ConfigError(
                f"the dataset cache was built for {self.family} {self.variant}, without the first-frame conditioning "
                f"this image-to-video model takes; run Cache Text Embeds again with this model")
        have = self.text_widths()
        for key, width in family.text_widths(config).items():
            if key in have and have[key] != width:
                raise ConfigError(
                    f"the dataset cache's '{key}' are {have[key]} wide ({self.family} {self.variant}), but this "
                    f"{family.display_name} model takes {width}; run Cache Text Embeds again with this model "
                    f"(and its own text encoder) so the cache matches")

    def training_items(self) -> list[CachedItem]:
        return expand_repeats(self.items, self.repeats)

    def load_text(self, text_key: str) -> dict[str, torch.Tensor]:
        """The cached embeddings of one caption or sample prompt as a batch of one (with its masks)."""
        path = self.cache_dir / "text" / f"{text_key}.safetensors"
        if not path.exists():
            raise CacheError(f"cache entry text/{text_key} is missing; rebuild the cache")
        return self.collate_text([load_file(str(path))])

    def collate_text(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Per-caption embeddings -> one batch. A ``variable`` encoder's captions (each cached at its own
        length) are zero-padded at the end to the batch's longest and get their mask (1 = a real token,
        ``TextEncoderSpec.mask_key``); the others are stacked as cached (padded to one length already)."""
        variable = {s.cache_key: s for s in get_family(self.family).text_encoder_specs(self.variant)
                    if s.length == "variable"}
        out = {}
        for key in rows[0]:
            tensors = [r.get(key) for r in rows]
            if key not in variable:
                shapes = {None if t is None else tuple(t.shape) for t in tensors}
                if len(shapes) > 1:  # control latents of other sizes, or an item without them
                    raise CacheError(f"one batch holds '{key}' of different shapes ({', '.join(map(str, shapes))}); "
                                     f"batches must group items by CachedItem.batch_key (for an edit dataset: equal "
                                     f"control-image counts and sizes); or train with batch_size 1")
                out[key] = torch.stack(tensors)
                continue
            longest = max(t.shape[0] for t in tensors)
            padded = tensors[0].new_zeros((len(tensors), longest) + tuple(tensors[0].shape[1:]))
            mask = torch.zeros(len(tensors), longest, dtype=torch.long)
            for i, t in enumerate(tensors):
                padded[i, : t.shape[0]] = t
                mask[i, : t.shape[0]] = 1
            out[key], out[variable[key].mask_key] = padded, mask
        return out

    def load_vae(self, family: ModelFamily, dtype: torch.dtype):
        """The VAE the latents were made with (sampling decodes with it), on the CPU."""
        if self.vae_file:
            return load_vae_file(Path(self.vae_file), family, dtype, self.variant)
        if self.pipeline:
            from .vae_encoding import load_vae

            return load_vae(Path(self.pipeline), dtype, family.vae_for(self.variant).class_name)
        raise CacheError(f"the dataset cache '{self.manifest_path}' does not say where its VAE is (built by an older "
                         f"version); rebuild it to sample during training")


def build_dataset_cache(
    model_cfg: ModelConfig,
    data_cfg: DataConfig,
    cache_dir: str | Path,
    max_sequence_length: int = 0,
    device: str = "auto",
    callback: TrainingCallback | None = None,
    sample_prompts: Sequence[str] = (),
    video: VideoConfig | None = None,
    control_dirs: Sequence[str | Path] = (),
    options: DatasetOptions | None = None,
) -> DatasetCache:
    """Scan the dataset, compute what is missing from the cache, write the manifest. ``sample_prompts`` are
    encoded with the captions (keyed the same way), for samples during training. ``video``: the folder holds
    clips (images count as one-frame clips) and each window of each clip is cached as one item.
    An edit model's dataset is pairs (``data.scan_pairs``): ``control_dirs`` are its control folders in order
    (empty: ``control/`` or ``controls/`` inside the dataset folder); sample prompt line i is drawn against pair
    i's control images (``edit_cache.py``). ``options`` (Dataset Options): loss masks, a held-out validation split.

    The phases, in order: sources (the model files), records (the dataset, through the one ``RecordSource`` the
    model takes), keys, the validation split, other sizes (multi-resolution), text entries, latent entries, masks,
    manifest."""
    cb = callback or TrainingCallback()
    cache_dir = Path(cache_dir)
    models = choose_task(open_models(model_cfg, device), video)  # sources (and text- or image-to-video)
    source = record_source(models, data_cfg, video, control_dirs, options)
    records = source.scan(cb.log)  # records: files and captions, before any model loads
    keys = cache_keys(models, max_sequence_length)  # keys
    buckets = make_buckets(data_cfg.resolution, data_cfg.bucket_step, data_cfg.max_aspect)
    items = source.items(records, buckets, keys, data_cfg.flip)
    items, held_out = validation_items(options, items, data_cfg,  # the validation split
                                       lambda cfg: record_source(models, cfg, video, control_dirs, options),
                                       buckets, keys, data_cfg.flip, cb.log)
    items = items + other_sizes(options, source, records, data_cfg, keys, held_out)  # multi-resolution
    reg = regularization_items(options, data_cfg, lambda cfg, opts: record_source(models, cfg, video, control_dirs,
                                                                                   opts),
                               buckets, keys, data_cfg.flip, cb.log)  # regularization images
    items, caption_texts, empty_key = caption_entries(options, items, keys)  # caption variants
    preserve = _preservation_item(options, keys)  # the class prompt (differential output preservation)
    lines = _prompt_lines(sample_prompts)
    samples = source.samples([line.prompt for line in lines], records, keys)
    own_negatives = _own_negatives(models, keys, lines, samples, cb)
    if any(not (cache_dir / "text" / f"{i.text_key}.safetensors").exists()
           or not (cache_dir / "latents" / f"{i.latent_key}.safetensors").exists() for i in items + held_out + reg):
        from .ram import check_caching_ram  # a model will load: its host RAM against the budget first

        check_caching_ram(models, cb)
    stats = {"text_built": 0, "text_reused": 0, "latents_built": 0, "latents_reused": 0}
    source.build_text(cache_dir, models, keys, items + held_out + reg + caption_texts + preserve, samples, cb,
                      stats)  # text
    if own_negatives:  # sample prompts' own negatives (--n), encoded as the empty prompt is
        build_text(cache_dir, models, negative_specs(models.specs), own_negatives, keys.max_len, cb, {})
    build_latents(cache_dir, models.family, items + held_out + reg, data_cfg.flip, models.device, models.dtype, cb, stats,
                  models.load_vae, models.variant, models.load_image_encoder)  # latent entries
    mask_source = options.mask_source if options is not None else "none"
    if mask_source != "none":
        build_masks(cache_dir, items + held_out, data_cfg.flip, mask_source, cb, stats)  # masks
    dropout = options.caption_dropout if options is not None else 0.0
    cache = _write_manifest(cache_dir, models, data_cfg, video, keys, items, samples, stats, held_out, mask_source,
                            (dropout, empty_key), lines, reg, preserve)
    extra = (f"; masks {stats['masks_built']} built / {stats['masks_reused']} reused" if mask_source != "none" else "")
    extra += f"; {len(held_out)} held out for validation" if held_out else ""
    extra += f"; {len(reg)} regularization images" if reg else ""
    cb.log(f"dataset cache {cache.dataset_hash}: {len(items)} {source.label}; text {stats['text_built']} built / "
           f"{stats['text_reused']} reused; latents {stats['latents_built']} built / {stats['latents_reused']} reused"
           + extra)
    return cache


def _preservation_item(options: DatasetOptions | None, keys: CacheKeys) -> list[CachedItem]:
    """The class prompt of differential output preservation as a text entry (keyed as a caption), or none."""
    from .items import text_item

    prompt = options.preservation_prompt.strip() if options is not None else ""
    return [text_item(prompt, keys.caption(prompt))] if prompt else []


def _prompt_lines(sample_prompts: Sequence[str]) -> list:
    """The sample prompt lines, each read with its options (``PromptLineError`` names a malformed one): blank lines
    and ``#`` comments out, a repeated line once."""
    from ..sampling.prompt_lines import is_comment, parse_prompt_line

    lines = dict.fromkeys(p.strip() for p in sample_prompts if p.strip() and not is_comment(p))
    return [parse_prompt_line(line) for line in lines]


def _own_negatives(models: CacheModels, keys: CacheKeys, lines: list, samples: SampleItems, cb) -> list[CachedItem]:
    """Lines with ``--n``: their negatives replace the shared empty prompt for those prompts (a family sampled with
    classifier-free guidance; others have no negative, and the option is said to be ignored)."""
    from .items import text_item

    if not any(line.negative for line in lines):
        return []
    if samples.shared_negative is None:
        if samples.negatives:
            raise ConfigError("--n (a negative prompt) on a sample prompt line is not supported for edit models: their "
                              "negatives carry each prompt's control images; remove --n")
        cb.log(f"--n on a sample prompt line is ignored: {models.family.display_name} ({models.variant}) samples "
               f"without a negative prompt")
        return []
    made = {}
    for line in lines:
        if line.negative:
            key = keys.negative_prompt(line.negative, models.specs)
            made.setdefault(key, text_item(line.negative, key))
    samples.negatives = [made[keys.negative_prompt(line.negative, models.specs)] if line.negative
                         else samples.shared_negative for line in lines]
    return list(made.values())


def _write_manifest(cache_dir: Path, models: CacheModels, data_cfg: DataConfig, video: VideoConfig | None,
                    keys: CacheKeys, items: list[CachedItem], samples: SampleItems, stats: dict,
                    held_out: list[CachedItem] = (), mask_source: str = "none",
                    dropout: tuple[float, str] = (0.0, ""), lines: list = (), reg: list = (),
                    preserve: list = ()) -> DatasetCache:
    """The manifest phase: the dataset's items and settings under ``datasets/<hash>.json`` (what
    ``open_dataset_cache`` reads back), and the handle to the built cache. Masks and a validation split enter the
    hash only when there are some: a dataset without them keeps the hash it had before they existed."""
    singles = models.singles
    extras = ([["masks", mask_source, [i.mask_key for i in items]]] if mask_source != "none" else []) + \
        ([["validation", [[i.text_key, i.latent_key, i.mask_key] for i in held_out]]] if held_out else []) + \
        ([["captions", list(dropout), [i.text_variants for i in items]]]
         if dropout[0] > 0 or any(i.text_variants for i in items) else []) + \
        ([["regularization", [[i.text_key, i.latent_key] for i in reg]]] if reg else []) + \
        ([["preservation", preserve[0].text_key]] if preserve else [])
    dataset_hash = stable_hash([[i.text_key, i.latent_key] for i in items] + [data_cfg.repeats, data_cfg.flip]
                               + extras)
    manifest_path = cache_dir / "datasets" / f"{dataset_hash}.json"
    negative = samples.shared_negative
    manifest = {
        "version": MANIFEST_VERSION, "dataset_hash": dataset_hash, "family": models.family.id,
        "variant": models.variant, "source": str(Path(data_cfg.path).resolve()),
        "pipeline": str(models.pipeline.resolve()) if singles is None else None,
        "single_files": None if singles is None else {k: str(v) for k, v in singles.text_encoders.items()}
        | {"vae": str(singles.vae)},
        "settings": asdict(data_cfg), "video": asdict(video) if video else None, "max_sequence_length": keys.max_len,
        "repeats": data_cfg.repeats,
        "flip": data_cfg.flip, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "items": [asdict(i) for i in items],
        "sample_prompts": [[p.caption, p.text_key] for p in samples.prompts],
        "negative_text_key": negative.text_key if negative is not None else "",
        "sample_negative_keys": [n.text_key for n in samples.negatives],
        "validation_items": [asdict(i) for i in held_out], "mask_source": mask_source,
        "caption_dropout": dropout[0], "empty_text_key": dropout[1],
        "sample_settings": [line.settings() for line in lines], "reg_items": [asdict(i) for i in reg],
        "preservation": [preserve[0].caption, preserve[0].text_key] if preserve else None,
    }
    write_json_atomic(manifest_path, manifest, "the dataset-cache manifest")
    return DatasetCache(cache_dir, manifest_path, dataset_hash, models.family.id, models.variant, items,
                        data_cfg.repeats, data_cfg.flip, stats, [(p.caption, p.text_key) for p in samples.prompts],
                        manifest["negative_text_key"], manifest["pipeline"],
                        str(singles.vae) if singles is not None else None, manifest["sample_negative_keys"],
                        validation_items=list(held_out), mask_source=mask_source, caption_dropout=dropout[0],
                        empty_text_key=dropout[1], sample_settings=manifest["sample_settings"], reg_items=list(reg),
                        preservation_prompt=preserve[0].caption if preserve else "",
                        preservation_text_key=preserve[0].text_key if preserve else "")


def _conditioning(entry: dict[str, torch.Tensor], flipped: bool) -> dict[str, torch.Tensor]:
    """What a latent entry holds beside the latent: an image-to-video window's first-frame conditioning
    (``FirstFrameCondition``), delivered with the text embeddings to ``model_inputs`` (the mirrored copy,
    ``<name>_flipped``, for a flipped item)."""
    own = {k: v for k, v in entry.items() if not k.startswith("latent") and not k.endswith("_flipped")}
    return {k: entry.get(f"{k}_flipped", v) if flipped else v for k, v in own.items()}


def _load_entry(path: Path, item: CachedItem) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as exc:
        raise CacheError(
            f"dataset-cache entry '{path}' (for '{item.image}') is unreadable ({type(exc).__name__}: {exc}); "
            f"run Cache Text Embeds again: it rebuilds unreadable entries"
        ) from None


def open_dataset_cache(manifest_path: str | Path) -> DatasetCache:
    """Re-open a built cache from its manifest (checks every entry is present)."""
    path = Path(manifest_path)
    try:
        m = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CacheError(f"cannot read cache manifest '{path}' ({exc}); rebuild the cache") from exc
    if m.get("version") != MANIFEST_VERSION:
        raise CacheError(f"cache manifest '{path}' has version {m.get('version')}, expected {MANIFEST_VERSION}; rebuild it")
    cache_dir = path.parent.parent
    items, held_out, reg = ([CachedItem(**{**i, "bucket": tuple(i["bucket"]), "frames": list(i.get("frames", []))})
                             for i in m.get(name, [])] for name in ("items", "validation_items", "reg_items"))
    negatives = list(m.get("sample_negative_keys", []))
    for it in items + held_out + reg:
        for sub, key in (("text", it.text_key), ("latents", it.latent_key)) + ((("masks", it.mask_key),)
                                                                              if it.mask_key else ()) \
                + tuple(("text", k) for k in it.text_variants):
            if not (cache_dir / sub / f"{key}.safetensors").exists():
                raise CacheError(f"cache entry {sub}/{key} for '{it.image}' is missing; rebuild the cache")
    prompts = [tuple(p) for p in m.get("sample_prompts", [])]
    negative = m.get("negative_text_key", "")
    empty = m.get("empty_text_key", "")
    preserve = m.get("preservation") or ["", ""]
    for _, key in prompts + ([("", negative)] if negative else []) + [("", k) for k in negatives] + \
            ([("", empty)] if empty else []) + ([tuple(preserve)] if preserve[1] else []):
        if not (cache_dir / "text" / f"{key}.safetensors").exists():
            raise CacheError(f"cache entry text/{key} (a sample prompt) is missing; rebuild the cache")
    return DatasetCache(cache_dir, path, m["dataset_hash"], m["family"], m["variant"], items, m["repeats"], m["flip"],
                        sample_prompts=prompts, negative_text_key=negative, pipeline=m.get("pipeline"),
                        vae_file=(m.get("single_files") or {}).get("vae"), sample_negative_keys=negatives,
                        validation_items=held_out, mask_source=m.get("mask_source", "none"),
                        caption_dropout=m.get("caption_dropout", 0.0), empty_text_key=m.get("empty_text_key", ""),
                        sample_settings=m.get("sample_settings", []), reg_items=reg,
                        preservation_prompt=preserve[0], preservation_text_key=preserve[1])
