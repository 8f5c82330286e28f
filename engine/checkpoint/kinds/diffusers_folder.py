"""A diffusers folder: a pipeline folder's ``transformer/`` (or that folder itself), one file or sharded
(``*.safetensors.index.json``); identified by config.json's ``_class_name``, read under its own names."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...errors import ModelLoadError
from ...families import ModelFamily, family_for_class_name, get_family
from ..identity import KEY_PREFIXES, Checkpoint, CheckpointIdentity, SourceTensor
from ..tensors import TensorStore, open_files
from . import CheckpointKind


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


class DiffusersFolder(CheckpointKind):
    name = "diffusers"
    description = "diffusers folder"

    def claims(self, path: Path) -> bool:
        return path.is_dir()

    def state_files(self, path: Path) -> list[Path]:
        return [path / "config.json", *sorted(path.glob("*.safetensors*"))]

    def identify(self, path: Path, family_id: str) -> tuple[ModelFamily, str, dict[str, Any]]:
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"'{path / 'config.json'}' is unreadable ({exc}); re-download the model") from None
        class_name = config.get("_class_name", "")
        family = family_for_class_name(class_name)
        if family is None or (family_id != "auto" and family.id != family_id):
            expected = get_family(family_id).display_name if family_id != "auto" else "a supported family"
            raise ModelLoadError(
                f"'{path}' holds a {class_name or 'unknown'} model, expected {expected} "
                f"(config.json _class_name should be one of the registered families' classes)"
            )
        name = path.parent.name if path.name == "transformer" else path.name
        return family, family.variant_from_name(family.variant_for_config(config), name), config

    def open(self, ident: CheckpointIdentity) -> Checkpoint:
        config_bytes = (ident.path / "config.json").read_bytes()
        store = TensorStore(open_files(shard_files(ident.path), "the transformer"), KEY_PREFIXES)
        tensors = {n: SourceTensor(n, n, 0, e.shape, e.dtype, e.scale_key is not None)
                   for n, e in store.entries.items()}
        return Checkpoint(ident, store, tensors, config_bytes)

    def readable_name(self, path: Path) -> str:
        return super().readable_name(path.parent if path.name == "transformer" else path)


KIND = DiffusersFolder()
