"""Black Forest Labs (BFL) <-> diffusers parameter names for Flux.1 (the table form of ``../names.py``).

ComfyUI's Flux uses BFL names, where q/k/v -- and in single blocks q/k/v/mlp -- are one fused Linear.
"""
from __future__ import annotations

from ..names import NativeParam, Part, fused, renamed, whole


def flux1_param_table(
    num_double: int, num_single: int, hidden: int, mlp_hidden: int, head_dim: int, guidance: bool
) -> list[NativeParam]:
    """Every parameter of a BFL Flux.1 checkpoint and where it lives in diffusers."""
    d = hidden
    table: list[NativeParam] = []
    table += whole("img_in", "x_embedder", d)
    table += whole("txt_in", "context_embedder", d)
    table += whole("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1", d)
    table += whole("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2", d)
    table += whole("vector_in.in_layer", "time_text_embed.text_embedder.linear_1", d)
    table += whole("vector_in.out_layer", "time_text_embed.text_embedder.linear_2", d)
    if guidance:
        table += whole("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1", d)
        table += whole("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2", d)
    for i in range(num_double):
        b, t = f"double_blocks.{i}", f"transformer_blocks.{i}"
        table += whole(f"{b}.img_mod.lin", f"{t}.norm1.linear", 6 * d)
        table += whole(f"{b}.txt_mod.lin", f"{t}.norm1_context.linear", 6 * d)
        table += fused(f"{b}.img_attn.qkv", [f"{t}.attn.to_q", f"{t}.attn.to_k", f"{t}.attn.to_v"], [d] * 3)
        table += fused(
            f"{b}.txt_attn.qkv", [f"{t}.attn.add_q_proj", f"{t}.attn.add_k_proj", f"{t}.attn.add_v_proj"], [d] * 3
        )
        table.append(renamed(f"{b}.img_attn.norm.query_norm.scale", f"{t}.attn.norm_q.weight", head_dim))
        table.append(renamed(f"{b}.img_attn.norm.key_norm.scale", f"{t}.attn.norm_k.weight", head_dim))
        table.append(renamed(f"{b}.txt_attn.norm.query_norm.scale", f"{t}.attn.norm_added_q.weight", head_dim))
        table.append(renamed(f"{b}.txt_attn.norm.key_norm.scale", f"{t}.attn.norm_added_k.weight", head_dim))
        table += whole(f"{b}.img_attn.proj", f"{t}.attn.to_out.0", d)
        table += whole(f"{b}.txt_attn.proj", f"{t}.attn.to_add_out", d)
        table += whole(f"{b}.img_mlp.0", f"{t}.ff.net.0.proj", mlp_hidden)
        table += whole(f"{b}.img_mlp.2", f"{t}.ff.net.2", d)
        table += whole(f"{b}.txt_mlp.0", f"{t}.ff_context.net.0.proj", mlp_hidden)
        table += whole(f"{b}.txt_mlp.2", f"{t}.ff_context.net.2", d)
    for i in range(num_single):
        b, t = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        table += whole(f"{b}.modulation.lin", f"{t}.norm.linear", 3 * d)
        table += fused(
            f"{b}.linear1",
            [f"{t}.attn.to_q", f"{t}.attn.to_k", f"{t}.attn.to_v", f"{t}.proj_mlp"],
            [d, d, d, mlp_hidden],
        )
        table += whole(f"{b}.linear2", f"{t}.proj_out", d)
        table.append(renamed(f"{b}.norm.query_norm.scale", f"{t}.attn.norm_q.weight", head_dim))
        table.append(renamed(f"{b}.norm.key_norm.scale", f"{t}.attn.norm_k.weight", head_dim))
    table += whole("final_layer.linear", "proj_out", -1)  # rows = out channels, filled below
    for suffix in ("weight", "bias"):
        table.append(
            NativeParam(
                f"final_layer.adaLN_modulation.1.{suffix}",
                (Part(f"norm_out.linear.{suffix}", 0, 2 * d),),
                swap_halves=True,
            )
        )
    return table
