"""Open, check and load a slab.

    model, family, variant = load_slab_transformer("x.slab.safetensors", torch.bfloat16, "cpu")

Checks, in order, each failing with a message that ends in the command to rebuild:
manifest present and readable, format version, file size, header hash, header
agrees with the manifest (names, dtypes, shapes, offsets), family and variant,
then every tensor the model needs (every Linear of every block as int8 + scale,
everything else plain) present with its shape; nothing unmatched. ``verify="full"``
also re-hashes every tensor's bytes (reads the whole file).

Tensors come from safetensors' memory map (page cache, shared between processes):
int8 weights and scales are not copied on the CPU; plain tensors are converted
to ``dtype``.
"""
from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.files import UnreadableSafetensors
from ..errors import ConfigError, ModelLoadError
from ..families import ModelFamily, get_family
from .format import (
    FORMAT_VERSION, PAD_PREFIX, SLAB_FORMAT, SLAB_SUFFIX, SafetensorsFile, SlabError, dtype_name, is_slab_file,
    manifest_path_for, sha256_range, slab_bits,
)
from .layout import INT8, PLAIN, QUANTIZED, meta_model, slab_tensors, swap_in_int8_linears
from .source import FileStamp, record_slab_source


def rebuild_command(slab_path: str | Path, manifest: dict | None = None) -> str:
    source = (manifest or {}).get("source", {}).get("path") or "CHECKPOINT"
    family = (manifest or {}).get("family")
    cmd = f"lowvram-lora slab build {shlex.quote(source)} -o {shlex.quote(str(slab_path))}"
    bits = slab_bits(manifest or {})
    return cmd + (f" --family {family}" if family else "") + (f" --bits {bits}" if bits != 8 else "")


@dataclass
class OpenSlab:
    """A slab whose manifest and header have been checked against each other."""

    path: Path
    manifest: dict[str, Any]
    file: SafetensorsFile

    @property
    def family_id(self) -> str:
        return self.manifest["family"]

    @property
    def variant(self) -> str:
        return self.manifest["variant"]


def read_manifest(slab_path: str | Path) -> dict[str, Any]:
    slab = Path(slab_path)
    mpath = manifest_path_for(slab)
    if not slab.exists():
        raise SlabError(f"slab '{slab}' does not exist; build it with: {rebuild_command(slab)}")
    if not mpath.exists():
        raise SlabError(
            f"slab '{slab}' has no manifest ('{mpath.name}'): its build did not finish, or the manifest "
            f"was deleted. Rebuild it with: {rebuild_command(slab)}"
        )
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SlabError(f"manifest '{mpath}' is unreadable ({exc}); rebuild with: {rebuild_command(slab)}") from None
    if not (isinstance(manifest, dict) and isinstance(manifest.get("slab"), dict)
            and isinstance(manifest.get("tensors"), list) and "family" in manifest):
        raise SlabError(f"manifest '{mpath}' is incomplete; rebuild with: {rebuild_command(slab)}")
    if manifest.get("format") != SLAB_FORMAT:
        raise SlabError(f"'{mpath}' is not a {SLAB_FORMAT} manifest; rebuild with: {rebuild_command(slab)}")
    version = manifest.get("format_version")
    if not (isinstance(version, int) and 1 <= version <= FORMAT_VERSION):
        newer = isinstance(version, int) and version > FORMAT_VERSION
        raise SlabError(
            f"slab '{slab}' has format version {version}; this lowvram-lora reads versions 1 to {FORMAT_VERSION}"
            + (" (update lowvram-lora, or " if newer else " (") + f"rebuild with: {rebuild_command(slab, manifest)})"
        )
    source = manifest.get("source") if isinstance(manifest.get("source"), dict) else {}
    if "decoder_version" not in source and any(str(t.get("source_dtype", "")).startswith("float8")
                                                 for t in manifest["tensors"] if isinstance(t, dict)):
        raise SlabError(
            f"slab '{slab}' was built from an fp8 checkpoint by an older lowvram-lora that ignored ComfyUI's "
            f"per-layer weight_scale, so its weights may be off by that scale; rebuild it with: "
            f"{rebuild_command(slab, manifest)}")
    return manifest


VERIFY_MODES = ("changed", "quick", "full")


def _file_stamp(slab: Path, manifest: dict) -> dict:
    st = slab.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino,
            "header_sha256": manifest["slab"]["header_sha256"]}


def verified_stamp_path(slab: Path) -> Path:
    """Where a slab's last full verification is recorded (hidden, beside it)."""
    return slab.with_name(f".{slab.name}.verified.json")


def _verified_unchanged(slab: Path, manifest: dict) -> bool:
    try:
        recorded = json.loads(verified_stamp_path(slab).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(recorded, dict) and {k: recorded.get(k) for k in ("size", "mtime_ns", "inode", "header_sha256")} \
        == _file_stamp(slab, manifest)


def record_verified(slab: Path, manifest: dict) -> None:
    """Remember that every tensor hash matched for the file as it is now (size, mtime, inode).
    Best effort: in a read-only folder the hashes are simply checked on every first use."""
    from ..errors import StorageError
    from ..fileio import write_json_atomic

    try:
        write_json_atomic(verified_stamp_path(slab), _file_stamp(slab, manifest), "the slab's verification record")
    except (StorageError, OSError):
        pass


def open_slab(slab_path: str | Path, verify: str = "changed") -> OpenSlab:
    """Manifest + header, cross-checked. ``verify``: "quick" (size, header hash, entries;
    instant), "full" (also every tensor's sha256; reads the whole file) or "changed" (the
    default: "full" on the first use of the file and after it changed -- size, mtime or
    inode differ from the last full check -- else "quick")."""
    if verify not in VERIFY_MODES:
        raise ConfigError(f"verify={verify!r} is not one of {', '.join(VERIFY_MODES)}")
    slab = Path(slab_path).expanduser()
    manifest = read_manifest(slab)
    if verify == "changed":
        verify = "quick" if slab.exists() and _verified_unchanged(slab, manifest) else "full"
        record = verify == "full"
    else:
        record = verify == "full"
    again = rebuild_command(slab, manifest)
    size, expected = slab.stat().st_size, manifest["slab"]["size"]
    if size != expected:
        raise SlabError(
            f"slab '{slab}' is {size} bytes but its manifest says {expected}: the file is "
            f"{'truncated' if size < expected else 'damaged'}. Rebuild it with: {again}"
        )
    try:
        file = SafetensorsFile(slab)
    except ModelLoadError as exc:  # a slab's fix is a rebuild, not a download
        raise SlabError(f"slab '{slab}' is corrupted ({exc.problem if isinstance(exc, UnreadableSafetensors) else exc}). Rebuild it with: {again}") from None
    if file.header_sha256 != manifest["slab"]["header_sha256"]:
        raise SlabError(
            f"slab '{slab}': its header does not match the manifest (hash mismatch): the file is corrupted "
            f"or was replaced. Rebuild it with: {again}"
        )
    problems = []
    listed = {e["key"]: e for e in manifest["tensors"]}
    for key, entry in file.entries.items():
        if key.startswith(PAD_PREFIX):
            continue
        m = listed.pop(key, None)
        if m is None:
            problems.append(f"'{key}' is in the file but not in the manifest")
        elif (m["dtype"], list(m["shape"]), list(m["offsets"])) != (
            dtype_name(entry.dtype), list(entry.shape), [file.data_start + entry.start, file.data_start + entry.end]
        ):
            problems.append(f"'{key}' differs between file and manifest")
    problems += [f"'{k}' is in the manifest but not in the file" for k in listed]
    if verify == "full":
        problems += _hash_problems(slab, [m for m in manifest["tensors"] if m["key"] in file.entries])
    if problems:
        raise SlabError(
            f"slab '{slab}' does not match its manifest ({len(problems)} problems: {'; '.join(problems[:8])}"
            f"{'; ...' if len(problems) > 8 else ''}). Rebuild it with: {again}"
        )
    if record:
        record_verified(slab, manifest)
    return OpenSlab(slab, manifest, file)


def _hash_problems(slab: Path, entries: list[dict]) -> list[str]:
    """Re-hash every tensor's bytes, on a few threads (hashlib and file reads release the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    workers = max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="slab-verify") as pool:
        digests = list(pool.map(lambda m: sha256_range(slab, *m["offsets"]), entries))
    return [f"'{m['key']}' has corrupted bytes (sha256 mismatch)" for m, d in zip(entries, digests) if d != m["sha256"]]


def last_check(slab_path: str | Path) -> str:
    """"full" when the tensor hashes were checked for the file as it is now, else "quick"."""
    slab = Path(slab_path).expanduser()
    try:
        return "full" if _verified_unchanged(slab, read_manifest(slab)) else "quick"
    except Exception:
        return "quick"


def verify_slab(slab_path: str | Path, verify: str = "changed") -> dict[str, Any]:
    """Raises SlabError if the slab is incomplete or damaged; returns its manifest."""
    return open_slab(slab_path, verify).manifest


def resolve_slab_family(slab: OpenSlab, family_id: str = "auto", variant: str | None = None) -> ModelFamily:
    """The slab's family, after checking it is the one asked for and its config is its variant's."""
    again = rebuild_command(slab.path, slab.manifest)
    try:
        family = get_family(slab.family_id)
    except ConfigError as exc:
        raise SlabError(f"slab '{slab.path}' is for family {slab.family_id!r}, which this version does not know ({exc})") from None
    if family_id != "auto" and family_id != family.id:
        wanted = get_family(family_id).display_name
        raise SlabError(
            f"slab '{slab.path}' holds a {family.display_name} model ({slab.variant}), but {wanted} was asked for; "
            f"pick a slab built from a {wanted} checkpoint (lowvram-lora slab build CHECKPOINT -o DIR --family {family_id})"
        )
    if variant is not None and variant != slab.variant:
        raise SlabError(
            f"slab '{slab.path}' is {family.display_name} {slab.variant}, but variant {variant} was asked for; "
            f"pick the slab of a {variant} checkpoint"
        )
    if slab.variant in family.variants:
        shipped = family.load_config(slab.variant)
        config = slab.manifest["config"]
        diff = [k for k in family.structural_keys if k in shipped and shipped.get(k) != config.get(k)]
        if diff:
            raise SlabError(
                f"slab '{slab.path}' says {slab.variant} but its config differs from {slab.variant}'s in "
                f"{', '.join(diff)}; the manifest is wrong. Rebuild it with: {again}"
            )
    return family


def check_slab_fits_model(slab: OpenSlab, model: torch.nn.Module, family: ModelFamily) -> None:
    """Every tensor the model needs is in the slab with its shape (every block Linear as
    int8 + scale, or int4 + scale + min), and the slab holds nothing else. Lists every problem."""
    expected = {t.key: t for t in slab_tensors(model, family, lambda name: None, slab_bits(slab.manifest))}
    listed = {e["key"]: e for e in slab.manifest["tensors"]}
    problems = []
    for key, t in expected.items():
        m = listed.get(key)
        if m is None:
            what = (f"block Linear weight '{t.canonical}' ({'int8' if t.role == INT8 else 'int4'})"
                    if t.role in QUANTIZED else f"'{key}'")
            problems.append(f"missing {what}")
        elif list(m["shape"]) != list(t.shape):
            problems.append(f"'{key}' is {list(m['shape'])} in the slab, the model needs {list(t.shape)}")
        elif m["role"] != t.role or (t.role != PLAIN and m["dtype"] != dtype_name(t.dtype)):
            problems.append(f"'{key}' is stored as {m['role']}/{m['dtype']}, expected {t.role}/{dtype_name(t.dtype) if t.dtype else 'float'}")
    problems += [f"unmatched slab tensor '{k}'" for k in listed if k not in expected]
    if problems:
        shown = "\n  ".join(problems[:40])
        more = f"\n  ... and {len(problems) - 40} more" if len(problems) > 40 else ""
        raise SlabError(
            f"slab '{slab.path}' does not fit {family.display_name} ({slab.variant}): {len(problems)} "
            f"unmatched or mismatched tensors:\n  {shown}{more}\n"
            f"Rebuild it with: {rebuild_command(slab.path, slab.manifest)}"
        )


def load_slab_transformer(
    slab_path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    family_id: str = "auto",
    variant: str | None = None,
    verify: str = "changed",
) -> tuple[torch.nn.Module, ModelFamily, str]:
    """(model, family, variant): block Linears are ``Int8Linear`` (int8 + fp32 scales, not
    copied from the map on CPU; ``Int4Linear`` for an int4 slab), every other tensor in ``dtype``. ``device="cuda"`` puts the
    whole model on the GPU as stored: resident int8 mode, each Linear dequantized on the fly."""
    slab = open_slab(slab_path, verify)
    stamp = FileStamp.of(slab.path)  # the file as loaded: the disk tier refuses to read a changed one
    family = resolve_slab_family(slab, family_id, variant)
    model = meta_model(family, slab.manifest["config"])
    check_slab_fits_model(slab, model, family)
    swap_in_int8_linears(model, family, slab_bits(slab.manifest))
    roles = {e["key"]: e["role"] for e in slab.manifest["tensors"]}
    from safetensors import safe_open

    state = {}
    with safe_open(str(slab.path), framework="pt") as f:
        for key in f.keys():
            if key.startswith(PAD_PREFIX):
                continue
            tensor = f.get_tensor(key)  # a view of the memory map
            if roles[key] == PLAIN and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            state[key] = tensor
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    model.eval()
    # Where each tensor sits in the file: the disk tier (engine/offload/disk.py) reads blocks from there. Block
    # tensors stay views of the map until something reads them, so a block kept on disk is never in RAM.
    record_slab_source(model, slab.path, slab.file, stamp, rebuild_command(slab.path, slab.manifest))
    if torch.device(device).type != "cpu":
        model.to(device)
    return model, family, slab.variant

