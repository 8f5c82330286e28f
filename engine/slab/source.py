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


    def release(self, ranges: list[tuple[int, int]]) -> int:
        """Give back the memory of the loader's map behind ``ranges`` ((address, bytes) of tensor views whose bytes
        were copied elsewhere: pinned host buffers, the GPU). Returns the bytes released.

        Why: the loader's tensors are views of one private map of the whole file, alive as long as any view is.
        A block copied into pinned memory leaves its pages mapped, so it counted twice in RSS (measured on an
        H200, bench/NOTES.md: 0.99 GB of RssFile for 0.99 GB of blocks) and in a cgroup's memory until the
        kernel reclaims them. ``madvise(MADV_DONTNEED)`` unmaps the pages (the views stay valid: a later read
        faults them in from the file again; nothing writes to a slab's tensors), then ``posix_fadvise(DONTNEED)``
        drops them from the page cache where no other process maps them. Only page-aligned interiors of ranges
        inside a map of this very file are touched; a no-op off Linux."""
        maps = self._maps()
        if not maps or not ranges:
            return 0
        import ctypes

        try:
            madvise = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            return 0
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        page = os.sysconf("SC_PAGE_SIZE")
        released, drops = 0, []
        for address, nbytes in ranges:
            lo, hi = -(-address // page) * page, (address + nbytes) // page * page
            inside = next(((m_lo, off) for m_lo, m_hi, off in maps if m_lo <= lo and hi <= m_hi), None)
            if hi <= lo or inside is None:
                continue
            if madvise(lo, hi - lo, _MADV_DONTNEED) == 0:
                released += hi - lo
                drops.append((inside[1] + lo - inside[0], hi - lo))
        if drops and hasattr(os, "posix_fadvise"):
            try:
                fd = os.open(self.path, os.O_RDONLY)
            except OSError:
                return released
            try:
                for offset, length in drops:
                    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return released

    def _maps(self) -> list[tuple[int, int, int]]:
        """(start, end, file offset) of this process's private maps of the file as loaded (same device and inode)."""
        out, path = [], str(self.path.resolve())
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    fields = line.split(maxsplit=5)
                    if len(fields) < 6 or fields[1][3] != "p" or int(fields[4]) != self.stamp.inode \
                            or fields[5].rstrip("\n") != path:
                        continue
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    out.append((lo, hi, int(fields[2], 16)))
        except (OSError, ValueError):
            return []
        return out


_MADV_DONTNEED = 4  # Linux


def record_slab_source(model: nn.Module, path: Path, file: SafetensorsFile, stamp: FileStamp, rebuild: str) -> None:
    tensors = {key: StoredTensor(file.data_start + e.start, file.data_start + e.end, e.dtype, e.shape)
               for key, e in file.entries.items() if not key.startswith(PAD_PREFIX)}
    model.__dict__[_ATTR] = SlabSource(Path(path), stamp, tensors, rebuild)


def slab_source_of(model: nn.Module) -> Optional[SlabSource]:
    return model.__dict__.get(_ATTR)
