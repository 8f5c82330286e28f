"""Content keys for the on-disk cache.

Model files are identified by their safetensors header, size and a hash of a few
evenly spaced 1 MiB samples of the data, rather than a full content hash: hashing
10 GB of T5 on every run would cost minutes. The header alone is not enough: a
fine-tune saved like its base has a byte-identical header and size, and would
silently reuse the base's caches, slab and trained runs. Small files (configs,
tokenizers, images) are hashed whole.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def stable_hash(obj: Any, length: int = 24) -> str:
    """Hash of a JSON-serialisable object, independent of dict order."""
    return sha256_bytes(json.dumps(obj, sort_keys=True, default=str).encode())[:length]


SAMPLES = 16  # 1 MiB samples of the data region: 16 MiB read per file, whatever its size
SAMPLE_BYTES = 1 << 20


def sampled_data_hash(f, start: int, end: int) -> bytes:
    """sha256 over SAMPLES evenly spaced chunks of bytes [start, end) of an open file."""
    h = hashlib.sha256()
    span = max(0, end - start)
    if span <= SAMPLES * SAMPLE_BYTES:
        f.seek(start)
        h.update(f.read(span))
        return h.digest()
    step = (span - SAMPLE_BYTES) // (SAMPLES - 1)
    for i in range(SAMPLES):
        f.seek(start + i * step)
        h.update(f.read(SAMPLE_BYTES))
    return h.digest()


def weight_file_identity(path: Path) -> str:
    """Header + size + sampled data for safetensors; size + sampled data for other weight files."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if path.suffix == ".safetensors":
            (header_len,) = struct.unpack("<Q", f.read(8))
            head = f.read(min(header_len, 100 << 20))
            data_start = 8 + header_len
        else:
            head, data_start = b"", 0
        head += sampled_data_hash(f, data_start, size)
    return sha256_bytes(head + str(size).encode())


def path_identity(path: Path) -> str:
    """Identity of a model file or folder (all files below it, by relative name)."""
    path = Path(path)
    if path.is_file():
        return weight_file_identity(path) if path.suffix in _WEIGHT_SUFFIXES else sha256_file(path)
    parts = []
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        ident = weight_file_identity(f) if f.suffix in _WEIGHT_SUFFIXES else sha256_file(f)
        parts.append((str(f.relative_to(path)), ident))
    return stable_hash(parts, length=64)
