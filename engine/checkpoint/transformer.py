"""What a transformer checkpoint is (family, variant, config) and its tensors under diffusers names.

The forms accepted, all local, are the kinds in ``kinds/`` (one file each):
- a diffusers folder (a pipeline folder or its ``transformer/``), one file or sharded
  (``*.safetensors.index.json``);
- a single ``.safetensors`` file with the original (BFL) names, as ComfyUI users keep in
  ``models/diffusion_models/``: bf16, fp16, fp32, fp8, scaled fp8, ComfyUI's fp8-mixed, with or
  without ``model.diffusion_model.`` prefixes. Fused tensors (qkv, linear1) resolve to row ranges,
  so each diffusers tensor is read on its own;
- a slab (``engine/slab``): told apart by its name, manifest or header, identified from its manifest.

Identification reads headers only (a slab's manifest) and is done once per file state (memoized on path, size
and mtime): the Load node identifies, and its identity travels with the run (``ModelInfo.checkpoint``; as JSON to
data-parallel workers). Loading builds the model on the meta device and assigns every tensor decoded by
``TensorStore``, so the weights exist once in RAM.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import ModelLoadError
from .identity import KEY_PREFIXES, Checkpoint, CheckpointIdentity, SourceTensor
from .kinds import kind_of
from .kinds.diffusers_folder import shard_files
from .kinds.single_file import expected_single_file_shapes
from .tensors import is_side_tensor, refuse_unreadable_form


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
    """Family, variant and config of any transformer checkpoint, from headers, config.json or a slab's manifest
    alone, by the kind of checkpoint that claims the path."""
    _, p, pipeline = resolve_path(path)
    kind = kind_of(p)
    memo = (str(p.resolve()), family_id,
            tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in kind.state_files(p)))
    found = _IDENTITIES.get(memo)
    if found is None:
        family, variant, config = kind.identify(p, family_id)
        found = CheckpointIdentity(kind.name, p, pipeline, family, variant, config)
        if len(_IDENTITIES) > 64:
            _IDENTITIES.clear()
        _IDENTITIES[memo] = found
    return found


def open_checkpoint(path: str | Path | CheckpointIdentity, family_id: str = "auto") -> Checkpoint:
    """Any transformer checkpoint as diffusers tensors; reads headers only. Slabs are refused here
    (they are loaded by ``engine/slab``)."""
    ident = path if isinstance(path, CheckpointIdentity) else identify(path, family_id)
    return ident.form.open(ident)


__all__ = ["Checkpoint", "CheckpointIdentity", "KEY_PREFIXES", "SourceTensor", "expected_single_file_shapes",
           "identify", "is_side_tensor", "open_checkpoint", "resolve_path", "shard_files"]
