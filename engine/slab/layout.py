"""Which tensors a slab holds for a model, in which order: shared by build and load.

The model (built on the meta device from the family and config) decides: every
``nn.Linear`` inside ``family.memory.block_lists_of(model)`` is quantized (its weight becomes
``weight_int8`` + ``weight_scale`` in an int8 slab, ``weight_int4`` + ``weight_scale`` + ``weight_min`` in an
int4 one); every other state-dict tensor is stored plain.
Order: non-block tensors first, then each block's tensors together, so one block
is one contiguous byte range of the file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..families import ModelFamily
from ..families.base import meta_model  # noqa: F401  (re-exported: the builder lives with the families)

INT8, SCALE, PLAIN = "int8_weight", "scale", "plain"
INT4, MIN = "int4_weight", "group_min"  # an int4 slab's packed weight and its groups' minima (scales are SCALE)
QUANTIZED = (INT8, INT4)
BITS = (8, 4)  # what a slab may hold: int8 (the default) or int4


def check_bits(bits: int) -> int:
    if bits not in BITS:
        from ..errors import ConfigError

        raise ConfigError(f"bits={bits!r}: a slab holds 8-bit (int8, the default) or 4-bit (int4) weights; use 8 or 4")
    return bits


def quantized_linear_class(bits: int = 8):
    """The module a slab's quantized Linears load as: ``Int8Linear`` (8) or ``Int4Linear`` (4)."""
    from .int4_linear import Int4Linear
    from .int8_linear import Int8Linear

    return {8: Int8Linear, 4: Int4Linear}[check_bits(bits)]


def block_prefixes(model: nn.Module, family: ModelFamily) -> list[str]:
    """``["transformer_blocks.0", ..., "single_transformer_blocks.37"]`` in execution order."""
    names = {id(m): n for n, m in model.named_modules()}
    return [f"{names[id(blocks)]}.{i}" for blocks in family.memory.block_lists_of(model) for i in range(len(blocks))]


def swap_in_int8_linears(model: nn.Module, family: ModelFamily, bits: int = 8) -> None:
    """Replace every Linear of the quantized set (``block_linears``) by an empty meta ``Int8Linear`` (or
    ``Int4Linear`` for ``bits=4``) of the same shape: the one quantized module swap (slab loading and footprints)."""
    cls = quantized_linear_class(bits)
    for name, linear in block_linears(model, family).items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child,
                cls(linear.in_features, linear.out_features, linear.bias is not None, device="meta"))


def block_linears(model: nn.Module, family: ModelFamily) -> dict[str, nn.Linear]:
    """The quantized set, by full module name: every Linear inside the family's blocks, plus the
    large Linears outside them that the family lists (``int8_extra_linears``: Flux.2's global
    modulation and text embedder, 1.6 GB in bf16, which otherwise stay resident in bf16)."""
    names = {id(m): n for n, m in model.named_modules()}
    out: dict[str, nn.Linear] = {}
    for blocks in family.memory.block_lists_of(model):
        prefix = names[id(blocks)]
        for i, block in enumerate(blocks):
            for sub, module in block.named_modules():
                if isinstance(module, nn.Linear) and "lora_" not in sub:
                    out[f"{prefix}.{i}.{sub}"] = module
    named = dict(model.named_modules())
    for name in family.memory.int8_extra_linears:  # the largest variant's names: a smaller one may lack some
        if isinstance(named.get(name), nn.Linear):
            out[name] = named[name]
    return out


@dataclass(frozen=True)
class SlabTensor:
    key: str  # name in the slab file == state-dict key of the int8 model
    canonical: str  # the diffusers parameter it comes from
    role: str  # INT8 | SCALE | PLAIN
    shape: tuple[int, ...]
    dtype: torch.dtype  # as stored in the slab
    block: str | None  # "transformer_blocks.3", or None outside blocks


def slab_tensors(model: nn.Module, family: ModelFamily,
                 plain_dtype: Callable[[str], torch.dtype], bits: int = 8) -> list[SlabTensor]:
    """The slab's tensors in file order. ``plain_dtype(name)`` picks a plain tensor's stored dtype."""
    from .quantize import INT4_SCALE_DTYPE, SCALE_DTYPE, int4_groups

    linears = block_linears(model, family)
    prefixes = block_prefixes(model, family)
    prefix_set = frozenset(prefixes)
    groups: dict[str | None, list[SlabTensor]] = {None: [], **{p: [] for p in prefixes}}
    for name, tensor in model.state_dict(keep_vars=True).items():
        block = _block_of(name, prefix_set)
        module = name.rpartition(".")[0]
        shape = tuple(tensor.shape)
        if name.endswith(".weight") and module in linears and check_bits(bits) == 4:
            out_f, in_f = shape
            grid = (out_f, int4_groups(in_f))
            groups[block].append(SlabTensor(f"{module}.weight_int4", name, INT4, (out_f, -(-in_f // 2)), torch.uint8,
                                            block))
            groups[block].append(SlabTensor(f"{module}.weight_scale", name, SCALE, grid, INT4_SCALE_DTYPE, block))
            groups[block].append(SlabTensor(f"{module}.weight_min", name, MIN, grid, INT4_SCALE_DTYPE, block))
        elif name.endswith(".weight") and module in linears:
            groups[block].append(SlabTensor(f"{module}.weight_int8", name, INT8, shape, torch.int8, block))
            groups[block].append(SlabTensor(f"{module}.weight_scale", name, SCALE, shape[:1], SCALE_DTYPE, block))
        else:
            groups[block].append(SlabTensor(name, name, PLAIN, shape, plain_dtype(name), block))
    return [t for group in groups.values() for t in group]


def _block_of(name: str, prefixes: frozenset[str]) -> str | None:
    parts = name.split(".")
    for n in range(1, len(parts)):
        candidate = ".".join(parts[:n])
        if candidate in prefixes:
            return candidate
    return None
