"""ComfyUI's single files for LTX-2.3's text path and video VAE: which tensors sit where, under which names, and the
diffusers names they load as. Names and configs only: the caching pass reads the tensors through the one checkpoint
reader (``engine/caching/encoders/gemma_connectors.py``, ``engine/caching/single_files.py``).

The files (facts §2.1, §2.7):

- ``models/text_encoders/gemma_3_12B_it.safetensors`` (bf16) or ``gemma_3_12B_it_fp8_scaled.safetensors``
  (Comfy-Org/ltx-2, ``split_files/text_encoders``): Gemma 3 12B as ComfyUI's ``Gemma3_12B`` holds it, the language
  model under transformers' ``Gemma3TextModel`` names behind ``model.`` (``model.embed_tokens``, ``model.layers.N``,
  ``model.norm``), the SigLIP tower (``vision_model.``) and ``multi_modal_projector.`` beside it (unused: captions
  only), and the tokenizer as a ``spiece_model`` tensor (ComfyUI's ``Gemma3_12BTokenizer`` reads its SentencePiece
  model from ``tokenizer_data["spiece_model"]``; ai-toolkit's ``convert_comfy_gemma3_to_transformers`` skips that
  tensor and maps the rest the same way). The ``_fp4_mixed`` file is nvfp4, which the reader refuses by name.
- ``models/checkpoints/ltx-2.3-22b-dev(-fp8).safetensors``, "a single file bundling the transformer, the video and
  audio VAEs, and the text projection": the text connectors beside the transformer under ``model.diffusion_model.``
  (``video_embeddings_connector.``, ``audio_embeddings_connector.``), the per-modality text projection at the top
  level (``text_embedding_projection.video_aggregate_embed`` / ``audio_aggregate_embed``; diffusers' converter and
  ComfyUI's ``LTXAVTEModel.load_sd`` also take it under ``model.diffusion_model.``), the video VAE under ``vae.``
  (``vae.py``). That is why ComfyUI's ``LTXAVTextEncoderLoader`` takes the checkpoint beside the Gemma file.

The connectors' renames are diffusers' ``LTX_2_3_CONNECTORS_KEYS_RENAME_DICT`` (``scripts/convert_ltx2_to_diffusers.py``,
which loads the result strictly): ``*_embeddings_connector`` -> ``*_connector``, ``transformer_1d_blocks`` ->
``transformer_blocks``, ``q_norm`` / ``k_norm`` -> ``norm_q`` / ``norm_k``, the aggregate embeds -> ``*_text_proj_in``.
The connectors' configs are the converter's (``get_ltx2_connectors_config("2.3")``), shipped in
``configs/connectors/``; Gemma 3 12B's is google/gemma-3-12b-it's (``configs/text/gemma3-12b.json``).

LTX-2.5 keeps its projection in its own text-encoder file (``gemma4-12b-with-proj-ltx-2.5-bf16.safetensors``) and
its VAE in ``ltx-2.5-video-vae-bf16.safetensors``; neither is read here yet (refused by name).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..base import load_package_json

#: Where ComfyUI users get the Gemma file (the hub listing of Comfy-Org/ltx-2, facts §2.1).
GEMMA_URL = "https://huggingface.co/Comfy-Org/ltx-2/resolve/main/split_files/text_encoders/"
GEMMA_FILES = ("gemma_3_12B_it.safetensors", "gemma_3_12B_it_fp8_scaled.safetensors")
#: The transformer's prefix in the all-in-one checkpoint.
TRANSFORMER_PREFIX = "model.diffusion_model."

#: Original (ComfyUI / Lightricks) -> diffusers, applied in order to a connector key without the transformer prefix.
_CONNECTOR_RENAMES = (
    ("video_embeddings_connector.", "video_connector."),
    ("audio_embeddings_connector.", "audio_connector."),
    (".transformer_1d_blocks.", ".transformer_blocks."),
    ("text_embedding_projection.video_aggregate_embed.", "video_text_proj_in."),
    ("text_embedding_projection.audio_aggregate_embed.", "audio_text_proj_in."),
    (".q_norm.", ".norm_q."),
    (".k_norm.", ".norm_k."),
)
_CONNECTOR_ROOTS = ("video_embeddings_connector.", "audio_embeddings_connector.", "text_embedding_projection.")


@dataclass(frozen=True)
class ComfyText:
    """What a text spec's single files are read with: the shipped Gemma config (``configs/text/<gemma>.json``; ""
    = only a companion folder's config.json, the tiny model's) and the connectors' (``configs/connectors/``)."""

    gemma: str
    connectors: str


#: By the text spec's ``architecture`` (``text.py``); LTX-2.5's is absent (its files are not read yet).
COMFY_TEXT = {"gemma3-12b+ltx2.3-connectors": ComfyText("gemma3-12b", "ltx2.3"),
              "ltx2-tiny": ComfyText("", "ltx2-tiny")}


def connector_names(keys) -> dict[str, str]:
    """The all-in-one checkpoint's connector and text-projection keys -> ``LTX2TextConnectors``' parameter names."""
    out = {}
    for key in keys:
        name = key[len(TRANSFORMER_PREFIX):] if key.startswith(TRANSFORMER_PREFIX) else key
        if not name.startswith(_CONNECTOR_ROOTS):
            continue
        for old, new in _CONNECTOR_RENAMES:
            name = name.replace(old, new)
        out[key] = name
    return out


def connector_keys(connector_state: dict) -> dict:
    """The inverse of ``connector_names`` on an ``LTX2TextConnectors`` state dict: the all-in-one checkpoint's layout
    (connectors under the transformer prefix, the projection at the top level), for fixtures."""
    out = {}
    for name, value in connector_state.items():
        for proj in ("video", "audio"):
            if name.startswith(f"{proj}_text_proj_in."):
                out[f"text_embedding_projection.{proj}_aggregate_embed." + name.split(".", 1)[1]] = value
                break
            if name.startswith(f"{proj}_connector."):
                rest = name.split(".", 1)[1].replace("transformer_blocks.", "transformer_1d_blocks.")
                rest = rest.replace(".norm_q.", ".q_norm.").replace(".norm_k.", ".k_norm.")
                out[f"{TRANSFORMER_PREFIX}{proj}_embeddings_connector." + rest] = value
                break
        else:
            raise KeyError(f"not a connector parameter: {name}")
    return out


def connectors_config(name: str) -> dict:
    """The shipped ``LTX2TextConnectors`` config ``configs/connectors/<name>.json`` (without its ``_`` keys)."""
    config = load_package_json(__package__, "configs", "connectors", f"{name}.json")
    return {k: v for k, v in config.items() if not k.startswith("_")}
