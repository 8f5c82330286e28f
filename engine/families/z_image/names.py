"""Z-Image's native (ComfyUI NextDiT) parameter names and where each lives in diffusers.

ComfyUI keeps Z-Image in ``models/diffusion_models/`` (``z_image_turbo_bf16.safetensors``,
``z_image_bf16.safetensors``) with the names of its NextDiT (``comfy/ldm/lumina/model.py``), optionally
under ``model.diffusion_model.``. They differ from diffusers' ``ZImageTransformer2DModel`` in five ways
(sources: ComfyUI ``comfy/utils.py`` ``z_image_to_diffusers``; diffusers 0.42.1
``loaders/single_file_utils.py`` ``convert_z_image_transformer_checkpoint_to_diffusers``):

- attention q, k, v are one fused ``attention.qkv`` Linear, rows q | k | v in equal thirds (no bias);
- ``attention.out`` is diffusers' ``attention.to_out.0``; ``q_norm``/``k_norm`` are ``norm_q``/``norm_k``;
- ``x_embedder`` / ``final_layer`` are diffusers' per-patch-size dicts ``all_x_embedder.2-1`` /
  ``all_final_layer.2-1`` (patch 2, frame patch 1: the only sizes Z-Image ships);
- everything else (norms, SwiGLU ``w1/w2/w3``, ``adaLN_modulation.0``, ``cap_embedder``, ``t_embedder``,
  the pad tokens) has the same name in both.

Three block lists, all ``ZImageTransformerBlock``: ``noise_refiner`` (image tokens, modulated),
``context_refiner`` (caption tokens, no ``adaLN_modulation``) and ``layers`` (the joint sequence, modulated).
"""
from __future__ import annotations

from typing import Any

from ...errors import ConfigError
from ..names import NativeParam, fused, renamed, whole

#: diffusers' ``ADALN_EMBED_DIM``: the timestep embedding's width (``min(dim, 256)``).
ADALN_EMBED_DIM = 256
#: diffusers' ``TimestepEmbedder(mid_size=1024)``: the hidden width of the timestep MLP, fixed.
T_EMBED_MID = 1024


def _block(prefix: str, dim: int, head_dim: int, ff_hidden: int, modulation: bool) -> list[NativeParam]:
    a = f"{prefix}.attention"
    rows = [
        *fused(f"{a}.qkv", [f"{a}.to_q", f"{a}.to_k", f"{a}.to_v"], [dim, dim, dim], bias=False),
        *whole(f"{a}.out", f"{a}.to_out.0", dim, bias=False),
        renamed(f"{a}.q_norm.weight", f"{a}.norm_q.weight", head_dim),
        renamed(f"{a}.k_norm.weight", f"{a}.norm_k.weight", head_dim),
        *whole(f"{prefix}.feed_forward.w1", f"{prefix}.feed_forward.w1", ff_hidden, bias=False),
        *whole(f"{prefix}.feed_forward.w2", f"{prefix}.feed_forward.w2", dim, bias=False),
        *whole(f"{prefix}.feed_forward.w3", f"{prefix}.feed_forward.w3", ff_hidden, bias=False),
    ]
    rows += [renamed(f"{prefix}.{n}.weight", f"{prefix}.{n}.weight", dim)
             for n in ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2")]
    if modulation:
        rows += whole(f"{prefix}.adaLN_modulation.0", f"{prefix}.adaLN_modulation.0", 4 * dim)
    return rows


def z_image_param_table(config: dict[str, Any]) -> list[NativeParam]:
    """Every parameter of a ComfyUI Z-Image file, as diffusers parameters of ``config``'s model."""
    if list(config.get("all_patch_size", [2])) != [2] or list(config.get("all_f_patch_size", [1])) != [1]:
        raise ConfigError(
            f"Z-Image config with patch sizes {config.get('all_patch_size')} / {config.get('all_f_patch_size')}: "
            f"only patch 2, frame patch 1 (the released models) have known native names")
    if config.get("siglip_feat_dim") is not None:
        raise ConfigError("Z-Image Omni (siglip_feat_dim set) is not supported; use Z-Image Turbo or Base")
    dim, heads = int(config.get("dim", 3840)), int(config.get("n_heads", 30))
    head_dim, ff_hidden = dim // heads, int(dim / 3 * 8)  # diffusers' FeedForward(hidden_dim=int(dim / 3 * 8))
    t_dim = min(dim, ADALN_EMBED_DIM)
    out_rows = 2 * 2 * 1 * int(config.get("in_channels", 16))  # patch x patch x frame patch x channels
    cap_dim = int(config.get("cap_feat_dim", 2560))
    refiners = int(config.get("n_refiner_layers", 2))

    table: list[NativeParam] = [
        *whole("x_embedder", "all_x_embedder.2-1", dim),
        *whole("final_layer.linear", "all_final_layer.2-1.linear", out_rows),
        *whole("final_layer.adaLN_modulation.1", "all_final_layer.2-1.adaLN_modulation.1", dim),
        renamed("cap_embedder.0.weight", "cap_embedder.0.weight", cap_dim),
        *whole("cap_embedder.1", "cap_embedder.1", dim),
        *whole("t_embedder.mlp.0", "t_embedder.mlp.0", T_EMBED_MID),
        *whole("t_embedder.mlp.2", "t_embedder.mlp.2", t_dim),
        renamed("x_pad_token", "x_pad_token", 1),  # (1, dim)
        renamed("cap_pad_token", "cap_pad_token", 1),
    ]
    for i in range(refiners):
        table += _block(f"noise_refiner.{i}", dim, head_dim, ff_hidden, modulation=True)
    for i in range(refiners):
        table += _block(f"context_refiner.{i}", dim, head_dim, ff_hidden, modulation=False)
    for i in range(int(config.get("n_layers", 30))):
        table += _block(f"layers.{i}", dim, head_dim, ff_hidden, modulation=True)
    return table
