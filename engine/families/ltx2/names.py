"""LTX-2's native parameter names (Lightricks' checkpoints and ComfyUI's ``ltx-2.3-22b-dev*.safetensors``).

The inverse of diffusers 0.42.1's ``convert_ltx2_transformer_to_diffusers`` (``single_file_utils.py``), whose renames
are few (facts §2.3): ``patchify_proj`` / ``audio_patchify_proj`` = ``proj_in`` / ``audio_proj_in``,
``adaln_single`` / ``audio_adaln_single`` = ``time_embed`` / ``audio_time_embed``, ``av_ca_*_adaln_single`` =
``av_cross_attn_*``, ``scale_shift_table_a2v_ca_{video,audio}`` = ``{video,audio}_a2v_cross_attn_scale_shift_table``
and ``q_norm`` / ``k_norm`` = ``norm_q`` / ``norm_k``; every Linear of a block (``to_q``, ``to_gate_logits``, ``ff``)
has the same name in both. LTX-2.3's prompt AdaLN is ``prompt_adaln_single`` / ``audio_prompt_adaln_single`` in
ComfyUI's model (``comfy/ldm/lightricks``), ``prompt_adaln`` / ``audio_prompt_adaln`` in diffusers (the converter
predates 2.3 and has no rule for it). Nothing is fused. ComfyUI detects the family by
``adaln_single.emb.timestep_embedder.linear_1.bias`` and the audio-video model by ``audio_adaln_single.linear.weight``.
"""
from __future__ import annotations

from typing import Any

from ..names import NativeParam, renamed

#: diffusers prefix -> native prefix (outside the blocks), longest first.
_PREFIXES = (
    ("audio_prompt_adaln.", "audio_prompt_adaln_single."),
    ("prompt_adaln.", "prompt_adaln_single."),
    ("audio_time_embed.", "audio_adaln_single."),
    ("time_embed.", "adaln_single."),
    ("av_cross_attn_video_scale_shift.", "av_ca_video_scale_shift_adaln_single."),
    ("av_cross_attn_audio_scale_shift.", "av_ca_audio_scale_shift_adaln_single."),
    ("av_cross_attn_video_a2v_gate.", "av_ca_a2v_gate_adaln_single."),
    ("av_cross_attn_audio_v2a_gate.", "av_ca_v2a_gate_adaln_single."),
    ("audio_proj_in.", "audio_patchify_proj."),
    ("proj_in.", "patchify_proj."),
)
#: Inside a block.
_INSIDE = (
    (".norm_q.", ".q_norm."), (".norm_k.", ".k_norm."),
    (".video_a2v_cross_attn_scale_shift_table", ".scale_shift_table_a2v_ca_video"),
    (".audio_a2v_cross_attn_scale_shift_table", ".scale_shift_table_a2v_ca_audio"),
)


def native_name(diffusers: str) -> str:
    """A diffusers parameter name under its native name."""
    for new, old in _PREFIXES:
        if diffusers.startswith(new):
            return old + diffusers[len(new):]
    name = diffusers
    if name.startswith("transformer_blocks."):
        for new, old in _INSIDE:
            name = name.replace(new, old)
    return name


def ltx2_param_table(family, config: dict[str, Any]) -> list[NativeParam]:
    """Every parameter of the model under its native name (built from the meta model: no weights)."""
    from ..base import meta_model

    return [renamed(native_name(name), name, tuple(t.shape)[0] if t.dim() else 1)
            for name, t in meta_model(family, config).state_dict().items()]
