"""The kinds of transformer checkpoint the reader knows, one file each, found by file name.

Every module in this folder defines ``KIND``, a ``CheckpointKind``: which paths it claims, how it identifies
one (family, variant, config), and how it opens, loads and sizes it. ``transformer.identify`` asks the one kind
that claims a path, so a new kind of checkpoint is a new file here and callers never branch on a kind's name.
Found by ``pkgutil`` when first asked, as the family registry finds family folders.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...discovery import discover
from ...errors import ConfigError, ModelLoadError
from ...families import ModelFamily, meta_model

if TYPE_CHECKING:
    from ..identity import Checkpoint, CheckpointIdentity


class CheckpointKind(ABC):
    """One kind of transformer checkpoint. ``name`` is what ``CheckpointIdentity.kind`` and the Load node's
    ``ModelInfo.kind`` hold; ``description`` what the Load node prints ("diffusers folder")."""

    name: str
    description: str
    #: Said beside the variant in the footprint's label ("int8 slab"); empty for weights held as stored.
    weights_note: str = ""
    #: The loaded weights are views of the file's pages, and a block can be read back from the file at any time
    #: (one contiguous byte range): the disk tier may stream its blocks (engine/offload/disk.py).
    file_backed: bool = False

    @abstractmethod
    def claims(self, path: Path) -> bool:
        """Whether ``path`` (a folder or file ``transformer.resolve_path`` accepted) is of this kind. Exactly one
        kind claims any path."""

    def state_files(self, path: Path) -> list[Path]:
        """The files whose size and mtime say whether an identity made earlier still holds."""
        return [path]

    @abstractmethod
    def identify(self, path: Path, family_id: str) -> tuple[ModelFamily, str, dict[str, Any]]:
        """(family, variant, config) from headers, configs or a manifest alone; ``family_id`` "auto" or the
        family asked for (a mismatch is an error naming both)."""

    @abstractmethod
    def open(self, ident: CheckpointIdentity) -> Checkpoint:
        """The checkpoint's tensors under diffusers names, decoded on read (headers only are read here)."""

    def load_model(self, ident: CheckpointIdentity, dtype: torch.dtype) -> torch.nn.Module:
        """The family's transformer on the CPU, floating weights in ``dtype``."""
        return self.open(ident).load_model(dtype)

    def meta_model(self, ident: CheckpointIdentity, dtype: torch.dtype) -> torch.nn.Module:
        """The model on the meta device with its parameters in ``dtype`` as the loader assigns them, frozen;
        buffers stay as the model builds them (Wan's fp32 RoPE tables are not in the file and are not cast)."""
        model = meta_model(ident.family, ident.config)
        for param in model.parameters():
            param.data = param.data.to(dtype)
        return model.requires_grad_(False)

    def as_loaded(self, model: torch.nn.Module, family: ModelFamily, ident: CheckpointIdentity | None = None) -> None:
        """Make a ``meta_model`` hold its weights as ``load_model`` does (a slab: int8 or int4 block Linears)."""

    def note_for(self, ident: CheckpointIdentity) -> str:
        """``weights_note`` for this checkpoint (a slab says its bits: "int4 slab")."""
        return self.weights_note

    def readable_name(self, path: Path) -> str:
        """A short name for files made from this checkpoint (a slab's): its file or folder name."""
        return path.name.removesuffix(".safetensors")


_FOUND: dict[str, CheckpointKind] = {}


def checkpoint_kinds() -> dict[str, CheckpointKind]:
    """name -> kind, every module of this folder, in file-name order."""
    if not _FOUND:
        from . import __name__ as package, __path__ as here

        _FOUND.update(discover(package, here, "KIND", lambda k: k.name, "checkpoint kinds"))
    return _FOUND


def get_kind(name: str) -> CheckpointKind:
    try:
        return checkpoint_kinds()[name]
    except KeyError:
        raise ConfigError(f"unknown checkpoint kind {name!r}; one of: {', '.join(checkpoint_kinds())}") from None


def kind_of(path: Path) -> CheckpointKind:
    """The one kind that claims ``path``."""
    claimed = [k for k in checkpoint_kinds().values() if k.claims(path)]
    if len(claimed) != 1:
        raise ModelLoadError(f"'{path}' is claimed by {len(claimed)} kinds of checkpoint "
                             f"({', '.join(k.name for k in claimed) or 'none'}); point at a diffusers folder, a "
                             f".safetensors file or a slab")
    return claimed[0]
