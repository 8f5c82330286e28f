"""Raw safetensors access that needs no whole-file load: the header, and row ranges by seek + readinto.

Every safetensors file the engine reads that it did not write itself (checkpoints, text encoders,
VAEs) is opened here; slabs reuse the same class. Reads go through ``readinto`` on a plain file,
not an mmap, so a build that reads a 24 GB checkpoint never maps it into its RSS.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ModelLoadError

#: The slab format's marker in a safetensors header's ``__metadata__`` (``engine/slab``): a file carrying
#: it is a slab, not a checkpoint. Kept here so telling the two apart needs no slab import.
SLAB_FORMAT = "lowvram-lora-slab"
SLAB_SUFFIX = ".slab.safetensors"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit

# safetensors dtype strings <-> torch dtypes.
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
TORCH_TO_ST = {v: k for k, v in ST_DTYPES.items()}


def read_exact(f, buf: memoryview, offset: int, path: Path) -> None:
    """Fill ``buf`` from byte ``offset`` of raw file ``f`` (seek + readinto: portable, GIL released)."""
    f.seek(offset)
    done = 0
    while done < len(buf):
        n = f.readinto(buf[done:])
        if not n:
            raise ModelLoadError(f"'{path}' ended early at byte {offset + done}: the file is truncated")
        done += n


@dataclass(frozen=True)
class HeaderEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offsets relative to the start of the data section
    end: int


#: What to do about a model file that is not a whole safetensors file: said once, at the end of every such error.
REFETCH = ("re-download it (compare its size with the size on the download page), or pick the right file: "
           "lowvram-lora reads .safetensors files only")


class UnreadableSafetensors(ModelLoadError):
    """A file that is not a whole safetensors file. ``problem`` says what is wrong with it; the message adds the fix
    for a model file (``REFETCH``). Callers whose fix differs (a slab is rebuilt, a cache entry rebuilds itself) use
    ``problem`` with their own."""

    def __init__(self, problem: str):
        self.problem = problem
        super().__init__(f"{problem}; {REFETCH}")


def what_it_is(head: bytes) -> str:
    """A guess at what a file that is not safetensors holds, from its first bytes ('' when no guess fits): the
    forms a wrong download or a renamed file usually has."""
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive, the form torch.save writes (a .pt/.ckpt pickle renamed .safetensors?)"
    if head.startswith(b"\x80") and len(head) > 1 and head[1] <= 5:
        return "a Python pickle (a .ckpt/.bin renamed .safetensors?); pickles are never loaded, they can run code"
    if head.lstrip().lower().startswith((b"<!doctype", b"<html", b"<?xml", b"{")):
        return "a web page or a JSON reply, not model weights (a download link that answered with a page?)"
    if head.startswith(b"version https://git-lfs"):
        return "a Git LFS pointer, not the weights (cloned without git-lfs?)"
    if head.startswith(b"GGUF"):
        return "a GGUF file renamed .safetensors"
    return ""


class SafetensorsFile:
    """Header of one safetensors file plus row-range reads (seek + readinto).

    Raises UnreadableSafetensors (a ModelLoadError) for anything that is not a well-formed safetensors file
    of the size its header promises (truncated, garbage, not safetensors), naming the file, what it seems to
    be and the fix.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(64)
            f.seek(8)
            if len(head) < 8:
                raise UnreadableSafetensors(
                    f"'{self.path}' is {self.size} bytes: too short to be a safetensors file "
                    f"(a download or copy that stopped at the start?)")
            (header_len,) = struct.unpack("<Q", head[:8])
            if header_len > min(MAX_HEADER_BYTES, self.size - 8):
                seems = what_it_is(head)
                raise UnreadableSafetensors(
                    f"'{self.path}' is not a safetensors file: it is {seems}" if seems else
                    f"'{self.path}' is not a readable safetensors file (header length {header_len} "
                    f"does not fit a {self.size}-byte file): truncated, or not safetensors"
                )
            self.header_bytes = f.read(header_len)
        try:
            header = json.loads(self.header_bytes)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UnreadableSafetensors(f"'{self.path}' has a corrupted safetensors header ({exc})") from None
        if not isinstance(header, dict):
            raise UnreadableSafetensors(f"'{self.path}' has a corrupted safetensors header (not a JSON object)")
        self.data_start = 8 + header_len
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.entries: dict[str, HeaderEntry] = {}
        data_len = self.size - self.data_start
        for key, info in header.items():
            try:
                dtype = ST_DTYPES[info["dtype"]]
                start, end = (int(x) for x in info["data_offsets"])
                shape = tuple(int(s) for s in info["shape"])
            except (KeyError, TypeError, ValueError):
                raise UnreadableSafetensors(
                    f"'{self.path}': tensor '{key}' has an unreadable header entry {info!r} "
                    f"(dtype one of {', '.join(ST_DTYPES)} expected)"
                ) from None
            if not 0 <= start <= end <= data_len:
                raise UnreadableSafetensors(
                    f"'{self.path}': tensor '{key}' lies at bytes {start}..{end} of the data section, "
                    f"which has only {data_len} bytes: the file is truncated (a download or copy that stopped early)"
                )
            self.entries[key] = HeaderEntry(dtype, shape, start, end)

    @property
    def header_sha256(self) -> str:
        return hashlib.sha256(self.header_bytes).hexdigest()

    def read(self, key: str, row_start: int = 0, row_count: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``[row_start, row_start + row_count)`` of tensor ``key`` (dim 0), as stored.
        ``out``: a uint8 buffer to read into when large enough (the result is a view of it)."""
        e = self.entries[key]
        rows = e.shape[0] if e.shape else 1
        row_count = rows - row_start if row_count is None else row_count
        if not 0 <= row_start <= row_start + row_count <= rows:
            raise ValueError(f"rows {row_start}+{row_count} out of range for '{key}' with {rows} rows")
        row_bytes = (e.end - e.start) // max(rows, 1)
        nbytes = row_count * row_bytes
        buf = out[:nbytes] if out is not None and out.numel() >= nbytes else torch.empty(nbytes, dtype=torch.uint8)
        if buf.numel():
            with open(self.path, "rb", buffering=0) as f:
                read_exact(f, memoryview(buf.numpy()), self.data_start + e.start + row_start * row_bytes, self.path)
        shape = (row_count,) + e.shape[1:] if e.shape else ()
        return buf.view(e.dtype).reshape(shape)


def manifest_path_for(slab_path: str | Path) -> Path:
    """``x.slab.safetensors`` -> ``x.slab.manifest.json`` (a slab's manifest sits beside it)."""
    p = Path(slab_path)
    stem = p.name[: -len(".safetensors")] if p.name.endswith(".safetensors") else p.name
    return p.with_name(stem + ".manifest.json")


def is_slab_file(path: str | Path) -> bool:
    """Named ``*.slab.safetensors``, has a manifest beside it, or says so in its header (a damaged slab
    still counts as one, so the slab loader reports it with its rebuild command)."""
    p = Path(path)
    if p.name.endswith(SLAB_SUFFIX) or manifest_path_for(p).exists():
        return True
    try:
        return SafetensorsFile(p).metadata.get("format") == SLAB_FORMAT
    except (ModelLoadError, OSError):
        return False
