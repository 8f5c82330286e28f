"""What a transformer checkpoint is (family, variant, config) and its tensors under diffusers names.

The forms accepted, all local:
- a diffusers folder (a pipeline folder or its ``transformer/``), one file or sharded
  (``*.safetensors.index.json``);
- a single ``.safetensors`` file with the original (BFL) names, as ComfyUI users keep in
  ``models/diffusion_models/``: bf16, fp16, fp32, fp8, scaled fp8, ComfyUI's fp8-mixed, with or
  without ``model.diffusion_model.`` prefixes. Fused tensors (qkv, linear1) resolve to row ranges,
  so each diffusers tensor is read on its own;
- a slab (``engine/slab``): told apart by its header, identified from it; read by the slab package.

Identification reads headers only and is done once per file state (memoized on path, size and
mtime): the Load node, the footprint before loading, the cache check and the loader all ask here.
Loading builds the model on the meta device and assigns every tensor decoded by ``TensorStore``,
so the weights exist once in RAM.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelLoadError
from ..families import ModelFamily, family_for_class_name, family_for_single_file, get_family, meta_model
from ..hashing import sampled_data_hash
from .files import SafetensorsFile, is_slab_file
from .tensors import DECODER_VERSION, TensorStore, is_side_tensor, open_files, refuse_unreadable_form

#: Wrapper prefixes transformer checkpoints carry in the wild (ComfyUI full checkpoints, trainers' exports).
KEY_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")


@dataclass(frozen=True)
class CheckpointIdentity:
    """What a transformer checkpoint is: resolved once, passed on (the LOWVRAM_MODEL edge carries it)."""

    kind: str  # "diffusers" | "single_file" | "slab"
    path: Path  # the transformer folder or the .safetensors file
    pipeline_folder: Path | None  # the enclosing diffusers pipeline folder, if any
    family: ModelFamily | None  # None for a slab: its manifest says, read by the slab package
    variant: str
    config: dict[str, Any] = field(default_factory=dict, compare=False)  # transformer config (empty for slabs)


def resolve_path(path: str | Path) -> tuple[str, Path, Path | None]:
    """(kind, transformer folder or file, pipeline folder) of a user-given path; kind "file" or "diffusers"."""
    p = Path(path).expanduser()
    if not str(path):
        raise ModelLoadError("no transformer path given; point it at a diffusers folder or a .safetensors file")
    if not p.exists():
        raise ModelLoadError(f"transformer path '{p}' does not exist; check the path (models go in models/diffusion_models/)")
    if p.is_file():
        refuse_unreadable_form(p, "the transformer")
        return "file", p, None
    if (p / "model_index.json").exists() and (p / "transformer" / "config.json").exists():
        return "diffusers", p / "transformer", p
    if (p / "config.json").exists():
        parent = p.parent if (p.parent / "model_index.json").exists() else None
        return "diffusers", p, parent
    raise ModelLoadError(
        f"'{p}' is a folder but neither a diffusers pipeline folder (model_index.json + transformer/) "
        f"nor a transformer folder (config.json); point at one of those or at a .safetensors file"
    )


_IDENTITIES: dict[tuple, CheckpointIdentity] = {}


def identify(path: str | Path, family_id: str = "auto") -> CheckpointIdentity:
    """Family, variant and config of any transformer checkpoint, from headers and config.json alone."""
    kind, p, pipeline = resolve_path(path)
    files = [p] if kind == "file" else [p / "config.json", *sorted(p.glob("*.safetensors*"))]
    memo = (str(p.resolve()), family_id, tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    found = _IDENTITIES.get(memo)
    if found is None:
        if kind == "diffusers":
            family, variant, config = _identify_diffusers(p, family_id)
            found = CheckpointIdentity("diffusers", p, pipeline, family, variant, config)
        elif is_slab_file(p):  # family and variant: from its manifest, checked by the slab package
            found = CheckpointIdentity("slab", p, None, None, "")
        else:
            family, variant, config = _identify_single_file(SafetensorsFile(p), family_id)
            found = CheckpointIdentity("single_file", p, None, family, variant, config)
        if len(_IDENTITIES) > 64:
            _IDENTITIES.clear()
        _IDENTITIES[memo] = found
    return found


# --- diffusers folder ---------------------------------------------------------------


def _identify_diffusers(folder: Path, family_id: str) -> tuple[ModelFamily, str, dict[str, Any]]:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"'{folder / 'config.json'}' is unreadable ({exc}); re-download the model") from None
    class_name = config.get("_class_name", "")
    family = family_for_class_name(class_name)
    if family is None or (family_id != "auto" and family.id != family_id):
        expected = get_family(family_id).display_name if family_id != "auto" else "a supported family"
        raise ModelLoadError(
            f"'{folder}' holds a {class_name or 'unknown'} model, expected {expected} "
            f"(config.json _class_name should be one of the registered families' classes)"
        )
    name = folder.parent.name if folder.name == "transformer" else folder.name
    return family, family.variant_from_name(family.variant_for_config(config), name), config


def shard_files(folder: Path) -> list[Path]:
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        weight_map = json.loads(indexes[0].read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        missing = [p.name for p in files if not p.exists()]
        if missing:
            raise ModelLoadError(
                f"'{indexes[0]}' lists shards that are missing: {', '.join(missing)}; re-download the model"
            )
        return files
    single = folder / "diffusion_pytorch_model.safetensors"
    files = [single] if single.exists() else sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"'{folder}' has no .safetensors weights (only safetensors are read, never pickles)")
    return files


# --- single file (original names) -----------------------------------------------------


def _identify_single_file(f: SafetensorsFile, family_id: str) -> tuple[ModelFamily, str, dict[str, Any]]:
    found = {n: s for n, s in TensorStore([f], KEY_PREFIXES).shapes().items()}
    detected = family_for_single_file(set(found))
    if family_id == "auto":
        if detected is None:
            some = ", ".join(sorted(found)[:3]) or "(no tensors)"
            from ..families import families

            raise ModelLoadError(
                f"'{f.path}' is not a checkpoint of a supported family ({', '.join(f.display_name for f in families().values())}"
                f"; first tensors in the file: {some}). Set the family explicitly to see what is missing"
            )
        family = detected
    else:
        family = get_family(family_id)
        if detected is not family:
            first = sorted(found)[0] if found else "(no tensors)"
            example = family.param_table(family.load_config(family.tiny_variant))[-1].name
            raise ModelLoadError(
                f"'{f.path}' is not a {family.display_name} checkpoint: expected {family.display_name}'s native tensor "
                f"names (such as '{example}'), first tensor in the file is '{first}'"
                + (f"; it looks like {detected.display_name}" if detected is not None else "")
            )
    keys = set(found)
    found = {n: s for n, s in found.items() if n not in family.unused_native_keys}
    matched, config = _match_variant(f.path, family, found)
    variant = family.variant_from_name(matched, f.path.name, keys)
    if variant != matched and variant in family.variants:  # told apart by name or flag: that variant's config
        config = family.load_config(variant)  # (the same shapes; Qwen-Image-Edit-2511's zero_cond_t differs)
        count, first = _first_mismatch(found, expected_single_file_shapes(family, config))
        if count:
            raise ModelLoadError(f"'{f.path}' is named like {family.display_name} {variant}, but its tensors do not "
                                 f"fit that variant ({count} mismatches, first: {first}); rename the file")
    return family, variant, config


def expected_single_file_shapes(family: ModelFamily, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Original name -> shape, derived from the diffusers model built on the meta device."""
    model = meta_model(family, config)
    diffusers_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    shapes = {}
    for param in family.param_table(config):
        parts = [diffusers_shapes[p.name] for p in param.parts]
        shapes[param.name] = (sum(s[0] for s in parts),) + parts[0][1:]
    return shapes


def _first_mismatch(found: dict[str, tuple], expected: dict[str, tuple]) -> tuple[int, str]:
    problems = []
    for name, shape in expected.items():
        if name not in found:
            problems.append(f"tensor '{name}' is missing (expected shape {list(shape)})")
        elif found[name] != shape:
            problems.append(f"tensor '{name}' has shape {list(found[name])}, expected {list(shape)}")
    problems += [f"unexpected tensor '{k}'" for k in sorted(k for k in found if k not in expected)]
    return len(problems), (problems[0] if problems else "")


def _match_variant(path: Path, family: ModelFamily, found: dict[str, tuple]):
    best = None
    for variant in family.variants:
        config = family.load_config(variant)
        count, first = _first_mismatch(found, expected_single_file_shapes(family, config))
        if count == 0:
            return variant, config
        if best is None or count < best[0]:
            best = (count, first, variant)
    raise ModelLoadError(
        f"'{path}' does not match any {family.display_name} variant "
        f"({', '.join(family.variants)}); closest is {best[2]} with {best[0]} mismatches, "
        f"first: {best[1]}. Is this a {family.display_name} checkpoint?"
    )


# --- the tensors, under diffusers names -------------------------------------------------


@dataclass(frozen=True)
class SourceTensor:
    """Where one diffusers tensor lives in the checkpoint."""

    name: str  # diffusers name ("transformer_blocks.0.attn.to_q.weight")
    source: str  # logical name in the store ("double_blocks.0.img_attn.qkv.weight")
    row_offset: int  # first row inside ``source`` (fused tensors hold several)
    shape: tuple[int, ...]  # diffusers shape
    dtype: torch.dtype  # as stored in the checkpoint
    scaled: bool = False  # a scale is multiplied in: reads come back as fp32
    swap_halves: bool = False  # BFL final modulation: (shift, scale) -> (scale, shift)

    @property
    def stored_float(self) -> torch.dtype:
        """What ``Checkpoint.read`` returns: the stored dtype, or fp32 when a scale has to be applied."""
        return torch.float32 if self.scaled else self.dtype


@dataclass
class Checkpoint:
    """A transformer checkpoint's identity plus every diffusers tensor, decoded on read."""

    identity: CheckpointIdentity
    store: TensorStore
    tensors: dict[str, SourceTensor]
    config_bytes: bytes = b""

    @property
    def kind(self) -> str:
        return self.identity.kind

    @property
    def path(self) -> Path:
        return self.identity.path

    @property
    def family(self) -> ModelFamily:
        return self.identity.family

    @property
    def variant(self) -> str:
        return self.identity.variant

    @property
    def config(self) -> dict[str, Any]:
        return self.identity.config

    @property
    def files(self) -> list[SafetensorsFile]:
        return self.store.files

    def read(self, name: str, row_start: int = 0, row_count: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of diffusers tensor ``name``, decoded (``stored_float`` dtype; ``out``: uint8 buffer to reuse)."""
        t = self.tensors[name]
        rows = t.shape[0] if t.shape else 1
        row_count = rows - row_start if row_count is None else row_count
        if t.swap_halves:  # small (2 x hidden rows): read whole, swap, slice
            a, b = self.store.read(t.source, t.row_offset, rows).chunk(2, dim=0)
            return torch.cat([b, a], dim=0)[row_start: row_start + row_count]
        x = self.store.read(t.source, t.row_offset + row_start, row_count, out=out)
        return x.reshape(()) if not t.shape else x

    def state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Every diffusers tensor decoded and cast to ``dtype`` (floating ones), one at a time."""
        out = {}
        for name in self.tensors:
            x = self.read(name)
            out[name] = x.to(dtype) if x.is_floating_point() else x
        return out

    def load_model(self, dtype: torch.dtype) -> torch.nn.Module:
        """The family's transformer on the CPU in ``dtype``: built on the meta device, every tensor assigned."""
        model = meta_model(self.family, self.config)
        expected = model.state_dict()
        missing = sorted(set(expected) - set(self.tensors))
        wrong = [k for k, v in expected.items() if k in self.tensors and tuple(v.shape) != self.tensors[k].shape]
        if missing or wrong:
            first = f"'{missing[0]}' is missing" if missing else f"'{wrong[0]}' has the wrong shape"
            raise ModelLoadError(f"'{self.path}' does not fit {self.family.display_name} ({self.variant}): "
                                 f"{len(missing)} tensors missing, {len(wrong)} of the wrong shape; first: {first}")
        extra = sorted(set(self.tensors) - set(expected))
        if extra:
            raise ModelLoadError(f"'{self.path}' has {len(extra)} tensors {self.family.display_name} does not use, "
                                 f"first '{extra[0]}'; is this a {self.family.display_name} checkpoint?")
        model.load_state_dict(self.state_dict(dtype), strict=True, assign=True)
        model.requires_grad_(False)
        return model.eval()

    def fingerprint(self) -> dict[str, Any]:
        """Sizes, header hashes and sampled data: identifies the weights without reading them.

        ``key`` leaves out the path, so a moved checkpoint still finds its slab; it includes the decoder
        version when a decoding rule that changed applies to this file, so a slab built under the old rule
        is not reused (``legacy_key`` is the key the older rules gave)."""
        files = [{"name": f.path.name, "size": f.size, "header_sha256": f.header_sha256} for f in self.files]
        config_sha = hashlib.sha256(self.config_bytes).hexdigest() if self.config_bytes else None
        # Sampled data too: a fine-tune saved like its base has the same headers and sizes.
        ident = [[f["size"], f["header_sha256"], _sampled(f_obj)] for f, f_obj in zip(files, self.files)] + [config_sha]
        legacy = hashlib.sha256(json.dumps(ident).encode()).hexdigest()
        if any(t.scale_rule == "weight_scale" for t in self.store.entries.values()):
            ident.append({"decoder": DECODER_VERSION})
        headers = hashlib.sha256(b"".join(f.header_bytes for f in self.files)).hexdigest()
        return {
            "kind": self.kind,
            "path": str(self.path.resolve()),
            "size": sum(f["size"] for f in files),
            "header_sha256": headers,
            "files": files,
            "config_sha256": config_sha,
            "decoder_version": DECODER_VERSION,
            "key": hashlib.sha256(json.dumps(ident).encode()).hexdigest(),
            "legacy_key": legacy,
        }

    @property
    def stem(self) -> str:
        """A readable name for a slab file: the checkpoint's file or folder name."""
        p = self.path
        if self.kind == "diffusers" and p.name == "transformer":
            p = p.parent
        return p.name.removesuffix(".safetensors")


def open_checkpoint(path: str | Path | CheckpointIdentity, family_id: str = "auto") -> Checkpoint:
    """Any transformer checkpoint as diffusers tensors; reads headers only. Slabs are refused here
    (they are loaded by ``engine/slab``)."""
    ident = path if isinstance(path, CheckpointIdentity) else identify(path, family_id)
    if ident.kind == "slab":
        raise ModelLoadError(f"'{ident.path}' is already a slab; load it directly, or build from the original checkpoint")
    if ident.kind == "diffusers":
        config_bytes = (ident.path / "config.json").read_bytes()
        store = TensorStore(open_files(shard_files(ident.path), "the transformer"), KEY_PREFIXES)
        tensors = {n: SourceTensor(n, n, 0, e.shape, e.dtype, e.scale_key is not None)
                   for n, e in store.entries.items()}
        return Checkpoint(ident, store, tensors, config_bytes)
    store = TensorStore(open_files([ident.path], "the transformer"), KEY_PREFIXES)
    tensors: dict[str, SourceTensor] = {}
    for param in ident.family.param_table(ident.config):
        e = store.entries[param.name]
        for part in param.parts:
            fused = len(param.parts) > 1
            rows = part.rows if fused else e.shape[0]
            tensors[part.name] = SourceTensor(part.name, param.name, part.offset if fused else 0,
                                              (rows,) + e.shape[1:], e.dtype, e.scale_key is not None,
                                              param.swap_halves)
    return Checkpoint(ident, store, tensors)


def _sampled(f: SafetensorsFile) -> str:
    with open(f.path, "rb") as fh:
        return sampled_data_hash(fh, 8 + len(f.header_bytes), f.size).hex()


__all__ = ["Checkpoint", "CheckpointIdentity", "KEY_PREFIXES", "SourceTensor", "expected_single_file_shapes",
           "identify", "is_side_tensor", "open_checkpoint", "resolve_path", "shard_files"]
