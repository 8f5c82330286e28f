"""A single ``.safetensors`` file with original (BFL / ComfyUI) names, as ComfyUI users keep in
``models/diffusion_models/``: bf16, fp16, fp32, fp8, scaled fp8, ComfyUI's fp8-mixed, with or without
``model.diffusion_model.`` prefixes. Identified by its tensor names and shapes; fused tensors (qkv, linear1)
resolve to row ranges, so each diffusers tensor is read on its own."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ...errors import ModelLoadError
from ...families import ModelFamily, families, family_for_single_file, get_family, meta_model
from ..files import SafetensorsFile, is_slab_file
from ..identity import KEY_PREFIXES, Checkpoint, CheckpointIdentity, SourceTensor
from ..tensors import TensorStore, open_files
from . import CheckpointKind


class SingleFile(CheckpointKind):
    name = "single_file"
    description = "single file"

    def claims(self, path: Path) -> bool:
        return path.is_file() and not is_slab_file(path)

    def identify(self, path: Path, family_id: str) -> tuple[ModelFamily, str, dict[str, Any]]:
        return identify_single_file(SafetensorsFile(path), family_id)

    def open(self, ident: CheckpointIdentity) -> Checkpoint:
        store = TensorStore(open_files([ident.path], "the transformer"), KEY_PREFIXES)
        tensors: dict[str, SourceTensor] = {}
        for param in ident.family.param_table(ident.config):
            e = store.entries[param.name]
            if param.flat:  # one diffusers tensor flattened natively
                part = param.parts[0]
                tensors[part.name] = SourceTensor(part.name, param.name, 0, (part.rows, e.shape[0] // part.rows),
                                                  e.dtype, e.scale_key is not None, flat=True)
                continue
            for part in param.parts:
                fused = len(param.parts) > 1
                rows = part.rows if fused else e.shape[0]
                tensors[part.name] = SourceTensor(part.name, param.name, part.offset if fused else 0,
                                                  (rows,) + e.shape[1:], e.dtype, e.scale_key is not None,
                                                  param.swap_halves)
        return Checkpoint(ident, store, tensors)


KIND = SingleFile()


def identify_single_file(f: SafetensorsFile, family_id: str) -> tuple[ModelFamily, str, dict[str, Any]]:
    """(family, variant, config) of a file with original names: the family from its tensor names, the variant
    whose shapes all fit (told apart further by name or flag)."""
    found = {n: s for n, s in TensorStore([f], KEY_PREFIXES).shapes().items()}
    detected = family_for_single_file(set(found))
    if family_id == "auto":
        if detected is None:
            some = ", ".join(sorted(found)[:3]) or "(no tensors)"
            raise ModelLoadError(
                f"'{f.path}' is not a checkpoint of a supported family ({', '.join(f.display_name for f in families().values())}"
                f"; first tensors in the file: {some}). Set the family explicitly to see what is missing"
            )
        family = detected
    else:
        family = get_family(family_id)
        if detected is not family:
            first = sorted(found)[0] if found else "(no tensors)"
            example = family.param_table(family.load_config(family.tiny_variant))[-1].name
            raise ModelLoadError(
                f"'{f.path}' is not a {family.display_name} checkpoint: expected {family.display_name}'s native tensor "
                f"names (such as '{example}'), first tensor in the file is '{first}'"
                + (f"; it looks like {detected.display_name}" if detected is not None else "")
            )
    keys = set(found)
    # An entry ending in '.' is a prefix: a checkpoint that bundles other models (LTX-2's VAEs and connectors).
    unused = tuple(k for k in family.unused_native_keys if k.endswith("."))
    found = {n: s for n, s in found.items() if n not in family.unused_native_keys and not n.startswith(unused)}
    matched, config = _match_variant(f.path, family, found)
    variant = family.variant_from_name(matched, f.path.name, keys)
    if variant != matched and variant in family.variants:  # told apart by name or flag: that variant's config
        config = family.load_config(variant)  # (the same shapes; Qwen-Image-Edit-2511's zero_cond_t differs)
        count, first = _first_mismatch(found, expected_single_file_shapes(family, config))
        if count:
            raise ModelLoadError(f"'{f.path}' is named like {family.display_name} {variant}, but its tensors do not "
                                 f"fit that variant ({count} mismatches, first: {first}); rename the file")
    return family, variant, config


#: (family, config as sorted JSON) -> its shapes. A pure function of the family's code and the config, and
#: building a full-size model on the meta device takes 0.1-0.4 s: identifying one file tries every shipped
#: variant (16 for Wan), so without this each identification of the same kind of file rebuilt them all.
_SHAPES: dict[tuple[ModelFamily, str], dict[str, tuple[int, ...]]] = {}


def expected_single_file_shapes(family: ModelFamily, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Original name -> shape, derived from the diffusers model built on the meta device (once per family and
    config; the caller gets its own copy)."""
    key = (family, json.dumps(config, sort_keys=True, default=str))
    if key not in _SHAPES:
        model = meta_model(family, config)
        diffusers_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        shapes = {}
        for param in family.param_table(config):
            parts = [diffusers_shapes[p.name] for p in param.parts]
            shapes[param.name] = (math.prod(parts[0]),) if param.flat else (sum(s[0] for s in parts),) + parts[0][1:]
        _SHAPES[key] = shapes
    return dict(_SHAPES[key])


def _first_mismatch(found: dict[str, tuple], expected: dict[str, tuple]) -> tuple[int, str]:
    problems = []
    for name, shape in expected.items():
        if name not in found:
            problems.append(f"tensor '{name}' is missing (expected shape {list(shape)})")
        elif found[name] != shape:
            problems.append(f"tensor '{name}' has shape {list(found[name])}, expected {list(shape)}")
    problems += [f"unexpected tensor '{k}'" for k in sorted(k for k in found if k not in expected)]
    return len(problems), (problems[0] if problems else "")


def _match_variant(path: Path, family: ModelFamily, found: dict[str, tuple]):
    # Only a variant with exactly the file's tensor names can match, and its names come from the config alone:
    # shapes (a model built on the meta device) are compared for those; all variants only for the message. Twins on
    # one config (LTX-2's image-to-video variants) are tried once: the first listed (text-to-video) wins.
    tried = set()
    for variant in family.variants:
        if family.variants[variant] in tried:
            continue
        tried.add(family.variants[variant])
        config = family.load_config(variant)
        if ({p.name for p in family.param_table(config)} == found.keys()
                and _first_mismatch(found, expected_single_file_shapes(family, config))[0] == 0):
            return variant, config
    best, tried = None, set()
    for variant in family.variants:
        if family.variants[variant] in tried:  # a twin on the same config (LTX-2's image-to-video variants)
            continue
        tried.add(family.variants[variant])
        config = family.load_config(variant)
        count, first = _first_mismatch(found, expected_single_file_shapes(family, config))
        if count == 0:
            return variant, config
        if best is None or count < best[0]:
            best = (count, first, variant)
    raise ModelLoadError(
        f"'{path}' does not match any {family.display_name} variant "
        f"({', '.join(family.variants)}); closest is {best[2]} with {best[0]} mismatches, "
        f"first: {best[1]}. Is this a {family.display_name} checkpoint?"
    )
