"""The slab file format (raw safetensors reads live in ``engine/checkpoint/files.py``).

A slab is two files side by side:

    flux1-dev-3f2a9c1b0d4e.slab.safetensors       tensors (a valid safetensors file)
    flux1-dev-3f2a9c1b0d4e.slab.manifest.json     what they are; written last

The manifest is the completion mark: a slab without one is incomplete. Tensor
layout in the safetensors file: non-block tensors first, then one contiguous
byte range per transformer block (the streamer's unit), every tensor starting
on a 64-byte boundary (``__padding__.N`` uint8 filler tensors where needed;
safetensors forbids gaps between tensors). Names are the quantized model's own
state-dict keys: ``<linear>.weight_int8`` (int8, (out, in)), ``<linear>.weight_scale``
(fp32, (out,)) in an int8 slab; ``<linear>.weight_int4`` (uint8, (out, ceil(in/2))), ``<linear>.weight_scale``
and ``<linear>.weight_min`` (fp16, (out, groups of 64)) in an int4 slab (quantize.py); everything else under
its diffusers name.

safetensors' own ``save_file`` needs every tensor in memory at once, so the file
is written here: header first (offsets follow from shapes and dtypes), then
each tensor's bytes at its offset (seek + write). Sources are read the same way
(seek + readinto, not mmap), so a build never maps the checkpoint into its RSS.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint.files import (  # noqa: F401  (re-exported: slab code reads its own files with them)
    MAX_HEADER_BYTES, SLAB_FORMAT, SLAB_SUFFIX, ST_DTYPES, TORCH_TO_ST, HeaderEntry, SafetensorsFile, is_slab_file,
    manifest_path_for, read_exact,
)
from ..errors import ModelLoadError

#: The newest slab format this version reads and writes. 1: int8 slabs (still written as 1, so older versions keep
#: reading them); 2: int4 slabs (``weight_int4`` + fp16 group ``weight_scale`` and ``weight_min``), which a version
#: that knows only 1 refuses with "update lowvram-lora" instead of misreading.
FORMAT_VERSION = 2
INT8_FORMAT_VERSION = 1


def format_version_for(bits: int) -> int:
    return INT8_FORMAT_VERSION if bits == 8 else FORMAT_VERSION


def slab_bits(manifest: dict) -> int:
    """8 or 4: what a slab's quantized Linears hold (manifests of version 1 are int8)."""
    return int(manifest.get("quantization", {}).get("bits", 8))
ALIGN = 64  # every tensor starts on a cache line: vector loads, clean DMA
PAD_PREFIX = "__padding__."


class SlabError(ModelLoadError):
    """A slab is missing, incomplete, corrupted or does not fit the model; says how to rebuild."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the manifest's spelling)."""
    return str(dtype).removeprefix("torch.")


# --- writing ---------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedTensor:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # relative to the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def plan_layout(
    tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str], align: int = ALIGN
) -> tuple[bytes, list[PlannedTensor]]:
    """Header bytes and byte ranges for ``tensors`` in the given order, each starting on an
    ``align``-byte boundary (``align=1``: plain safetensors, no padding tensors).

    Returns the full header (8-byte length + JSON padded with spaces so data starts
    aligned) and every tensor's planned range, padding tensors included.
    """
    planned: list[PlannedTensor] = []
    offset = 0
    for key, dtype, shape in tensors:
        if offset % align:
            pad = align - offset % align
            planned.append(PlannedTensor(f"{PAD_PREFIX}{len(planned)}", torch.uint8, (pad,), offset, offset + pad))
            offset += pad
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        planned.append(PlannedTensor(key, dtype, tuple(shape), offset, offset + nbytes))
        offset += nbytes
    header = {"__metadata__": metadata}
    for t in planned:
        header[t.key] = {"dtype": TORCH_TO_ST[t.dtype], "shape": list(t.shape), "data_offsets": [t.start, t.end]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((-(8 + len(text))) % max(align, 8))
    return struct.pack("<Q", len(text)) + text, planned


class SafetensorsWriter:
    """Writes a planned safetensors file tensor by tensor (each in row order), at known offsets.

    Every tensor's bytes are hashed as they are written (sha256), so the manifest can
    record content hashes without reading the file back. With ``background=True`` the
    writes and hashing run on one worker thread (both release the GIL), overlapping the
    caller's compute: ``write`` then returns a Future, and the caller must not modify the
    tensor until it is done. One worker keeps each tensor's chunks in order.
    """

    def __init__(self, path: Path, header: bytes, planned: list[PlannedTensor], background: bool = False):
        self.path = path
        self.data_start = len(header)
        self.planned = {t.key: t for t in planned}
        self.total = self.data_start + (planned[-1].end if planned else 0)
        self._written = {t.key: 0 for t in planned if not t.key.startswith(PAD_PREFIX)}
        self._hashes = {k: hashlib.sha256() for k in self._written}
        self._pool = None
        self._futures: list[Future] = []
        self._file = open(path, "w+b", buffering=0)
        self._file.truncate(self.total)  # padding stays zero: sparse, never written
        self._write_at(header, 0)
        if background:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="slab-writer")

    def _write_at(self, data, offset: int) -> None:
        """Only ever called from one thread at a time (the caller's, or the single worker)."""
        view = memoryview(data).cast("B")
        self._file.seek(offset)
        while len(view):
            n = self._file.write(view)
            view = view[n:]

    def write(self, key: str, tensor: torch.Tensor) -> Future | None:
        """Append ``tensor`` (whole or the next rows) to planned tensor ``key``."""
        t = self.planned[key]
        if tensor.dtype != t.dtype:
            raise TypeError(f"'{key}' is planned as {t.dtype}, got {tensor.dtype}")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        done = self._written[key]
        if done + data.nbytes > t.nbytes:
            raise ValueError(f"'{key}' overflows its planned {t.nbytes} bytes")
        self._written[key] = done + data.nbytes
        offset = self.data_start + t.start + done
        if self._pool is None:
            self._put(key, data, offset)
            return None
        pending = []
        for f in self._futures:
            if f.done():
                f.result()  # re-raises a failed write here rather than at the end
            else:
                pending.append(f)
        self._futures = pending
        future = self._pool.submit(self._put, key, data, offset)
        self._futures.append(future)
        return future

    def _put(self, key: str, data, offset: int) -> None:
        self._write_at(data, offset)
        self._hashes[key].update(data)

    def finish(self) -> dict[str, str]:
        """Waits for pending writes, checks every tensor was written completely, syncs,
        closes; returns sha256 per tensor."""
        for f in self._futures:
            f.result()
        missing = [k for k, n in self._written.items() if n != self.planned[k].nbytes]
        if missing:
            raise RuntimeError(f"slab writer: {len(missing)} tensors incomplete, first: {missing[0]}")
        os.fsync(self._file.fileno())
        self.close()
        return {k: h.hexdigest() for k, h in self._hashes.items()}

    def close(self) -> None:
        """Stops the worker (pending writes are cancelled or finished first) and closes the file."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._file is not None:
            self._file.close()
            self._file = None


def sha256_range(path: Path, start: int, end: int, chunk: int = 16 << 20) -> str:
    """sha256 of bytes ``[start, end)`` of a file, read in chunks."""
    h = hashlib.sha256()
    buf = bytearray(max(1, min(chunk, end - start)))  # small tensors: no 16 MiB buffer each
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        left = end - start
        while left > 0:
            n = f.readinto(memoryview(buf)[: min(chunk, left)])
            if not n:
                break
            h.update(memoryview(buf)[:n])
            left -= n
    return h.hexdigest()
