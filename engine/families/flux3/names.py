"""FLUX.3's native (BFL) parameter names: BFL's checkpoints and, presumably, ComfyUI's files of the model.

The inverse of diffusers 0.42.1's ``convert_flux3_transformer_checkpoint_to_diffusers`` (``single_file_utils.py``):
top-level renames (``emb_in.{image,image_cond}`` = ``x_embedders.*``, ``txt_in`` = ``context_embedder``,
``time_in.in_layer/out_layer`` = ``timestep_embedder.linear_1/2``, ``ref_time_in`` = the flow map's
``target_timestep_embedder``, ``final_layer.image.linear`` = ``proj_out``, ``final_layer.image.adaLN_modulation.1`` =
``norm_out.linear`` with its (shift, scale) halves swapped), ``content_mode_blocks.`` = ``mode_blocks.``,
``single_blocks.`` = ``single_transformer_blocks.``, ``.lin.`` = ``.linear.`` in the modulations, and inside every
block ``q_proj/k_proj/v_proj/attn_out`` = ``attn.to_q/to_k/to_v/to_out.0``, ``norm.query_norm/key_norm.scale`` =
``attn.norm_q/norm_k.weight``, ``mlp_in/mlp_out`` = ``ff.linear_in/linear_out``. Nothing is fused and nothing has a
bias, so each native Linear is one diffusers Linear (a LoRA needs no slicing). BFL's training-only
``repa_projectors.*`` are not part of the model (``Flux3Family.unused_native_keys``).
"""
from __future__ import annotations

from typing import Any

from ..names import NativeParam, renamed

#: Exact renames (the converter's ``FLUX3_TRANSFORMER_KEYS_RENAME_DICT``, inverted).
_EXACT = {
    "timestep_embedder.linear_1.weight": "time_in.in_layer.weight",
    "timestep_embedder.linear_2.weight": "time_in.out_layer.weight",
    "target_timestep_embedder.linear_1.weight": "ref_time_in.in_layer.weight",
    "target_timestep_embedder.linear_2.weight": "ref_time_in.out_layer.weight",
    "proj_out.weight": "final_layer.image.linear.weight",
    "norm_out.linear.weight": "final_layer.image.adaLN_modulation.1.weight",
}
#: Module prefixes (``FLUX3_TRANSFORMER_PREFIX_MAP``, inverted).
_PREFIXES = (("x_embedders.", "emb_in."), ("context_embedder.", "txt_in."), ("mode_blocks.", "content_mode_blocks."),
             ("single_transformer_blocks.", "single_blocks."))
#: Inside a block (``FLUX3_TRANSFORMER_BLOCK_KEY_MAP``, inverted), by name ending.
_INSIDE = (("attn.to_q.weight", "q_proj.weight"), ("attn.to_k.weight", "k_proj.weight"),
           ("attn.to_v.weight", "v_proj.weight"), ("attn.to_out.0.weight", "attn_out.weight"),
           ("attn.norm_q.weight", "norm.query_norm.scale"), ("attn.norm_k.weight", "norm.key_norm.scale"),
           ("ff.linear_in.weight", "mlp_in.weight"), ("ff.linear_out.weight", "mlp_out.weight"))


def native_name(diffusers: str) -> str:
    """A diffusers parameter name under its native name."""
    if diffusers in _EXACT:
        return _EXACT[diffusers]
    name = diffusers
    for new, old in _PREFIXES:
        if name.startswith(new):
            name = old + name[len(new):]
            break
    name = name.replace(".linear.weight", ".lin.weight")
    for new, old in _INSIDE:
        if name.endswith(new):
            return name[: -len(new)] + old
    return name


def flux3_param_table(family, config: dict[str, Any]) -> list[NativeParam]:
    """Every parameter of the model under its native name (built from the meta model: no weights)."""
    from ..base import meta_model

    table = []
    for name, t in meta_model(family, config).state_dict().items():
        rows = tuple(t.shape)[0] if t.dim() else 1
        if name == "norm_out.linear.weight":
            table.append(NativeParam(native_name(name), renamed(native_name(name), name, rows).parts,
                                     swap_halves=True))
        else:
            table.append(renamed(native_name(name), name, rows))
    return table
