"""Checkpoints as a slab build sees them: every diffusers tensor, where its rows are.

One name map for every source form:
- single file with BFL names (optionally ``model.diffusion_model.``-prefixed, bf16,
  fp16, fp32, fp8, or scaled fp8 with ``.scale_weight``): fused BFL tensors
  (qkv, linear1) resolve to row ranges, so each diffusers Linear is read on its own;
- diffusers folder, one file or sharded (``*.safetensors.index.json``);
- adapter-renamed keys (``.base_layer.`` inserted by peft) map to the plain name.

Nothing here loads a whole tensor it does not need: reads are row ranges through
seek + readinto.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelLoadError
from ..families import ModelFamily, family_for_class_name, family_for_single_file, get_family
from ..models.transformer_loading import _is_ignorable, _match_variant, _variant_for_config, resolve_transformer_source
from .format import SLAB_FORMAT, SafetensorsFile

# Prefixes single files and exported state dicts carry in the wild; stripped first.
KEY_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")


def canonical_key(key: str) -> str:
    """A checkpoint key without wrapper prefixes or peft's ``.base_layer`` segment."""
    for prefix in KEY_PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix):]
            break
    return key.replace(".base_layer.", ".")


@dataclass(frozen=True)
class SourceTensor:
    """Where one diffusers tensor lives in the checkpoint."""

    name: str  # diffusers name ("transformer_blocks.0.attn.to_q.weight")
    file: SafetensorsFile
    key: str  # key in that file ("double_blocks.0.img_attn.qkv.weight")
    row_offset: int  # first row inside ``key`` (fused BFL tensors hold several)
    shape: tuple[int, ...]  # diffusers shape
    dtype: torch.dtype  # as stored in the checkpoint
    scale_key: str | None = None  # scaled fp8: per-tensor scale to multiply in
    swap_halves: bool = False  # BFL final modulation: (shift, scale) -> (scale, shift)

    @property
    def stored_float(self) -> torch.dtype:
        """What ``read`` returns: stored dtype, or fp32 when a scale has to be applied."""
        return torch.float32 if self.scale_key else self.dtype


@dataclass
class Checkpoint:
    kind: str  # "single_file" | "diffusers"
    path: Path
    family: ModelFamily
    variant: str
    config: dict[str, Any]
    tensors: dict[str, SourceTensor]
    files: list[SafetensorsFile] = field(default_factory=list)
    config_bytes: bytes = b""

    def read(self, name: str, row_start: int = 0, row_count: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of diffusers tensor ``name`` in ``stored_float`` dtype (``out``: uint8 buffer to reuse)."""
        t = self.tensors[name]
        rows = t.shape[0] if t.shape else 1
        row_count = rows - row_start if row_count is None else row_count
        if t.swap_halves:  # small (2 x hidden rows): read whole, swap, slice
            whole = t.file.read(t.key, t.row_offset, rows)
            a, b = whole.chunk(2, dim=0)
            x = torch.cat([b, a], dim=0)[row_start: row_start + row_count]
        else:
            x = t.file.read(t.key, t.row_offset + row_start, row_count, out=out)
        if not t.shape:
            x = x.reshape(())
        if t.scale_key is not None:
            scale = t.file.read(t.scale_key).to(torch.float32).reshape(())
            x = x.to(torch.float32) * scale
        return x

    def fingerprint(self) -> dict[str, Any]:
        """Path, sizes and header hashes: identifies the weights without reading them.

        ``key`` leaves out the path, so a moved checkpoint still finds its slab.
        """
        files = [
            {"name": f.path.name, "size": f.size, "header_sha256": f.header_sha256} for f in self.files
        ]
        config_sha = hashlib.sha256(self.config_bytes).hexdigest() if self.config_bytes else None
        # Sampled data too: a fine-tune saved like its base has the same headers and sizes.
        ident = [[f["size"], f["header_sha256"], _sampled(f_obj.path, len(f_obj.header_bytes))]
                 for f, f_obj in zip(files, self.files)] + [config_sha]
        headers = hashlib.sha256(b"".join(f.header_bytes for f in self.files)).hexdigest()
        return {
            "kind": self.kind,
            "path": str(self.path.resolve()),
            "size": sum(f["size"] for f in files),
            "header_sha256": headers,
            "files": files,
            "config_sha256": config_sha,
            "key": hashlib.sha256(json.dumps(ident).encode()).hexdigest(),
        }

    @property
    def stem(self) -> str:
        """A readable name for the slab file: the checkpoint's file or folder name."""
        p = self.path
        if self.kind == "diffusers" and p.name == "transformer":
            p = p.parent
        return p.name.removesuffix(".safetensors")


def open_checkpoint(path: str | Path, family_id: str = "auto") -> Checkpoint:
    """Resolve any checkpoint the engine loads into a tensor map; reads headers only."""
    source = resolve_transformer_source(path)
    if source.kind == "diffusers":
        return _open_diffusers(source.path, family_id)
    return _open_single_file(source.path, family_id)


def _open_single_file(path: Path, family_id: str) -> Checkpoint:
    f = SafetensorsFile(path)
    if f.metadata.get("format") == SLAB_FORMAT:
        raise ModelLoadError(f"'{path}' is already a slab; load it directly, or build from the original checkpoint")
    names = {canonical_key(k): k for k in f.entries}
    found = {k: f.entries[v].shape for k, v in names.items()}
    detected = family_for_single_file(set(found))
    family = detected if family_id == "auto" else get_family(family_id)
    if detected is None or detected is not family:
        some = ", ".join(sorted(found)[:3]) or "(no tensors)"
        raise ModelLoadError(
            f"'{path}' is not a {'supported' if family_id == 'auto' else family.display_name} checkpoint "
            f"(expected BFL names such as 'double_blocks.0.img_attn.qkv.weight'; first tensors: {some})"
        )
    variant, config = _match_variant(path, family, found)
    tensors: dict[str, SourceTensor] = {}
    for param in family.param_table(config):
        key = names[param.name]
        entry = f.entries[key]
        scale_key = None
        if param.name.endswith(".weight"):
            scale_key = names.get(param.name[: -len(".weight")] + ".scale_weight")
        for part in param.parts:
            rows = entry.shape[0] if len(param.parts) == 1 else part.rows
            tensors[part.name] = SourceTensor(
                part.name, f, key, 0 if len(param.parts) == 1 else part.offset, (rows,) + entry.shape[1:],
                entry.dtype, scale_key, param.swap_halves,
            )
    return Checkpoint("single_file", path, family, variant, config, tensors, [f])


def _shard_files(folder: Path) -> list[Path]:
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


def _open_diffusers(folder: Path, family_id: str) -> Checkpoint:
    config_bytes = (folder / "config.json").read_bytes()
    config = json.loads(config_bytes)
    class_name = config.get("_class_name", "")
    family = family_for_class_name(class_name)
    if family is None or (family_id != "auto" and family.id != family_id):
        expected = get_family(family_id).display_name if family_id != "auto" else "a supported family"
        raise ModelLoadError(f"'{folder}' holds a {class_name or 'unknown'} model, expected {expected}")
    files = [SafetensorsFile(p) for p in _shard_files(folder)]
    tensors: dict[str, SourceTensor] = {}
    for f in files:
        for key, entry in f.entries.items():
            name = canonical_key(key)
            if _is_ignorable(name):
                continue
            if name in tensors:
                raise ModelLoadError(f"'{folder}': tensor '{name}' appears in two files ({tensors[name].file.path.name}, {f.path.name})")
            tensors[name] = SourceTensor(name, f, key, 0, entry.shape, entry.dtype)
    return Checkpoint("diffusers", folder, family, _variant_for_config(family, config), config, tensors, files, config_bytes)


def _sampled(path: Path, header_len: int) -> str:
    from ..caching.hashing import sampled_data_hash

    with open(path, "rb") as f:
        return sampled_data_hash(f, 8 + header_len, path.stat().st_size).hex()
