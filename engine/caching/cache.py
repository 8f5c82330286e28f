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
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch
from safetensors.torch import load_file, save_file

from ..callbacks import TrainingCallback
from ..config import DataConfig, ModelConfig
from ..data import (VideoConfig, assign_bucket, clip_content_hash, expand_repeats, load_clip_tensor, load_image_tensor,
                    make_buckets, scan_dataset, scan_video_dataset)
from ..errors import CacheError, ConfigError, ModelLoadError
from ..fileio import atomic_write, write_json_atomic
from ..families import ModelFamily, default_max_sequence_length, get_family
from ..checkpoint import SafetensorsFile, identify, resolve_path
from ..models import resolve_device, resolve_dtype
from ..hashing import path_identity, sha256_file, stable_hash
from .encoders import encoder_kind
from .single_files import load_vae_file, sources_for
from .vae_encoding import encode_images

MANIFEST_VERSION = 1


@dataclass
class CachedItem:
    image: str
    caption: str
    bucket: tuple[int, int]  # (width, height) in pixels
    text_key: str
    latent_key: str
    # A video dataset's window: the clip's source frame indices (presentation order); empty for an image
    # dataset. Batches must group by (bucket, len(frames)), the frame count being the second bucket axis.
    frames: list[int] = field(default_factory=list)
    # An edit dataset's control images (in the model's order) and their (width, height) at the reference area;
    # empty otherwise. Their latents live in the text entry; batches group by control_sizes too.
    controls: list[str] = field(default_factory=list)
    control_sizes: list[list[int]] = field(default_factory=list)

    def batch_key(self) -> tuple:
        """Items of one key stack into one batch: the bucket, the frame count, the control latents' shapes."""
        return self.bucket, len(self.frames), tuple(tuple(s) for s in self.control_sizes)


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

    def negative_keys(self) -> list[str]:
        """The negative prompt's text key for each sample prompt ("" where the family samples without one)."""
        if self.sample_negative_keys:
            return list(self.sample_negative_keys)
        return [self.negative_text_key] * len(self.sample_prompts)

    def load_item(self, item: CachedItem, flipped: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(latent (C, h, w), or (C, F_lat, h, w) for a video window; {embedding name: tensor}) for one item."""
        lat = _load_entry(self.cache_dir / "latents" / f"{item.latent_key}.safetensors", item)
        text = _load_entry(self.cache_dir / "text" / f"{item.text_key}.safetensors", item)
        latent = lat["latent_flipped"] if flipped and "latent_flipped" in lat else lat["latent"]
        return latent, text

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


def resolve_pipeline_folder(model_cfg: ModelConfig) -> Path:
    """The diffusers pipeline folder whose text encoders, tokenizers and VAE we use."""
    if model_cfg.pipeline_path:
        folder = Path(model_cfg.pipeline_path).expanduser()
        if not (folder / "model_index.json").exists():
            raise ModelLoadError(
                f"pipeline_path '{folder}' is not a diffusers pipeline folder (no model_index.json); "
                f"it must hold text_encoder*/, tokenizer*/ and vae/"
            )
        return folder
    _, _, pipeline = resolve_path(model_cfg.transformer_path)
    if pipeline is None:
        raise ModelLoadError(
            f"'{model_cfg.transformer_path}' is a single transformer file; caching also needs the text encoders, "
            f"tokenizers and VAE of a diffusers pipeline folder (text_encoder*/, tokenizer*/, vae/). In Cache Text "
            f"Embeds, set text_encoders to a folder under models/diffusers (e.g. diffusers/FLUX.1-dev); "
            f"from Python, set ModelConfig.pipeline_path"
        )
    return pipeline


def _single_file_sources(model_cfg: ModelConfig):
    """(SingleFileSources, family, variant) for caching from single files (no pipeline folder);
    the family and variant come from the transformer itself."""
    ident = identify(model_cfg.transformer_path, model_cfg.family)
    family, variant = ident.family, ident.variant
    files = [Path(p) for p in model_cfg.text_encoder_files]
    vae = Path(model_cfg.vae_file) if model_cfg.vae_file else None
    singles = sources_for(family, variant, files, vae, {k: Path(v) for k, v in (model_cfg.tokenizer_dirs or {}).items()})
    return singles, family, variant


def _family_and_variant(model_cfg: ModelConfig, pipeline: Path) -> tuple[ModelFamily, str]:
    if (pipeline / "transformer" / "config.json").exists():
        ident = identify(pipeline / "transformer", model_cfg.family)
        return ident.family, ident.variant
    if model_cfg.family == "auto":
        raise ModelLoadError(f"cannot tell the model family of '{pipeline}'; set family explicitly")
    return get_family(model_cfg.family), "custom"


def _load_entry(path: Path, item: CachedItem) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as exc:
        raise CacheError(
            f"dataset-cache entry '{path}' (for '{item.image}') is unreadable ({type(exc).__name__}: {exc}); "
            f"run Cache Text Embeds again: it rebuilds unreadable entries"
        ) from None


def _usable(path: Path, cb: TrainingCallback) -> bool:
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
        problem = f"{type(exc).__name__}: {exc}"
    cb.log(f"dataset-cache entry '{path}' is unreadable ({problem}); rebuilding it")
    path.unlink(missing_ok=True)
    return False


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    with atomic_write(path, "a dataset-cache entry") as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


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
) -> DatasetCache:
    """Scan the dataset, compute what is missing from the cache, write the manifest. ``sample_prompts`` are
    encoded with the captions (keyed the same way), for samples during training. ``video``: the folder holds
    clips (images count as one-frame clips) and each window of each clip is cached as one item.
    An edit model's dataset is pairs (``data.scan_pairs``): ``control_dirs`` are its control folders in order
    (empty: ``control/`` or ``controls/`` inside the dataset folder); sample prompt line i is drawn against pair
    i's control images (``edit_cache.py``)."""
    cb = callback or TrainingCallback()
    cache_dir = Path(cache_dir)
    dev = resolve_device(device)
    dtype = resolve_dtype(model_cfg.dtype, dev)
    singles = None
    if model_cfg.text_encoder_files or model_cfg.vae_file:
        pipeline = None  # every encoder and the VAE come from singles
        singles, family, variant = _single_file_sources(model_cfg)
    else:
        pipeline = resolve_pipeline_folder(model_cfg)
        family, variant = _family_and_variant(model_cfg, pipeline)
    edit = any(s.control_images for s in family.text_encoder_specs(variant))
    pairs = []
    if edit:
        if video:
            raise ConfigError(f"{family.display_name} ({variant}) is an image edit model; it takes no video dataset")
        if data_cfg.flip:  # a flipped target with unflipped controls would teach the LoRA to mirror the image
            raise ConfigError(f"flip is not supported for an edit model ({family.display_name} {variant}): the "
                              f"target would be mirrored but not its control images; turn flip off")
        from ..data.pairs import scan_pairs

        pairs = scan_pairs(data_cfg, control_dirs, max_controls=family.control_images(variant).max_count,
                           log=cb.log)
        records = [p.target for p in pairs]
    elif control_dirs:
        raise ConfigError(f"control folders were given but {family.display_name} ({variant}) is not an edit model; "
                          f"clear control_folder, or load a Qwen-Image-Edit file")
    else:
        records = scan_video_dataset(data_cfg, video, log=cb.log) if video else scan_dataset(data_cfg, log=cb.log)
    buckets = make_buckets(data_cfg.resolution, data_cfg.bucket_step, data_cfg.max_aspect)
    max_len = max_sequence_length or default_max_sequence_length(family, variant)

    specs = family.text_encoder_specs(variant)

    def encoder_ident(s) -> list:
        kind = encoder_kind(s.kind)
        if singles is not None:  # the file (content identity) and its tokenizer
            f = singles.text_encoders[s.subfolder]
            return [s.subfolder, path_identity(f), kind.tokenizer_identity(f, s, singles), kind.output]
        return [s.subfolder, path_identity(pipeline / s.subfolder), path_identity(pipeline / s.tokenizer_subfolder),
                kind.output]

    text_ident = stable_hash([encoder_ident(s) + encoder_kind(s.kind).cache_identity(s) for s in specs]
                             + [max_len, str(dtype)])
    vae_spec = family.vae_for(variant)
    vae_ident = stable_hash([path_identity(singles.vae if singles is not None else pipeline / "vae"), str(dtype)]
                            + ([vae_spec.class_name] if vae_spec.class_name != "AutoencoderKL" else []))

    items = _dataset_items(records, buckets, text_ident, vae_ident, data_cfg.flip, video is not None)
    lines = list(dict.fromkeys(p.strip() for p in sample_prompts if p.strip()))
    if edit:
        from . import edit_cache

        items = edit_cache.attach_controls(items, pairs, text_ident, vae_ident, family, variant)
        prompts, edit_negatives = edit_cache.sample_items(lines, pairs, text_ident, vae_ident, family, variant,
                                                          CachedItem)
    else:
        prompts = [CachedItem(image="", caption=p, bucket=(0, 0), text_key=stable_hash([text_ident, p]),
                              latent_key="") for p in lines]
    # Classifier-free guidance samples against the empty prompt, tokenized as the family's pipeline does it
    # (``negative_template``; Lumina 2 leaves out its system prompt): encoded with its own specs.
    from dataclasses import replace

    negative_specs = tuple(replace(s, template=s.negative_template) if s.negative_template else s for s in specs)
    negative = ([CachedItem(image="", caption="", bucket=(0, 0), latent_key="",
                            text_key=stable_hash([text_ident, "", [repr(s.negative_template) for s in specs]]))]
                if prompts and family.guidance(variant).mode == "cfg" and not edit else [])
    stats = {"text_built": 0, "text_reused": 0, "latents_built": 0, "latents_reused": 0}
    if edit:
        from . import edit_cache

        sample_negatives = edit_negatives if family.guidance(variant).mode == "cfg" else []
        vae_loader = ((lambda: load_vae_file(singles.vae, family, dtype, variant)) if singles is not None else
                      (lambda: _pipeline_vae(pipeline, dtype, vae_spec.class_name)))
        edit_cache.build_edit_entries(cache_dir, family, variant, specs[0], pipeline, singles,
                                      items + prompts + sample_negatives, dev, dtype, vae_loader, _atomic_save,
                                      _usable, cb, stats)
    else:
        sample_negatives = []
        _build_text(cache_dir, family, specs, pipeline, items + prompts, dev, dtype, max_len, cb, stats, singles)
    if negative:
        _build_text(cache_dir, family, negative_specs, pipeline, negative, dev, dtype, max_len, cb, {}, singles)
    _build_latents(cache_dir, family, pipeline, items, data_cfg.flip, dev, dtype, cb, stats, singles, variant)

    dataset_hash = stable_hash([[i.text_key, i.latent_key] for i in items] + [data_cfg.repeats, data_cfg.flip])
    manifest_path = cache_dir / "datasets" / f"{dataset_hash}.json"
    manifest = {
        "version": MANIFEST_VERSION, "dataset_hash": dataset_hash, "family": family.id, "variant": variant,
        "source": str(Path(data_cfg.path).resolve()),
        "pipeline": str(pipeline.resolve()) if singles is None else None,
        "single_files": None if singles is None else {k: str(v) for k, v in singles.text_encoders.items()}
        | {"vae": str(singles.vae)},
        "settings": asdict(data_cfg), "video": asdict(video) if video else None, "max_sequence_length": max_len,
        "repeats": data_cfg.repeats,
        "flip": data_cfg.flip, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "items": [asdict(i) for i in items],
        "sample_prompts": [[p.caption, p.text_key] for p in prompts],
        "negative_text_key": negative[0].text_key if negative else "",
        "sample_negative_keys": [n.text_key for n in sample_negatives],
    }
    write_json_atomic(manifest_path, manifest, "the dataset-cache manifest")
    cb.log(
        f"dataset cache {dataset_hash}: {len(items)} {'clip windows' if video else 'images'}; "
        f"text {stats['text_built']} built / "
        f"{stats['text_reused']} reused; latents {stats['latents_built']} built / {stats['latents_reused']} reused"
    )
    return DatasetCache(cache_dir, manifest_path, dataset_hash, family.id, variant, items,
                        data_cfg.repeats, data_cfg.flip, stats, [(p.caption, p.text_key) for p in prompts],
                        manifest["negative_text_key"], manifest["pipeline"],
                        str(singles.vae) if singles is not None else None, manifest["sample_negative_keys"])


def _pipeline_vae(pipeline: Path, dtype: torch.dtype, class_name: str):
    from .vae_encoding import load_vae

    return load_vae(pipeline, dtype, class_name)


def _dataset_items(records, buckets, text_ident: str, vae_ident: str, flip: bool, video: bool) -> list[CachedItem]:
    """One item per image (``ImageRecord``) or per clip window (``ClipRecord``), keyed by what it depends on."""
    items = []
    content: dict[Path, str] = {}  # a clip's windows share one content hash
    for rec in records:
        bucket = assign_bucket(rec.width, rec.height, buckets)
        source = rec.path if video else rec.image_path
        if source not in content:
            content[source] = clip_content_hash(source) if video else sha256_file(source)
        frames = list(rec.frames) if video else []
        items.append(CachedItem(
            image=str(source), caption=rec.caption, bucket=tuple(bucket),
            text_key=stable_hash([text_ident, rec.caption]),
            latent_key=stable_hash([vae_ident, content[source], list(bucket), flip]
                                   + ([frames] if video else [])),  # image keys as before: their caches stay valid
            frames=frames,
        ))
    return items


def _build_text(cache_dir, family, specs, pipeline, items, device, dtype, max_len, cb, stats, singles=None) -> None:
    text_dir = cache_dir / "text"
    todo: dict[str, str] = {}
    for it in items:
        if it.text_key not in todo and not _usable(text_dir / f"{it.text_key}.safetensors", cb):
            todo.setdefault(it.text_key, it.caption)
    stats["text_reused"] = len({i.text_key for i in items}) - len(todo)
    if not todo:
        return
    keys, captions = list(todo), list(todo.values())
    per_encoder = {}
    for spec in specs:
        kind = encoder_kind(spec.kind)
        stage = f"encode captions ({spec.subfolder})"
        per_encoder[spec.cache_key] = kind.encode(pipeline, singles, family, spec, captions, device, dtype,
                                                  kind.caption_length(spec, max_len),
                                                  progress=lambda d, t, s=stage: cb.on_progress(s, d, t))
    for i, key in enumerate(keys):
        _atomic_save({name: outs[i] for name, outs in per_encoder.items()}, text_dir / f"{key}.safetensors")
    stats["text_built"] = len(keys)


def _build_latents(cache_dir, family, pipeline, items, flip, device, dtype, cb, stats, singles=None,
                   variant=None) -> None:
    lat_dir = cache_dir / "latents"
    todo = {}
    for it in items:
        if it.latent_key not in todo and not _usable(lat_dir / f"{it.latent_key}.safetensors", cb):
            todo.setdefault(it.latent_key, it)
    stats["latents_reused"] = len({i.latent_key for i in items}) - len(todo)
    if not todo:
        return
    jobs = [(it, False) for it in todo.values()] + ([(it, True) for it in todo.values()] if flip else [])
    images = (_pixels(it, f) for it, f in jobs)
    latents = encode_images(pipeline, family, images, len(jobs), device, dtype,
                            vae_loader=(lambda: load_vae_file(singles.vae, family, dtype, variant)) if singles else None,
                            progress=lambda d, t: cb.on_progress("encode images (vae)", d, t), variant=variant)
    n = len(todo)
    for i, (key, it) in enumerate(todo.items()):
        tensors = {"latent": latents[i]}
        if flip:
            tensors["latent_flipped"] = latents[n + i]
        _atomic_save(tensors, lat_dir / f"{key}.safetensors", metadata={"image": it.image})
    stats["latents_built"] = n


def _pixels(item: CachedItem, flip: bool) -> torch.Tensor:
    """What the VAE encodes for one item: (3, H, W) for an image, (3, F, H, W) for a video window."""
    if item.frames:
        return load_clip_tensor(Path(item.image), item.frames, item.bucket, flip=flip)
    return load_image_tensor(Path(item.image), item.bucket, flip=flip)


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
    items = [CachedItem(**{**i, "bucket": tuple(i["bucket"]), "frames": list(i.get("frames", []))})
             for i in m["items"]]
    negatives = list(m.get("sample_negative_keys", []))
    for it in items:
        for sub, key in (("text", it.text_key), ("latents", it.latent_key)):
            if not (cache_dir / sub / f"{key}.safetensors").exists():
                raise CacheError(f"cache entry {sub}/{key} for '{it.image}' is missing; rebuild the cache")
    prompts = [tuple(p) for p in m.get("sample_prompts", [])]
    negative = m.get("negative_text_key", "")
    for _, key in prompts + ([("", negative)] if negative else []) + [("", k) for k in negatives]:
        if not (cache_dir / "text" / f"{key}.safetensors").exists():
            raise CacheError(f"cache entry text/{key} (a sample prompt) is missing; rebuild the cache")
    return DatasetCache(cache_dir, path, m["dataset_hash"], m["family"], m["variant"], items, m["repeats"], m["flip"],
                        sample_prompts=prompts, negative_text_key=negative, pipeline=m.get("pipeline"),
                        vae_file=(m.get("single_files") or {}).get("vae"), sample_negative_keys=negatives)
