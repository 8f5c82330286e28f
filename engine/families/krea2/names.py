"""Krea 2's native parameter names (the official ``raw.safetensors`` / ``turbo.safetensors`` and ComfyUI's repack).

The inverse of diffusers 0.42.1's ``convert_krea2_transformer_checkpoint_to_diffusers`` (``single_file_utils.py``):
top-level prefixes (``first`` = ``img_in``, ``tmlp`` = ``time_embed``, ``tproj.1`` = ``time_mod_proj``,
``txtmlp`` = ``txt_in``, ``txtfusion`` = ``text_fusion``, ``blocks`` = ``transformer_blocks``, ``last`` =
``final_layer``), and inside every block, text-fusion blocks included: ``attn.wq/wk/wv/wo/gate``,
``attn.qknorm.qnorm/knorm.scale``, ``mlp.``,
``prenorm/postnorm.scale``. Nothing is fused; the one change of shape is each main block's modulation table, stored
flattened (``blocks.N.mod.lin``, (6 * D,)) where diffusers keeps (6, D) (``NativeParam.flat``). ComfyUI detects the
family by ``txtfusion.projector.weight`` and keeps these names (``comfy/model_detection.py``).
"""
from __future__ import annotations

from typing import Any

from ..names import NativeParam, flattened, renamed

#: diffusers prefix -> native prefix (the converter's ``prefix_rename_dict``, inverted), longest first.
_PREFIXES = (
    ("txt_in.norm.weight", "txtmlp.0.scale"),
    ("final_layer.norm.weight", "last.norm.scale"),
    ("final_layer.scale_shift_table", "last.modulation.lin"),
    ("final_layer.linear.", "last.linear."),
    ("time_embed.linear_1.", "tmlp.0."),
    ("time_embed.linear_2.", "tmlp.2."),
    ("time_mod_proj.", "tproj.1."),
    ("txt_in.linear_1.", "txtmlp.1."),
    ("txt_in.linear_2.", "txtmlp.3."),
    ("text_fusion.", "txtfusion."),
    ("transformer_blocks.", "blocks."),
    ("img_in.", "first."),
)
#: Inside a block (the converter's ``block_rename_dict``, inverted).
_INSIDE = (
    (".attn.to_q.", ".attn.wq."), (".attn.to_k.", ".attn.wk."), (".attn.to_v.", ".attn.wv."),
    (".attn.to_out.0.", ".attn.wo."), (".attn.to_gate.", ".attn.gate."),
    (".attn.norm_q.weight", ".attn.qknorm.qnorm.scale"), (".attn.norm_k.weight", ".attn.qknorm.knorm.scale"),
    (".ff.", ".mlp."), (".norm1.weight", ".prenorm.scale"), (".norm2.weight", ".postnorm.scale"),
)


def native_name(diffusers: str) -> str:
    """A diffusers parameter name under its native name."""
    name = diffusers
    for new, old in _PREFIXES:
        if name.startswith(new):
            name = old + name[len(new):]
            break
    for new, old in _INSIDE:
        name = name.replace(new, old)
    if name.startswith("blocks.") and name.endswith(".scale_shift_table"):
        name = name[: -len("scale_shift_table")] + "mod.lin"
    return name


def krea2_param_table(family, config: dict[str, Any]) -> list[NativeParam]:
    """Every parameter of the model under its native name (built from the meta model: no weights)."""
    from ..base import meta_model

    table = []
    for name, t in meta_model(family, config).state_dict().items():
        rows = tuple(t.shape)[0] if t.dim() else 1
        if name.startswith("transformer_blocks.") and name.endswith(".scale_shift_table"):
            table.append(flattened(native_name(name), name, rows))
        else:
            table.append(renamed(native_name(name), name, rows))
    return table
