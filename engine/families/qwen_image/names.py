"""Qwen-Image's native parameter names: diffusers' own.

ComfyUI's ``comfy/ldm/qwen_image/model.py`` uses the module names of diffusers'
``QwenImageTransformer2DModel`` (``transformer_blocks.N.attn.to_q``, ``img_mod.1``, ``txt_norm``, ...), and
diffusers' single-file loader maps these files with the identity (``loaders/single_file_model.py``), so the
table is one row per parameter, unchanged. Files may carry ``model.diffusion_model.`` in front (stripped by the
checkpoint reader) and the 2511 flag tensor ``__index_timestep_zero__`` (ignored: ``unused_native_keys``).
"""
from __future__ import annotations

from typing import Any

from ..names import NativeParam, renamed


def qwen_image_param_table(family, config: dict[str, Any]) -> list[NativeParam]:
    """Every parameter of the model under its own name (built from the meta model: no weights)."""
    from ..base import meta_model

    return [renamed(name, name, tuple(t.shape)[0] if t.dim() else 1)
            for name, t in meta_model(family, config).state_dict().items()]
