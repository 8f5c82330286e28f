"""An int8 or int4 slab (``engine/slab``): a checkpoint quantized once, with a manifest beside it that says its family,
variant and config. Identifying it checks the manifest against the file (size and header; every tensor's bytes
on its first use and after it changed) and against the family asked for; it loads with its block Linears as
``Int8Linear`` (``Int4Linear`` in an int4 slab). A slab is never re-read as a checkpoint to build from."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...errors import ModelLoadError
from ...families import ModelFamily, meta_model
from ...slab.format import slab_bits
from ...slab.layout import swap_in_int8_linears
from ...slab.load import load_slab_transformer, open_slab, read_manifest, resolve_slab_family
from ..files import is_slab_file, manifest_path_for
from ..identity import Checkpoint, CheckpointIdentity
from . import CheckpointKind


class Slab(CheckpointKind):
    name = "slab"
    description = "slab"  # describe() says which: note_for's "int8 slab" / "int4 slab"
    weights_note = "int8 slab"
    file_backed = True

    def claims(self, path: Path) -> bool:
        return path.is_file() and is_slab_file(path)

    def state_files(self, path: Path) -> list[Path]:
        manifest = manifest_path_for(path)
        return [path] + ([manifest] if manifest.exists() else [])

    def identify(self, path: Path, family_id: str) -> tuple[ModelFamily, str, dict[str, Any]]:
        slab = open_slab(path)  # manifest against the file: size, header, entries (and hashes when it changed)
        return resolve_slab_family(slab, family_id), slab.variant, slab.manifest["config"]

    def open(self, ident: CheckpointIdentity) -> Checkpoint:
        raise ModelLoadError(f"'{ident.path}' is already a slab; load it directly, or build from the original "
                             f"checkpoint")

    def load_model(self, ident: CheckpointIdentity, dtype: torch.dtype) -> torch.nn.Module:
        model, _, _ = load_slab_transformer(ident.path, dtype, "cpu", ident.family.id, ident.variant)
        return model

    def meta_model(self, ident: CheckpointIdentity, dtype: torch.dtype) -> torch.nn.Module:
        model = meta_model(ident.family, ident.config)
        torch.nn.Module.to(model, dtype=dtype)  # the slab's plain tensors are converted to ``dtype`` at load
        return model.requires_grad_(False)

    def as_loaded(self, model: torch.nn.Module, family: ModelFamily, ident: CheckpointIdentity | None = None) -> None:
        # int8: 1 byte per block weight + fp32 row scales; int4: half a byte + fp16 scale and min per 64 weights
        swap_in_int8_linears(model, family, slab_bits(read_manifest(ident.path)) if ident is not None else 8)

    def note_for(self, ident: CheckpointIdentity) -> str:
        return f"int{slab_bits(read_manifest(ident.path))} slab"


KIND = Slab()
