"""Black Forest Labs (BFL) <-> diffusers parameter names for Flux.1.

Why our own map: diffusers' single-file converter assumes the real width (3072)
and cannot load the tiny models the tests use, and LoRA export to ComfyUI needs
the same table in the other direction (ComfyUI's Flux uses BFL names, where
q/k/v -- and in single blocks q/k/v/mlp -- are one fused Linear).

The table is at parameter level: each BFL parameter is the row-wise
concatenation of one or more diffusers parameters (``parts``); ``swap_halves``
marks the final modulation, whose (shift, scale) halves diffusers stores as
(scale, shift).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Part:
    """Rows ``[offset, offset + rows)`` of a BFL parameter are diffusers parameter ``name``."""

    name: str
    offset: int
    rows: int


@dataclass(frozen=True)
class BflParam:
    name: str
    parts: tuple[Part, ...]
    swap_halves: bool = False

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)


def _whole(bfl: str, diffusers: str, rows: int, bias: bool = True) -> list[BflParam]:
    """A Linear that exists in both layouts unchanged: weight (and bias)."""
    return [BflParam(f"{bfl}.{s}", (Part(f"{diffusers}.{s}", 0, rows),)) for s in ("weight", "bias")[: 1 + bias]]


def _fused(bfl: str, diffusers: list[str], sizes: list[int], bias: bool = True) -> list[BflParam]:
    """A fused BFL Linear split row-wise into several diffusers Linears."""
    out = []
    for suffix in ("weight", "bias")[: 1 + bias]:
        parts, offset = [], 0
        for name, rows in zip(diffusers, sizes):
            parts.append(Part(f"{name}.{suffix}", offset, rows))
            offset += rows
        out.append(BflParam(f"{bfl}.{suffix}", tuple(parts)))
    return out


def _norm(bfl: str, diffusers: str, head_dim: int) -> BflParam:
    return BflParam(bfl, (Part(diffusers, 0, head_dim),))


def flux1_param_table(
    num_double: int, num_single: int, hidden: int, mlp_hidden: int, head_dim: int, guidance: bool
) -> list[BflParam]:
    """Every parameter of a BFL Flux.1 checkpoint and where it lives in diffusers."""
    d = hidden
    table: list[BflParam] = []
    table += _whole("img_in", "x_embedder", d)
    table += _whole("txt_in", "context_embedder", d)
    table += _whole("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1", d)
    table += _whole("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2", d)
    table += _whole("vector_in.in_layer", "time_text_embed.text_embedder.linear_1", d)
    table += _whole("vector_in.out_layer", "time_text_embed.text_embedder.linear_2", d)
    if guidance:
        table += _whole("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1", d)
        table += _whole("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2", d)
    for i in range(num_double):
        b, t = f"double_blocks.{i}", f"transformer_blocks.{i}"
        table += _whole(f"{b}.img_mod.lin", f"{t}.norm1.linear", 6 * d)
        table += _whole(f"{b}.txt_mod.lin", f"{t}.norm1_context.linear", 6 * d)
        table += _fused(f"{b}.img_attn.qkv", [f"{t}.attn.to_q", f"{t}.attn.to_k", f"{t}.attn.to_v"], [d] * 3)
        table += _fused(
            f"{b}.txt_attn.qkv", [f"{t}.attn.add_q_proj", f"{t}.attn.add_k_proj", f"{t}.attn.add_v_proj"], [d] * 3
        )
        table.append(_norm(f"{b}.img_attn.norm.query_norm.scale", f"{t}.attn.norm_q.weight", head_dim))
        table.append(_norm(f"{b}.img_attn.norm.key_norm.scale", f"{t}.attn.norm_k.weight", head_dim))
        table.append(_norm(f"{b}.txt_attn.norm.query_norm.scale", f"{t}.attn.norm_added_q.weight", head_dim))
        table.append(_norm(f"{b}.txt_attn.norm.key_norm.scale", f"{t}.attn.norm_added_k.weight", head_dim))
        table += _whole(f"{b}.img_attn.proj", f"{t}.attn.to_out.0", d)
        table += _whole(f"{b}.txt_attn.proj", f"{t}.attn.to_add_out", d)
        table += _whole(f"{b}.img_mlp.0", f"{t}.ff.net.0.proj", mlp_hidden)
        table += _whole(f"{b}.img_mlp.2", f"{t}.ff.net.2", d)
        table += _whole(f"{b}.txt_mlp.0", f"{t}.ff_context.net.0.proj", mlp_hidden)
        table += _whole(f"{b}.txt_mlp.2", f"{t}.ff_context.net.2", d)
    for i in range(num_single):
        b, t = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        table += _whole(f"{b}.modulation.lin", f"{t}.norm.linear", 3 * d)
        table += _fused(
            f"{b}.linear1",
            [f"{t}.attn.to_q", f"{t}.attn.to_k", f"{t}.attn.to_v", f"{t}.proj_mlp"],
            [d, d, d, mlp_hidden],
        )
        table += _whole(f"{b}.linear2", f"{t}.proj_out", d)
        table.append(_norm(f"{b}.norm.query_norm.scale", f"{t}.attn.norm_q.weight", head_dim))
        table.append(_norm(f"{b}.norm.key_norm.scale", f"{t}.attn.norm_k.weight", head_dim))
    table += _whole("final_layer.linear", "proj_out", -1)  # rows = out channels, filled below
    for suffix in ("weight", "bias"):
        table.append(
            BflParam(
                f"final_layer.adaLN_modulation.1.{suffix}",
                (Part(f"norm_out.linear.{suffix}", 0, 2 * d),),
                swap_halves=True,
            )
        )
    return table


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """(shift, scale) <-> (scale, shift) along dim 0; its own inverse."""
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def split_bfl_tensor(param: BflParam, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """One BFL tensor -> its diffusers tensors (views where possible)."""
    if param.swap_halves:
        tensor = swap_halves(tensor)
    if len(param.parts) == 1:
        return {param.parts[0].name: tensor}
    return {p.name: tensor.narrow(0, p.offset, p.rows) for p in param.parts}


def join_diffusers_tensors(param: BflParam, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The inverse of split_bfl_tensor: diffusers tensors -> one BFL tensor."""
    joined = torch.cat([tensors[p.name] for p in param.parts], dim=0)
    return swap_halves(joined) if param.swap_halves else joined
