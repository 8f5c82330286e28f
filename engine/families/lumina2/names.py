"""Lumina 2 native (NextDiT, as ComfyUI and Alpha-VLLM name it) <-> diffusers parameter names.

Source of the map: diffusers 0.42.1 ``loaders/single_file_utils.py`` ``convert_lumina2_to_diffusers``
(new-families-facts §4.5), which hard-codes the real widths (q 2304 | k 768 | v 768); this table takes
them from the config, so the tiny model's files read the same way.

Per block (``layers.N``, ``noise_refiner.N``, ``context_refiner.N``):

| native | diffusers |
|---|---|
| ``attention.qkv`` (fused rows q, k, v; GQA: k and v are ``num_kv_heads * head_dim``) | ``attn.to_q``, ``attn.to_k``, ``attn.to_v`` |
| ``attention.out`` | ``attn.to_out.0`` |
| ``attention.q_norm`` / ``k_norm`` | ``attn.norm_q`` / ``norm_k`` |
| ``feed_forward.w1/w2/w3`` | ``feed_forward.linear_1/2/3`` |
| ``attention_norm1`` | ``norm1.norm`` (modulated blocks), ``norm1`` (context_refiner) |
| ``attention_norm2``, ``ffn_norm1``, ``ffn_norm2`` | ``norm2``, ``ffn_norm1``, ``ffn_norm2`` |
| ``adaLN_modulation.1`` (modulated blocks; SiLU at ``.0``) | ``norm1.linear`` |

No Linear inside a block has a bias; the modulation has one. Outside the blocks: ``x_embedder``,
``cap_embedder.0/1`` (RMSNorm, Linear), ``t_embedder.mlp.0/2``, ``final_layer.adaLN_modulation.1``,
``final_layer.linear``. No tensor swaps halves (the final modulation is a scale only).

Native files may also hold ``norm_final.weight``: an RMSNorm the original NextDiT defines and never
uses (ComfyUI comments it out, diffusers' converter pops it). It has no diffusers counterpart, so it is
not in the table; ``Lumina2Family.unused_native_keys`` names it for the reader to ignore.
"""
from __future__ import annotations

from typing import Any

from ..names import NativeParam, fused, renamed, whole

#: Native tensors with no diffusers counterpart, present in the original and ComfyUI files.
UNUSED_NATIVE_KEYS = ("norm_final.weight",)


def widths(config: dict[str, Any]) -> dict[str, int]:
    """The widths the table needs, as diffusers' Lumina2Transformer2DModel derives them."""
    dim = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = dim // heads
    kv = int(config.get("num_kv_heads") or heads) * head_dim
    multiple_of = int(config.get("multiple_of", 256))
    ffn = 4 * dim  # LuminaFeedForward(inner_dim=4 * dim), then the multiplier, then rounded up
    if config.get("ffn_dim_multiplier") is not None:
        ffn = int(config["ffn_dim_multiplier"] * ffn)
    ffn = multiple_of * ((ffn + multiple_of - 1) // multiple_of)
    patch = int(config.get("patch_size", 2))
    out_channels = int(config.get("out_channels") or config.get("in_channels", 16))
    return {"dim": dim, "head_dim": head_dim, "kv": kv, "ffn": ffn, "temb": min(dim, 1024),
            "out": patch * patch * out_channels}


def block_params(native: str, diffusers: str, w: dict[str, int], modulation: bool) -> list[NativeParam]:
    dim = w["dim"]
    table = fused(f"{native}.attention.qkv", [f"{diffusers}.attn.to_q", f"{diffusers}.attn.to_k",
                                              f"{diffusers}.attn.to_v"], [dim, w["kv"], w["kv"]], bias=False)
    table += whole(f"{native}.attention.out", f"{diffusers}.attn.to_out.0", dim, bias=False)
    table += [renamed(f"{native}.attention.q_norm.weight", f"{diffusers}.attn.norm_q.weight", w["head_dim"]),
              renamed(f"{native}.attention.k_norm.weight", f"{diffusers}.attn.norm_k.weight", w["head_dim"])]
    for n, d, rows in (("w1", "linear_1", w["ffn"]), ("w2", "linear_2", dim), ("w3", "linear_3", w["ffn"])):
        table += whole(f"{native}.feed_forward.{n}", f"{diffusers}.feed_forward.{d}", rows, bias=False)
    norm1 = "norm1.norm" if modulation else "norm1"
    for n, d in (("attention_norm1", norm1), ("attention_norm2", "norm2"), ("ffn_norm1", "ffn_norm1"),
                 ("ffn_norm2", "ffn_norm2")):
        table.append(renamed(f"{native}.{n}.weight", f"{diffusers}.{d}.weight", dim))
    if modulation:
        table += whole(f"{native}.adaLN_modulation.1", f"{diffusers}.norm1.linear", 4 * dim)
    return table


def lumina2_param_table(config: dict[str, Any]) -> list[NativeParam]:
    """Every parameter of a native Lumina 2 file and its diffusers parameters (row ranges)."""
    w = widths(config)
    dim = w["dim"]
    table = whole("x_embedder", "x_embedder", dim)
    table.append(renamed("cap_embedder.0.weight", "time_caption_embed.caption_embedder.0.weight",
                         int(config["cap_feat_dim"])))
    table += whole("cap_embedder.1", "time_caption_embed.caption_embedder.1", dim)
    table += whole("t_embedder.mlp.0", "time_caption_embed.timestep_embedder.linear_1", w["temb"])
    table += whole("t_embedder.mlp.2", "time_caption_embed.timestep_embedder.linear_2", w["temb"])
    n_refiner = int(config.get("num_refiner_layers", 2))
    for i in range(n_refiner):
        table += block_params(f"context_refiner.{i}", f"context_refiner.{i}", w, modulation=False)
    for i in range(n_refiner):
        table += block_params(f"noise_refiner.{i}", f"noise_refiner.{i}", w, modulation=True)
    for i in range(int(config["num_layers"])):
        table += block_params(f"layers.{i}", f"layers.{i}", w, modulation=True)
    table += whole("final_layer.adaLN_modulation.1", "norm_out.linear_1", dim)
    table += whole("final_layer.linear", "norm_out.linear_2", w["out"])
    return table
