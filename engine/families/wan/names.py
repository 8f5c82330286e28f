"""Wan's native (original / ComfyUI) parameter names: the inverse of diffusers' own rename rules.

ComfyUI keeps Wan transformers under the names of the original ``wan/modules/model.py`` (``blocks.N.self_attn.q``,
``cross_attn``, ``ffn.0``, ``modulation``, ``head.head``, ``time_projection.1``, ...), one tensor per diffusers
tensor (nothing is fused). diffusers maps them with ``convert_wan_transformer_to_diffusers``
(``loaders/single_file_utils.py``, its ``TRANSFORMER_KEYS_RENAME_DICT``); the table here applies those rules
backwards to every parameter of the model, and ``test_family`` checks that the converter maps the file written
from this table back onto the diffusers state dict, every key, exact tensors. One quirk of the original: its
cross-attention norm is ``norm3`` and its FFN norm ``norm2`` (diffusers swaps them).
"""
from __future__ import annotations

import re
from typing import Any

from ..names import NativeParam, renamed

#: diffusers module path -> native one: prefixes outside the blocks, dotted components inside them (in order).
_GLOBAL = (
    ("condition_embedder.time_embedder.linear_1.", "time_embedding.0."),
    ("condition_embedder.time_embedder.linear_2.", "time_embedding.2."),
    ("condition_embedder.text_embedder.linear_1.", "text_embedding.0."),
    ("condition_embedder.text_embedder.linear_2.", "text_embedding.2."),
    ("condition_embedder.time_proj.", "time_projection.1."),
    ("condition_embedder.image_embedder.norm1.", "img_emb.proj.0."),  # Wan 2.1 I2V's CLIP projection
    ("condition_embedder.image_embedder.ff.net.0.proj.", "img_emb.proj.1."),
    ("condition_embedder.image_embedder.ff.net.2.", "img_emb.proj.3."),
    ("condition_embedder.image_embedder.norm2.", "img_emb.proj.4."),
    ("proj_out.", "head.head."),
)
_IN_BLOCK = (
    (".attn1.", ".self_attn."), (".attn2.", ".cross_attn."),
    (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."), (".to_out.0.", ".o."),
    (".add_k_proj.", ".k_img."), (".add_v_proj.", ".v_img."), (".norm_added_k.", ".norm_k_img."),
    (".ffn.net.0.proj.", ".ffn.0."), (".ffn.net.2.", ".ffn.2."),
)
_NORM_SWAP = {"norm2.": "norm3.", "norm3.": "norm2."}


def native_name(name: str) -> str:
    """A diffusers ``WanTransformer3DModel`` parameter name -> the original Wan name."""
    if name == "scale_shift_table":
        return "head.modulation"
    m = re.fullmatch(r"blocks\.(\d+)\.(.*)", name)
    if m is None:
        for a, b in _GLOBAL:
            if name.startswith(a):
                return b + name[len(a):]
        return name  # patch_embedding.*
    rest = m[2]
    if rest == "scale_shift_table":
        return f"blocks.{m[1]}.modulation"
    for a, b in _NORM_SWAP.items():
        if rest.startswith(a):
            return f"blocks.{m[1]}.{b}{rest[len(a):]}"
    rest = "." + rest
    for a, b in _IN_BLOCK:
        rest = rest.replace(a, b)
    return f"blocks.{m[1]}{rest}"


def wan_param_table(family, config: dict[str, Any]) -> list[NativeParam]:
    """Every parameter of the model (built on the meta device: no weights) under its native name."""
    from ..base import meta_model

    return [renamed(native_name(name), name, tuple(t.shape)[0] if t.dim() else 1)
            for name, t in meta_model(family, config).state_dict().items()]
