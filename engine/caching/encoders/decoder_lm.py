"""A decoder LLM's hidden states, stacked per token (``stacked_text``: run layer-major, read from the memory map):
Flux.2's Mistral-Small-3.x or Qwen3, Z-Image's Qwen3, Lumina 2's Gemma-2, Qwen-Image's Qwen2.5-VL. The spec says
which hidden states, how captions are templated and the architecture (``spec.architecture``: the shipped config
of a single file without a companion ``config.json``).

ComfyUI's Gemma-2 file embeds its tokenizer as a ``spiece_model`` tensor, framed as Lumina2Pipeline's GemmaTokenizer
frames it: ``<bos>`` (2) first, no EOS, <pad> 0, right padding (``padding_side = "right"``); ComfyUI's
``Gemma2BTokenizer``: ``add_bos=True, add_eos=False``. Its Mistral file embeds a ``tekken_model``."""
from __future__ import annotations

from ...hashing import path_identity
from ..embedded_tokenizer import SpieceLayout
from ..single_files import companion_dir, decoder_lm_source
from ..stacked_text import encode_stacked
from . import TextEncoderKind


class DecoderLM(TextEncoderKind):
    kind = "decoder_lm"
    file_kind = "decoder_lm"
    display_name = "decoder LLM (Mistral3 / Qwen3 / Gemma-2)"
    output = "stacked"
    host_loads_whole = False  # run layer-major from the memory map (stacked_text)
    spiece_layouts = {"gemma2-2b": SpieceLayout(bos=True, eos=False, padding_side="right", name="Gemma-2")}
    embedding_files = {"gemma2-2b": "gemma_2_2b_fp16.safetensors",
                       "mistral3-small-24b": "mistral_3_small_flux2_bf16.safetensors"}

    def match(self, shapes):
        # Any attention with q_proj (CLIP has one too: CLIP's own names are more specific).
        return 1 if any(".self_attn.q_proj." in k for k in shapes) else 0

    def cache_identity(self, spec):
        return [list(spec.hidden_layers), repr(spec.template), spec.length]

    def tokenizer_identity(self, path, spec, singles):
        return path_identity(companion_dir(path))  # the companion folder holds the tokenizer (and maybe the config)

    def encode(self, pipeline, singles, family, spec, captions, device, dtype, length, progress=None):
        source = None
        if singles is not None:
            source = decoder_lm_source(singles.text_encoders[spec.subfolder], family, spec, singles.tokenizer_dirs)
        return encode_stacked(pipeline, spec, captions, device, dtype, length, progress=progress, source=source)


KIND = DecoderLM()
