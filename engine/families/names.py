"""Native <-> diffusers parameter names: the table form every family's name map uses.

A family's original checkpoints (BFL's Flux, ComfyUI's NextDiT for Z-Image and Lumina 2, ...) name
and fuse tensors differently from diffusers. A family describes its files as a table at parameter
level: each native parameter is the row-wise concatenation of one or more diffusers parameters
(``parts``); ``swap_halves`` marks a tensor whose two halves diffusers stores the other way round
(Flux's final modulation: (shift, scale) vs (scale, shift)); ``flat`` marks a native tensor that is one diffusers
tensor flattened to one axis (Krea 2's block modulation: (6 * D,) natively, (6, D) in diffusers). The checkpoint reader resolves each
diffusers tensor to a row range of a native one, and LoRA export maps the other way.

Why our own table: diffusers' single-file converters assume the real widths and cannot load the tiny
models the tests use, and LoRA export to ComfyUI needs the same map in the other direction.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Part:
    """Rows ``[offset, offset + rows)`` of a native parameter are diffusers parameter ``name``."""

    name: str
    offset: int
    rows: int


@dataclass(frozen=True)
class NativeParam:
    name: str
    parts: tuple[Part, ...]
    swap_halves: bool = False
    #: The native tensor is its one part flattened to one axis; the part's ``rows`` are the diffusers tensor's rows.
    flat: bool = False

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)


def whole(native: str, diffusers: str, rows: int, bias: bool = True) -> list[NativeParam]:
    """A Linear that exists in both layouts unchanged: weight (and bias)."""
    return [NativeParam(f"{native}.{s}", (Part(f"{diffusers}.{s}", 0, rows),)) for s in ("weight", "bias")[: 1 + bias]]


def fused(native: str, diffusers: list[str], sizes: list[int], bias: bool = True) -> list[NativeParam]:
    """A fused native Linear split row-wise into several diffusers Linears."""
    out = []
    for suffix in ("weight", "bias")[: 1 + bias]:
        parts, offset = [], 0
        for name, rows in zip(diffusers, sizes):
            parts.append(Part(f"{name}.{suffix}", offset, rows))
            offset += rows
        out.append(NativeParam(f"{native}.{suffix}", tuple(parts)))
    return out


def renamed(native: str, diffusers: str, rows: int) -> NativeParam:
    """One tensor under another name (norm scales, pad tokens)."""
    return NativeParam(native, (Part(diffusers, 0, rows),))


def flattened(native: str, diffusers: str, rows: int) -> NativeParam:
    """One tensor stored flattened natively, ``rows`` x (size / rows) in diffusers."""
    return NativeParam(native, (Part(diffusers, 0, rows),), flat=True)


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """(shift, scale) <-> (scale, shift) along dim 0; its own inverse."""
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def split_native_tensor(param: NativeParam, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """One native tensor -> its diffusers tensors (views where possible)."""
    if param.flat:
        return {param.parts[0].name: tensor.reshape(param.parts[0].rows, -1)}
    if param.swap_halves:
        tensor = swap_halves(tensor)
    if len(param.parts) == 1:
        return {param.parts[0].name: tensor}
    return {p.name: tensor.narrow(0, p.offset, p.rows) for p in param.parts}


def join_diffusers_tensors(param: NativeParam, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The inverse of ``split_native_tensor``: diffusers tensors -> one native tensor."""
    if param.flat:
        return tensors[param.parts[0].name].reshape(-1)
    joined = torch.cat([tensors[p.name] for p in param.parts], dim=0)
    return swap_halves(joined) if param.swap_halves else joined
