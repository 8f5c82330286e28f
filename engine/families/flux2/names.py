"""Black Forest Labs (BFL) <-> diffusers parameter names for Flux.2 (dev and klein).

The same table form as Flux.1 (``../names.py``): each BFL parameter is the row-wise
concatenation of diffusers parameters. Sources: diffusers 0.42.1
``loaders/single_file_utils.py`` ``convert_flux2_transformer_checkpoint_to_diffusers``
(the rename table) and BFL ``src/flux2/model.py``; ComfyUI's ``comfy/utils.py``
``flux_to_diffusers`` maps the same names for LoRAs. Differences from Flux.1: no
biases anywhere, no pooled text input, modulation is global (one Linear per stream
kind outside the blocks), the MLPs are SwiGLU (``linear_in`` holds gate and value),
and single blocks have one fused ``to_qkv_mlp_proj`` (BFL ``linear1``) and
``to_out`` (``linear2``).
"""
from __future__ import annotations

from ..names import NativeParam, Part, fused, renamed, whole


def flux2_param_table(
    num_double: int, num_single: int, hidden: int, mlp_hidden: int, head_dim: int, guidance: bool, out_channels: int
) -> list[NativeParam]:
    """Every parameter of a BFL Flux.2 checkpoint and where it lives in diffusers."""
    d, nb = hidden, False
    table: list[NativeParam] = []
    table += whole("img_in", "x_embedder", d, nb)
    table += whole("txt_in", "context_embedder", d, nb)
    table += whole("time_in.in_layer", "time_guidance_embed.timestep_embedder.linear_1", d, nb)
    table += whole("time_in.out_layer", "time_guidance_embed.timestep_embedder.linear_2", d, nb)
    if guidance:
        table += whole("guidance_in.in_layer", "time_guidance_embed.guidance_embedder.linear_1", d, nb)
        table += whole("guidance_in.out_layer", "time_guidance_embed.guidance_embedder.linear_2", d, nb)
    table += whole("double_stream_modulation_img.lin", "double_stream_modulation_img.linear", 6 * d, nb)
    table += whole("double_stream_modulation_txt.lin", "double_stream_modulation_txt.linear", 6 * d, nb)
    table += whole("single_stream_modulation.lin", "single_stream_modulation.linear", 3 * d, nb)
    for i in range(num_double):
        b, t = f"double_blocks.{i}", f"transformer_blocks.{i}"
        table += fused(f"{b}.img_attn.qkv", [f"{t}.attn.to_q", f"{t}.attn.to_k", f"{t}.attn.to_v"], [d] * 3, nb)
        table += fused(f"{b}.txt_attn.qkv", [f"{t}.attn.add_q_proj", f"{t}.attn.add_k_proj", f"{t}.attn.add_v_proj"],
                        [d] * 3, nb)
        table.append(renamed(f"{b}.img_attn.norm.query_norm.scale", f"{t}.attn.norm_q.weight", head_dim))
        table.append(renamed(f"{b}.img_attn.norm.key_norm.scale", f"{t}.attn.norm_k.weight", head_dim))
        table.append(renamed(f"{b}.txt_attn.norm.query_norm.scale", f"{t}.attn.norm_added_q.weight", head_dim))
        table.append(renamed(f"{b}.txt_attn.norm.key_norm.scale", f"{t}.attn.norm_added_k.weight", head_dim))
        table += whole(f"{b}.img_attn.proj", f"{t}.attn.to_out.0", d, nb)
        table += whole(f"{b}.txt_attn.proj", f"{t}.attn.to_add_out", d, nb)
        table += whole(f"{b}.img_mlp.0", f"{t}.ff.linear_in", 2 * mlp_hidden, nb)
        table += whole(f"{b}.img_mlp.2", f"{t}.ff.linear_out", d, nb)
        table += whole(f"{b}.txt_mlp.0", f"{t}.ff_context.linear_in", 2 * mlp_hidden, nb)
        table += whole(f"{b}.txt_mlp.2", f"{t}.ff_context.linear_out", d, nb)
    for i in range(num_single):
        b, t = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        table += whole(f"{b}.linear1", f"{t}.attn.to_qkv_mlp_proj", 3 * d + 2 * mlp_hidden, nb)
        table += whole(f"{b}.linear2", f"{t}.attn.to_out", d, nb)
        table.append(renamed(f"{b}.norm.query_norm.scale", f"{t}.attn.norm_q.weight", head_dim))
        table.append(renamed(f"{b}.norm.key_norm.scale", f"{t}.attn.norm_k.weight", head_dim))
    table += whole("final_layer.linear", "proj_out", out_channels, nb)
    table.append(NativeParam("final_layer.adaLN_modulation.1.weight", (Part("norm_out.linear.weight", 0, 2 * d),),
                          swap_halves=True))
    return table
