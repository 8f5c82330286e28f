"""Tensors as stored -> tensors as meant: the one place that knows every decoding rule.

A checkpoint in the wild is one or more safetensors files whose keys may carry wrapper
prefixes, and whose weights may be stored in several forms:

- float32 / float16 / bfloat16: as is;
- float8 (e4m3fn, e5m2) with no scale: a plain cast (``*_fp8_e4m3fn`` files);
- legacy scaled fp8 (a ``scaled_fp8`` marker, per layer ``<layer>.scale_weight`` and an optional
  ``<layer>.scale_input``): ``w.float() * scale_weight``;
- ComfyUI's mixed-precision files (``flux2_dev_fp8mixed``, ``*_fp8_scaled``; ComfyUI ``comfy/ops.py``
  and ``comfy/utils.py convert_old_quants``): per layer a ``<layer>.comfy_quant`` tag (uint8 JSON,
  ``{"format": "float8_e4m3fn"}``) or the header's ``_quantization_metadata``, with
  ``<layer>.weight_scale`` and an optional ``<layer>.input_scale``: ``w.float() * weight_scale``.

A scale is one number (per tensor) or one per output row. Formats that cannot be decoded here
(nvfp4 with ``weight_scale_2``, int8 or block-wise formats, anything unknown) are refused by name,
never read as garbage. Input scales are activation statistics for fp8 matmuls: not weights, skipped.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ModelLoadError
from .files import SafetensorsFile

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Formats a ``comfy_quant`` tag may name that decode here (fp8 times its scale).
DECODABLE_FORMATS = ("float8_e4m3fn", "float8_e5m2")
#: Quantization side tensors: never model parameters.
SIDE_SUFFIXES = (".scale_weight", ".scale_input", ".weight_scale", ".input_scale", ".comfy_quant",
                 ".weight_scale_2")
SIDE_KEYS = ("scaled_fp8",)
#: Bumped when a decoding rule changes what a stored tensor reads as. Slabs record it, so a slab
#: built under older rules is never reused for a checkpoint those rules read wrongly.
DECODER_VERSION = 2  # 2: ComfyUI ``weight_scale`` / ``comfy_quant`` (1 ignored them: weights off by the scale)


def is_side_tensor(name: str) -> bool:
    return name.endswith(SIDE_SUFFIXES) or name in SIDE_KEYS


def strip_prefix(key: str, prefixes: tuple[str, ...]) -> str:
    """``key`` without the first of ``prefixes`` it starts with, and without peft's ``.base_layer``."""
    for prefix in prefixes:
        if prefix and key.startswith(prefix):
            key = key[len(prefix):]
            break
    return key.replace(".base_layer.", ".")


@dataclass(frozen=True)
class StoredTensor:
    """One logical tensor: where its bytes are and how they decode."""

    name: str  # logical name (prefix stripped)
    file: SafetensorsFile
    key: str  # key in the file
    dtype: torch.dtype  # as stored
    shape: tuple[int, ...]
    scale_key: str | None = None  # per-tensor or per-row scale to multiply in (fp32)
    scale_rule: str | None = None  # "scale_weight" | "weight_scale": which convention the file used

    @property
    def decoded_dtype(self) -> torch.dtype:
        """What ``TensorStore.read`` returns: the stored dtype, or fp32 when a scale is multiplied in."""
        return torch.float32 if self.scale_key else self.dtype


class TensorStore:
    """Logical name -> decoded tensor, over one or more safetensors files.

    ``prefixes``: wrapper prefixes stripped from keys, first match wins (the empty prefix keeps keys).
    """

    def __init__(self, files: list[SafetensorsFile], prefixes: tuple[str, ...] = ()):
        self.files = files
        self.path = files[0].path if len(files) == 1 else files[0].path.parent
        self.entries: dict[str, StoredTensor] = {}
        raw: dict[str, tuple[SafetensorsFile, str]] = {}
        for f in files:
            for key in f.entries:
                name = strip_prefix(key, prefixes)
                if name in raw:
                    raise ModelLoadError(f"'{self.path}': tensor '{name}' appears twice ({raw[name][0].path.name}, "
                                         f"{f.path.name}); re-download the model")
                raw[name] = (f, key)
        formats = self._layer_formats(raw)
        for name, (f, key) in raw.items():
            if is_side_tensor(name):
                continue
            e = f.entries[key]
            scale_key, rule = None, None
            if name.endswith(".weight"):
                layer = name[: -len(".weight")]
                fmt = formats.get(layer)
                if fmt is not None and fmt not in DECODABLE_FORMATS:
                    raise ModelLoadError(
                        f"'{f.path}': layer '{layer}' is stored as {fmt!r}, which this loader cannot dequantize "
                        f"(bf16, fp16, fp32, fp8 and scaled fp8 work); use the bf16 or fp8 release of the model")
                for suffix, rule_name in ((".scale_weight", "scale_weight"), (".weight_scale", "weight_scale")):
                    if layer + suffix in raw:
                        scale_key, rule = raw[layer + suffix][1], rule_name
                        break
                if layer + ".weight_scale_2" in raw:
                    raise ModelLoadError(
                        f"'{f.path}': layer '{layer}' carries a second-level scale (weight_scale_2: nvfp4), which "
                        f"this loader cannot dequantize; use the bf16 or fp8 release of the model")
                if scale_key is not None:
                    self._check_scale(f, raw[layer + ("." + rule)][0], scale_key, e.shape, layer)
            if e.dtype not in FLOAT_DTYPES + FP8_DTYPES and name.endswith(".weight"):
                raise ModelLoadError(
                    f"'{f.path}': weight '{name}' is stored as {e.dtype} (a quantized format this loader cannot "
                    f"decode); use the bf16 or fp8 release of the model")
            self.entries[name] = StoredTensor(name, f, key, e.dtype, e.shape, scale_key, rule)

    @staticmethod
    def _layer_formats(raw: dict[str, tuple[SafetensorsFile, str]]) -> dict[str, str]:
        """Layer -> quantization format, from ``comfy_quant`` tags and ``_quantization_metadata``."""
        formats: dict[str, str] = {}
        for f in {id(f): f for f, _ in raw.values()}.values():
            meta = f.metadata.get("_quantization_metadata")
            if meta:
                try:
                    layers = json.loads(meta).get("layers", {})
                except (json.JSONDecodeError, AttributeError):
                    raise ModelLoadError(f"'{f.path}': unreadable _quantization_metadata; re-download the model") from None
                for layer, info in layers.items():
                    fmt = info.get("format", "") if isinstance(info, dict) else str(info)
                    formats[layer.removeprefix("model.diffusion_model.")] = fmt
        for name, (f, key) in raw.items():
            if name.endswith(".comfy_quant"):
                try:
                    fmt = json.loads(bytes(f.read(key).reshape(-1).tolist()).decode() or "{}").get("format", "")
                except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
                    fmt = "an unreadable comfy_quant tag"
                formats[name[: -len(".comfy_quant")]] = fmt
        return formats

    @staticmethod
    def _check_scale(weight_file, scale_file, scale_key: str, shape: tuple[int, ...], layer: str) -> None:
        s = scale_file.entries[scale_key]
        n = 1
        for d in s.shape:
            n *= d
        rows = shape[0] if shape else 1
        if n not in (1, rows):
            raise ModelLoadError(
                f"'{weight_file.path}': layer '{layer}' has a scale of shape {list(s.shape)}, neither one number nor "
                f"one per row of its {list(shape)} weight (a block-wise format this loader cannot dequantize)")

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: v.shape for k, v in self.entries.items()}

    def read(self, name: str, row_start: int = 0, row_count: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``[row_start, row_start + row_count)`` of ``name``, decoded: the stored dtype, or fp32 with the
        scale multiplied in. ``out``: a uint8 buffer to read the stored bytes into when large enough."""
        t = self.entries[name]
        x = t.file.read(t.key, row_start, row_count, out=out)
        if not t.shape:
            x = x.reshape(())
        if t.scale_key is None:
            return x
        scale_file = next(f for f in self.files if t.scale_key in f.entries)
        scale = scale_file.read(t.scale_key).to(torch.float32).reshape(-1)
        if scale.numel() > 1:  # one per output row
            scale = scale[row_start: row_start + x.shape[0]].reshape((-1,) + (1,) * (x.dim() - 1))
        else:
            scale = scale.reshape(())
        return x.to(torch.float32) * scale

    def get(self, name: str, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
        """The whole decoded tensor, floating ones cast to ``dtype`` (integer tensors keep theirs)."""
        x = self.read(name)
        if dtype is not None and x.is_floating_point():
            x = x.to(dtype)
        return x.to(device)

    def state_dict(self, dtype: torch.dtype | None = None, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        """Every tensor decoded (names in ``skip`` left out), floating ones in ``dtype``."""
        return {k: self.get(k, dtype) for k in self.entries if k not in skip}


def open_files(paths: list[Path], what: str) -> list[SafetensorsFile]:
    """Safetensors files for ``what`` (a checkpoint, a text encoder, a VAE); anything else refused by name."""
    out = []
    for p in paths:
        refuse_unreadable_form(p, what)
        out.append(SafetensorsFile(p))
    return out


_PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl")


def refuse_unreadable_form(path: Path, what: str) -> None:
    """Named refusals for file forms the engine never reads: pickles (unsafe) and GGUF (not decoded here)."""
    suffix = path.suffix.lower()
    if suffix == ".gguf":
        raise ModelLoadError(f"'{path}' is a GGUF file; {what} must be a .safetensors file (GGUF quantizations are not "
                             f"decoded here): use the bf16 or fp8 .safetensors release")
    if suffix in _PICKLE_SUFFIXES:
        raise ModelLoadError(f"'{path}' is a pickle ({suffix}), not a .safetensors file; pickles are never loaded (they can run code). "
                             f"Use the .safetensors release of {what}")
    if suffix != ".safetensors":
        raise ModelLoadError(f"'{path}' is not a .safetensors file; {what} must be a .safetensors file")
