"""Load a family's transformer from local files only.

Two file forms: a diffusers folder (a pipeline folder or its ``transformer/``
subfolder) and a single ``.safetensors`` file with original BFL names, as ComfyUI
users keep in ``models/diffusion_models/`` (often fp8). The single file is read
tensor by tensor from a memory map and assigned into a model built on the meta
device, so the weights exist once in RAM, not twice.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import ModelLoadError
from ..families import ModelFamily, family_for_class_name, family_for_single_file, get_family
from ..families import load_shipped_config
from ..families.base import meta_model
from ..families.flux1_names import BflParam, split_bfl_tensor

# Prefixes seen in the wild on single-file checkpoints (ComfyUI full checkpoints,
# some trainers' exports); stripped before matching.
_SINGLE_FILE_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


@dataclass
class TransformerSource:
    """Where a transformer's weights are: resolved once, reported to the user."""

    kind: str  # "diffusers" | "single_file" | "slab" (returned by load_transformer only)
    path: Path  # the transformer folder or the .safetensors file
    pipeline_folder: Path | None  # the enclosing pipeline folder, if any


def resolve_transformer_source(path: str | Path) -> TransformerSource:
    p = Path(path).expanduser()
    if not str(path):
        raise ModelLoadError("no transformer path given; point it at a diffusers folder or a .safetensors file")
    if not p.exists():
        raise ModelLoadError(f"transformer path '{p}' does not exist; check the path (models go in models/diffusion_models/)")
    if p.is_file():
        if p.suffix != ".safetensors":
            raise ModelLoadError(f"'{p}' is not a .safetensors file; only safetensors checkpoints are loaded (never pickles)")
        return TransformerSource("single_file", p, None)
    if (p / "model_index.json").exists() and (p / "transformer" / "config.json").exists():
        return TransformerSource("diffusers", p / "transformer", p)
    if (p / "config.json").exists():
        parent = p.parent if (p.parent / "model_index.json").exists() else None
        return TransformerSource("diffusers", p, parent)
    raise ModelLoadError(
        f"'{p}' is a folder but neither a diffusers pipeline folder (model_index.json + transformer/) "
        f"nor a transformer folder (config.json); point at one of those or at a .safetensors file"
    )


def load_transformer(
    path: str | Path, family_id: str = "auto", dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.nn.Module, ModelFamily, TransformerSource, str]:
    """Returns (model on CPU in ``dtype``, family, source, variant id).

    A slab (``*.slab.safetensors`` with its manifest, see ``engine/slab``) loads with its
    block Linears as int8 ``Int8Linear`` modules; its source kind is "slab"."""
    source = resolve_transformer_source(path)
    if source.kind == "single_file":
        from ..slab.load import is_slab_file, load_slab_transformer

        if is_slab_file(source.path):
            model, family, variant = load_slab_transformer(source.path, dtype, "cpu", family_id)
            return model, family, TransformerSource("slab", source.path, None), variant
    if source.kind == "diffusers":
        model, family, variant = _load_diffusers_folder(source.path, family_id, dtype)
    else:
        model, family, variant = _load_single_file(source.path, family_id, dtype)
    model.requires_grad_(False)
    model.eval()
    return model, family, source, variant


# --- diffusers folder -----------------------------------------------------------


def identify_diffusers_folder(folder: Path, family_id: str = "auto") -> tuple[ModelFamily, str, dict[str, Any]]:
    """(family, variant, config) of a diffusers transformer folder, from its config.json alone."""
    config = json.loads((folder / "config.json").read_text())
    class_name = config.get("_class_name", "")
    family = family_for_class_name(class_name)
    if family is None or (family_id != "auto" and family.id != family_id):
        expected = get_family(family_id).display_name if family_id != "auto" else "a supported family"
        raise ModelLoadError(
            f"'{folder}' holds a {class_name or 'unknown'} model, expected {expected} "
            f"(config.json _class_name should be one of the registered families' classes)"
        )
    return family, _variant_for_config(family, config), config


def _load_diffusers_folder(folder: Path, family_id: str, dtype: torch.dtype):
    family, variant, _ = identify_diffusers_folder(folder, family_id)
    cls = family.transformer_class()
    try:
        model = cls.from_pretrained(folder, torch_dtype=dtype, low_cpu_mem_usage=True, local_files_only=True,
                                    use_safetensors=True)  # never unpickle a .bin
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"could not load the transformer from '{folder}': {exc}") from exc
    return model, family, variant


def _variant_for_config(family: ModelFamily, config: dict[str, Any]) -> str:
    keys = ("num_layers", "num_single_layers", "attention_head_dim", "num_attention_heads", "guidance_embeds")
    for variant, filename in family.variants.items():
        shipped = load_shipped_config(filename)
        if all(shipped.get(k) == config.get(k) for k in keys):
            return variant
    return "custom"


# --- single file (BFL names) ----------------------------------------------------


def _strip_prefix(key: str) -> str:
    for prefix in _SINGLE_FILE_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def read_single_file_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names (prefix stripped) -> shapes, from the header only."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {_strip_prefix(k): tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types
        raise ModelLoadError(f"'{path}' is not a readable safetensors file ({exc}); re-download or re-export it") from exc


def expected_single_file_shapes(family: ModelFamily, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """BFL name -> shape, derived from the diffusers model built on the meta device."""
    model = meta_model(family, config)
    diffusers_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    shapes = {}
    for param in family.param_table(config):
        parts = [diffusers_shapes[p.name] for p in param.parts]
        shapes[param.name] = (sum(s[0] for s in parts),) + parts[0][1:]
    return shapes


def _first_mismatch(found: dict[str, tuple], expected: dict[str, tuple]) -> tuple[int, str]:
    """(number of mismatches, description of the first) between a file and a variant."""
    problems = []
    for name, shape in expected.items():
        if name not in found:
            problems.append(f"tensor '{name}' is missing (expected shape {list(shape)})")
        elif found[name] != shape:
            problems.append(f"tensor '{name}' has shape {list(found[name])}, expected {list(shape)}")
    extra = sorted(k for k in found if k not in expected and not _is_ignorable(k))
    problems += [f"unexpected tensor '{k}'" for k in extra]
    return len(problems), (problems[0] if problems else "")


# Quantization side tensors, never model parameters: scaled-fp8 checkpoints (``.scale_weight``,
# ``.scale_input``, a ``scaled_fp8`` marker) and ComfyUI's mixed-precision files such as
# flux2_dev_fp8mixed.safetensors (``comfy/ops.py``: per layer ``comfy_quant`` = JSON format tag,
# ``weight_scale``, optional ``input_scale``).
_QUANT_SUFFIXES = (".scale_weight", ".scale_input", ".weight_scale", ".input_scale", ".comfy_quant",
                   ".weight_scale_2")


def _is_ignorable(key: str) -> bool:
    return key.endswith(_QUANT_SUFFIXES) or key == "scaled_fp8"


def _match_variant(path: Path, family: ModelFamily, found: dict[str, tuple]):
    best = None
    for variant, filename in family.variants.items():
        config = load_shipped_config(filename)
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


def identify_single_file(path: Path, family_id: str = "auto") -> tuple[ModelFamily, str, dict[str, Any]]:
    """(family, variant, config) of a BFL single file, from its header alone."""
    found = read_single_file_shapes(path)
    detected = family_for_single_file(set(found))
    if family_id == "auto":
        if detected is None:
            some = ", ".join(sorted(found)[:3])
            raise ModelLoadError(
                f"'{path}' is not a checkpoint of a supported family (expected Flux.1 BFL names such as "
                f"'double_blocks.0.img_attn.qkv.weight'; first tensors in the file: {some})"
            )
        family = detected
    else:
        family = get_family(family_id)
        if detected is not family:
            first = sorted(found)[0] if found else "(no tensors)"
            raise ModelLoadError(
                f"'{path}' is not a {family.display_name} checkpoint: expected tensors like "
                f"'double_blocks.0.img_attn.qkv.weight', first tensor in the file is '{first}'"
            )
    variant, config = _match_variant(path, family, found)
    return family, variant, config


def _load_single_file(path: Path, family_id: str, dtype: torch.dtype):
    family, variant, config = identify_single_file(path, family_id)
    table = family.param_table(config)
    state = _read_converted_state_dict(path, table, dtype)

    model = meta_model(family, config)
    model.load_state_dict(state, strict=True, assign=True)
    return model, family, variant


def _read_converted_state_dict(path: Path, table: list[BflParam], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """BFL tensors -> diffusers tensors in ``dtype``, one tensor at a time from the mmap."""
    state: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        names = {_strip_prefix(k): k for k in f.keys()}
        for param in table:
            raw = f.get_tensor(names[param.name])
            if param.name.endswith(".weight"):
                raw = _dequantized(f, names, param.name[: -len(".weight")], raw, path)
            tensor = raw.to(dtype)
            for name, part in split_bfl_tensor(param, tensor).items():
                state[name] = part.contiguous() if len(param.parts) > 1 else part
    return state


def _dequantized(f, names: dict[str, str], module: str, raw: torch.Tensor, path: Path) -> torch.Tensor:
    """A stored weight as real values: fp8 times its per-tensor scale (``scale_weight`` in scaled-fp8
    files, ``weight_scale`` in ComfyUI's mixed files); a format we cannot decode is an error."""
    quant = names.get(f"{module}.comfy_quant")
    if quant is not None:
        import json

        fmt = json.loads(bytes(f.get_tensor(quant).tolist()).decode() or "{}").get("format", "")
        if fmt not in ("float8_e4m3fn", "float8_e5m2"):
            raise ModelLoadError(
                f"'{path}': layer '{module}' is stored as {fmt or 'an unknown format'!r}, which this loader "
                f"cannot dequantize (fp8 and bf16/fp16 files work); use the bf16 or fp8 release of the model"
            )
    scale = names.get(f"{module}.scale_weight") or names.get(f"{module}.weight_scale")
    if scale is None:
        return raw
    return raw.to(torch.float32) * f.get_tensor(scale).to(torch.float32)
