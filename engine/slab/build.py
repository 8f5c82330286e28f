"""Build a slab (int8, or int4 with ``bits=4``) from a checkpoint, tensor by tensor.

    build_slab("flux1-dev.safetensors", "models/slabs/")        # -> Path of the slab
    build_slab("flux1-dev.safetensors", "models/slabs/", bits=4)  # 4-bit groups (quantize.py)
    ensure_slab("flux1-dev.safetensors", "models/slabs/")       # build once, reuse after

Peak RAM is about four chunks of rows of one tensor (``chunk_bytes`` of fp32,
32 MiB by default: ~150 MB) plus the largest non-block tensor, whatever the
model size: sources are read in row ranges (seek + readinto, no mmap) and the
slab is written at offsets planned from shapes alone, its writes and hashing on
a background thread overlapping the quantization. The file is written to
a temporary name beside it (``engine/fileio``) and renamed when complete; the manifest is written after
that, so a slab without a manifest is one whose build did not finish.
"""
from __future__ import annotations

import contextlib
import hashlib
import time
from pathlib import Path
from typing import Callable

import torch

from ..errors import ModelLoadError
from ..fileio import atomic_write, clean_stale_temps, ensure_dir, write_json_atomic
from ..version import VERSION
from .format import (
    SLAB_FORMAT, SLAB_SUFFIX, SafetensorsWriter, SlabError, dtype_name, format_version_for, manifest_path_for,
    plan_layout, slab_bits,
)
from .load import record_verified
from .layout import (
    INT4, INT8, PLAIN, QUANTIZED, SCALE, SlabTensor, block_prefixes, check_bits, meta_model, slab_tensors,
)
from .quantize import INT4_GROUP, INT4_LEVELS, QMAX, SCALE_DTYPE, GroupQuantizer, RowQuantizer
from ..checkpoint import Checkpoint, SourceTensor, open_checkpoint

ProgressCallback = Callable[[int, int], None]  # (bytes done, bytes total)
DEFAULT_CHUNK_BYTES = 32 << 20  # fp32 rows quantized at once: ~4x this is the build's working set
_KEPT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def default_slab_name(ckpt: Checkpoint, bits: int = 8) -> str:
    """``<checkpoint stem>-<12 hex of the source key>.slab.safetensors`` (``...-int4.slab.safetensors`` for 4 bits):
    readable and unique."""
    return f"{ckpt.stem}-{ckpt.fingerprint()['key'][:12]}{'-int4' if check_bits(bits) == 4 else ''}{SLAB_SUFFIX}"


def build_slab(
    checkpoint: str | Path | Checkpoint,
    out: str | Path,
    family: str = "auto",
    callback: ProgressCallback | None = None,
    progress: bool = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    overwrite: bool = False,
    bits: int = 8,
) -> Path:
    """Quantize ``checkpoint`` into a slab at ``out`` (a ``.safetensors`` path, or a folder
    that gets ``default_slab_name``). Returns the slab path; its manifest sits beside it.
    An existing file at the target is refused unless ``overwrite`` (``--force``); a file
    of the source checkpoint never is replaced. ``bits``: 8 (int8 rows, the default) or 4 (int4 groups).

    ``callback(done, total)`` is called as bytes are written; an exception raised from it
    aborts the build and leaves no slab behind (how a UI cancels).
    """
    check_bits(bits)
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint, family)
    out = Path(out).expanduser()
    path = out if out.name.endswith(".safetensors") else out / default_slab_name(ckpt, bits)
    _check_target(ckpt, path, overwrite)
    return _build(ckpt, path, callback, progress, chunk_bytes, bits)


def _check_target(ckpt: Checkpoint, path: Path, overwrite: bool) -> None:
    """Never write over the checkpoint being read; nothing else without being told to."""
    target = path.resolve()
    sources = {f.path.resolve() for f in ckpt.files} | {Path(ckpt.path).resolve()}
    if target in sources:
        raise SlabError(f"the slab target '{path}' is the source checkpoint itself; write the slab elsewhere, "
                        f"e.g. -o models/slabs/")
    if path.is_dir():
        raise SlabError(f"the slab target '{path}' is a folder; give a '*{SLAB_SUFFIX}' file name or the folder "
                        f"without a file name")
    if path.exists() and not overwrite:
        raise SlabError(f"'{path}' already exists and would be replaced; choose another -o, or pass --force "
                        f"to replace it")


def _plain_dtype(src: SourceTensor) -> torch.dtype:
    """Non-quantized tensors keep their checkpoint dtype; fp8 (scaled or not) becomes bf16."""
    if not src.dtype.is_floating_point:
        return src.dtype
    return src.dtype if src.dtype in _KEPT_DTYPES and not src.scaled else torch.bfloat16


def _check_source_covers_model(ckpt: Checkpoint, model: torch.nn.Module) -> None:
    expected = {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()}
    missing = sorted(set(expected) - set(ckpt.tensors))
    extra = sorted(set(ckpt.tensors) - set(expected))
    wrong = [f"'{k}' is {list(ckpt.tensors[k].shape)}, model needs {list(s)}"
             for k, s in expected.items() if k in ckpt.tensors and ckpt.tensors[k].shape != s]
    if missing or extra or wrong:
        lines = ([f"missing: {', '.join(missing[:10])}"] if missing else []) + \
                ([f"unexpected: {', '.join(extra[:10])}"] if extra else []) + wrong[:10]
        raise ModelLoadError(
            f"'{ckpt.path}' does not fit {ckpt.family.display_name} ({ckpt.variant}): "
            f"{len(missing)} missing, {len(extra)} unexpected, {len(wrong)} wrong-shaped tensors; "
            + "; ".join(lines)
        )


class _Progress:
    """tqdm bar with ETA (bytes of slab written) plus the caller's callback."""

    def __init__(self, total: int, show: bool, callback: ProgressCallback | None, desc: str):
        from tqdm.auto import tqdm

        self.total, self.done, self.callback = total, 0, callback
        self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                        disable=not show, dynamic_ncols=True)

    def advance(self, n: int) -> None:
        self.done += n
        self.bar.update(n)
        if self.callback is not None:
            self.callback(self.done, self.total)

    def close(self) -> None:
        self.bar.close()


def _build(ckpt: Checkpoint, path: Path, callback, progress: bool, chunk_bytes: int, bits: int = 8) -> Path:
    start = time.perf_counter()
    model = meta_model(ckpt.family, ckpt.config)
    _check_source_covers_model(ckpt, model)
    tensors = slab_tensors(model, ckpt.family, lambda name: _plain_dtype(ckpt.tensors[name]), bits)
    metadata = {"format": SLAB_FORMAT, "format_version": str(format_version_for(bits)),
                "family": ckpt.family.id, "variant": ckpt.variant}
    header, planned = plan_layout([(t.key, t.dtype, t.shape) for t in tensors], metadata)
    ranges = {p.key: (len(header) + p.start, len(header) + p.end) for p in planned}
    total = len(header) + planned[-1].end

    ensure_dir(path.parent, "the slab")
    clean_stale_temps(path.parent, path.name)  # left by a build that was killed (SIGKILL, power cut)
    manifest_file = manifest_path_for(path)
    bar = _Progress(total, progress, callback, f"slab {path.name}")
    try:
        with atomic_write(path, "the slab", overwrite=True) as tmp:
            writer = SafetensorsWriter(tmp, header, planned, background=True)
            try:
                bar.advance(len(header))
                by_key = {t.key: t for t in tensors}
                errors: dict[str, float] = {}
                chunk_elements = max(1, chunk_bytes // 4)  # fp32 elements per chunk
                largest = max((min(rows, _chunk_rows(cols, chunk_elements)) * cols
                               for rows, cols in (ckpt.tensors[t.canonical].shape for t in tensors
                                                  if t.role in QUANTIZED)), default=1)
                quantizer = RowQuantizer(largest) if bits == 8 else GroupQuantizer(largest)
                for t in tensors:
                    if t.role == INT8:
                        errors[t.key] = _write_quantized(ckpt, t, by_key[_scale_key(t)], writer, quantizer,
                                                         chunk_elements, bar)
                    elif t.role == INT4:
                        errors[t.key] = _write_int4(ckpt, t, by_key[_scale_key(t)], by_key[_min_key(t)], writer,
                                                    quantizer, chunk_elements, bar)
                    elif t.role == PLAIN:
                        data = ckpt.read(t.canonical).to(t.dtype)
                        writer.write(t.key, data)
                        bar.advance(data.numel() * data.element_size())
                hashes = writer.finish()
            except BaseException:
                writer.close()
                raise
            manifest = _manifest(ckpt, model, path, header, total, tensors, ranges, hashes, errors,
                                 time.perf_counter() - start, bits)
            # Never leave an old manifest beside a new slab: drop it before the rename.
            manifest_file.unlink(missing_ok=True)
        write_json_atomic(manifest_file, manifest, "the slab manifest")
        record_verified(path, manifest)  # its tensor hashes were computed from the bytes written
    finally:
        bar.close()
    return path


def _scale_key(t: SlabTensor) -> str:
    return t.key.rpartition(".")[0] + ".weight_scale"


def _min_key(t: SlabTensor) -> str:
    return t.key.rpartition(".")[0] + ".weight_min"


def _chunk_rows(cols: int, chunk_elements: int) -> int:
    """Rows per chunk: at least one, at most ``chunk_elements`` elements."""
    return max(1, chunk_elements // max(cols, 1))


def _write_quantized(ckpt: Checkpoint, t: SlabTensor, scale_t: SlabTensor, writer: SafetensorsWriter,
                     quantizer: RowQuantizer, chunk_elements: int, bar: _Progress) -> float:
    """Quantize one Linear weight in row chunks; writes int8 rows then the scales. Returns
    the relative Frobenius error of the dequantized weight against the source."""
    rows, cols = t.shape
    step = _chunk_rows(cols, chunk_elements)
    scales, err_sq, src_sq = [], 0.0, 0.0
    for r0 in range(0, rows, step):
        w = ckpt.read(t.canonical, r0, min(step, rows - r0), out=quantizer.raw)  # (n, in), source dtype
        try:
            q, scale, e, s, slot = quantizer(w)
        except ValueError as exc:
            raise ModelLoadError(f"'{ckpt.path}': tensor '{t.canonical}': {exc}") from None
        err_sq, src_sq = err_sq + e, src_sq + s
        quantizer.busy[slot] = writer.write(t.key, q)
        scales.append(scale)
        bar.advance(q.numel())
    scale = torch.cat(scales) if scales else torch.empty(0, dtype=SCALE_DTYPE)
    writer.write(scale_t.key, scale)
    bar.advance(scale.numel() * scale.element_size())
    return (err_sq / src_sq) ** 0.5 if src_sq > 0 else 0.0


def _write_int4(ckpt: Checkpoint, t: SlabTensor, scale_t: SlabTensor, min_t: SlabTensor, writer: SafetensorsWriter,
                quantizer: GroupQuantizer, chunk_elements: int, bar: _Progress) -> float:
    """Quantize one Linear weight to int4 groups in row chunks; writes the packed rows, then the scales and minima.
    Returns the relative Frobenius error of the dequantized weight against the source."""
    rows, cols = ckpt.tensors[t.canonical].shape
    step = _chunk_rows(cols, chunk_elements)
    scales, mins, err_sq, src_sq = [], [], 0.0, 0.0
    for r0 in range(0, rows, step):
        w = ckpt.read(t.canonical, r0, min(step, rows - r0), out=quantizer.raw)  # (n, in), source dtype
        try:
            packed, scale, low, e, s = quantizer(w)
        except ValueError as exc:
            raise ModelLoadError(f"'{ckpt.path}': tensor '{t.canonical}': {exc}") from None
        err_sq, src_sq = err_sq + e, src_sq + s
        writer.write(t.key, packed)  # a fresh tensor: the background writer may hold it
        scales.append(scale)
        mins.append(low)
        bar.advance(packed.numel())
    for key, parts in ((scale_t.key, scales), (min_t.key, mins)):
        data = torch.cat(parts) if parts else torch.empty(scale_t.shape, dtype=scale_t.dtype)
        writer.write(key, data)
        bar.advance(data.numel() * data.element_size())
    return (err_sq / src_sq) ** 0.5 if src_sq > 0 else 0.0


def _quantization_entry(bits: int) -> dict:
    if bits == 8:
        return {
            "bits": 8,
            "scheme": "int8 symmetric, one scale per output row",
            "formula": f"scale = max|row| / {QMAX}; q = clamp(round(w / scale), -{QMAX}, {QMAX}); w ~ q * scale",
            "scale_dtype": dtype_name(SCALE_DTYPE),
        }
    return {
        "bits": 4,
        "scheme": f"int4 asymmetric, one scale and min per {INT4_GROUP} input columns of a row (the last group of "
                  f"a row may be shorter); two columns per byte, column 2j in the low nibble",
        "group_size": INT4_GROUP,
        "formula": f"scale = (max - min) / {INT4_LEVELS}; q = clamp(round((w - min) / scale), 0, {INT4_LEVELS}); "
                   f"w ~ q * scale + min",
        "scale_dtype": "float16",
    }


def _manifest(ckpt, model, path, header, total, tensors, ranges, hashes, errors, seconds, bits: int = 8) -> dict:
    config = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    config["_class_name"] = ckpt.family.diffusers_class_name
    entries = []
    for t in tensors:
        src = ckpt.tensors[t.canonical]
        entry = {
            "key": t.key, "canonical": t.canonical, "role": t.role, "dtype": dtype_name(t.dtype),
            "shape": list(t.shape), "source_dtype": dtype_name(src.dtype),
            "scale_key": _scale_key(t) if t.role in QUANTIZED else t.key if t.role == SCALE else None,
            "offsets": list(ranges[t.key]), "sha256": hashes[t.key],
        }
        if t.role == INT4:
            entry["min_key"] = _min_key(t)
        if t.role in QUANTIZED:
            entry["rel_error"] = errors[t.key]
        entries.append(entry)
    blocks = []
    for prefix in block_prefixes(model, ckpt.family):
        spans = [ranges[t.key] for t in tensors if t.block == prefix]
        blocks.append({"name": prefix, "offsets": [min(s for s, _ in spans), max(e for _, e in spans)]})
    errs = list(errors.values())
    return {
        "format": SLAB_FORMAT,
        "format_version": format_version_for(bits),
        "created_by": f"lowvram-lora {VERSION}",
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "slab": {"file": path.name, "size": total, "header_sha256": _sha256(header[8:])},
        "source": ckpt.fingerprint(),
        "family": ckpt.family.id,
        "variant": ckpt.variant,
        "config": config,
        "quantization": {
            **_quantization_entry(bits),
            "applies_to": "every nn.Linear weight inside the family's transformer blocks, and the family's "
                          "int8_extra_linears (Flux.2: global modulation, text embedder)",
        },
        "summary": {
            "tensors": len(tensors),
            "quantized_linears": len(errs),
            "bytes": total,
            "max_rel_error": max(errs, default=0.0),
            "mean_rel_error": sum(errs) / len(errs) if errs else 0.0,
            "build_seconds": round(seconds, 3),
        },
        "blocks": blocks,
        "tensors": entries,
    }


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- build once, reuse after ---------------------------------------------------------


@contextlib.contextmanager
def _build_lock(path: Path):
    """One builder per slab across processes (two ComfyUI workers, a CLI run beside a node)."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock; the atomic renames still keep files consistent
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_slab(
    checkpoint: str | Path,
    slab_dir: str | Path,
    family: str = "auto",
    callback: ProgressCallback | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    bits: int = 8,
) -> Path:
    """The slab for ``checkpoint`` in ``slab_dir`` holding ``bits``-bit weights (8 or 4): reused when one built
    from the same weights (same source key: sizes + header hashes) with the same bits is there and intact, built
    otherwise. A path that already is a slab is checked and returned as is (whatever its bits)."""
    from .load import is_slab_file, verify_slab

    say = log or (lambda msg: None)
    src = Path(checkpoint).expanduser()
    if src.is_file() and is_slab_file(src):
        verify_slab(src)
        return src
    ckpt = open_checkpoint(src, family)
    key = ckpt.fingerprint()["key"]
    slab_dir = Path(slab_dir).expanduser()
    check_bits(bits)
    target = slab_dir / default_slab_name(ckpt, bits)
    tag = "-int4" if bits == 4 else ""
    with _build_lock(slab_dir / f".{key[:12]}.lock"):
        # Any slab of the same weights and bits, whatever the checkpoint was called when it was built.
        candidates = [target] + sorted(p for p in slab_dir.glob(f"*-{key[:12]}{tag}{SLAB_SUFFIX}") if p != target)
        for path in candidates:
            if not path.exists():
                continue
            try:
                manifest = verify_slab(path)
            except SlabError as exc:
                say(f"slab '{path}' is unusable ({exc}); rebuilding")
                continue
            if manifest["source"]["key"] == key and slab_bits(manifest) == bits:
                say(f"reusing slab '{path}'")
                return path
        legacy = ckpt.fingerprint()["legacy_key"]
        stale = sorted(slab_dir.glob(f"*-{legacy[:12]}{SLAB_SUFFIX}")) if legacy != key else []
        if stale:
            say(f"not reusing slab '{stale[0]}': it was built from this checkpoint by an older version that ignored "
                f"its fp8 weight_scale (weights off by that scale); building a correct one (the old file may be deleted)")
        say(f"building slab '{target}' from '{ckpt.path}' (once; reused afterwards)")
        return _build(ckpt, target, callback, progress, DEFAULT_CHUNK_BYTES, bits)
