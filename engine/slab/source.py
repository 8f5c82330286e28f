"""Where a loaded slab model's tensors sit in its file, and whether the file is still the one loaded.

``load_slab_transformer`` records a ``SlabSource`` on the model it builds: the file, its stamp (size, mtime,
inode) when loaded, and each tensor's absolute byte range, stored dtype and shape. The disk tier
(engine/offload/disk.py) reads frozen blocks straight from those ranges on every step instead of keeping a
host copy, and checks the stamp before each read: a slab replaced, rewritten or removed mid-run is an error
that says which file and what changed, never a silent read of other bytes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from .format import PAD_PREFIX, SafetensorsFile, SlabError

_ATTR = "_lowvram_slab_source"


@dataclass(frozen=True)
class FileStamp:
    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, path: Path) -> "FileStamp":
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)


@dataclass(frozen=True)
class StoredTensor:
    start: int  # absolute byte offsets in the file
    end: int
    dtype: torch.dtype  # as stored
    shape: tuple[int, ...]


@dataclass
class SlabSource:
    path: Path
    stamp: FileStamp
    tensors: dict[str, StoredTensor]
    rebuild: str  # the command that rebuilds the slab

    def check(self) -> None:
        """Raise a SlabError when the file was removed or is no longer the one loaded (size, mtime or inode)."""
        try:
            now = FileStamp.of(self.path)
        except FileNotFoundError:
            raise SlabError(self._changed("disappeared")) from None
        except OSError as exc:
            raise SlabError(self._changed(f"cannot be read any more ({exc})")) from None
        if now != self.stamp:
            what = [f"{name} {getattr(self.stamp, name)} -> {getattr(now, name)}"
                    for name in ("size", "mtime_ns", "inode") if getattr(self.stamp, name) != getattr(now, name)]
            raise SlabError(self._changed(f"changed since it was loaded ({', '.join(what)})"))

    def read_failed(self, exc: BaseException) -> SlabError:
        """The error for a failed read: the file's change when it changed, else the read's own error."""
        try:
            self.check()
        except SlabError as changed:
            return changed
        return SlabError(self._changed(f"could not be read ({type(exc).__name__}: {exc})"))

    def _changed(self, what: str) -> str:
        return (f"slab '{self.path}' {what} while training: the blocks the plan keeps on disk are read from it on "
                f"every step, so training stopped here. The training states saved so far are kept (resume is on by "
                f"default): put the slab back as it was, or rebuild it with: {self.rebuild}; then run the same "
                f"training again and it resumes from the last saved state")


def record_slab_source(model: nn.Module, path: Path, file: SafetensorsFile, stamp: FileStamp, rebuild: str) -> None:
    tensors = {key: StoredTensor(file.data_start + e.start, file.data_start + e.end, e.dtype, e.shape)
               for key, e in file.entries.items() if not key.startswith(PAD_PREFIX)}
    model.__dict__[_ATTR] = SlabSource(Path(path), stamp, tensors, rebuild)


def slab_source_of(model: nn.Module) -> Optional[SlabSource]:
    return model.__dict__.get(_ATTR)
