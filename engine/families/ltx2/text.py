"""LTX-2's text path: Gemma (3 for LTX-2.3, LTX's own Gemma 4 for 2.5) -> every hidden state stacked -> the text
connectors (``LTX2TextConnectors``) -> what the transformer cross-attends to.

As ``LTX2Pipeline`` does it (diffusers 0.42.1 ``_get_gemma_prompt_embeds`` and ``connectors.py``; facts §2.5): the
caption stripped, tokenized with BOS, **left**-padded to 1024 tokens; Gemma run with the mask, all ``hidden_states``
(embeddings + every layer: 49 for Gemma-3-12B) stacked per token; then the connectors: a per-token RMS norm of each
layer's state, padding rows zeroed, the video and audio projections (-> 4096 / 2048), and an 8-layer 1-D transformer
per modality whose padding rows become 128 learned registers. Their output has no padding left: the transformer
attends to all 1024 rows without a mask.

The cache keeps the connectors' output: one (1024, 4096 + 2048) row per caption (12.6 MB bf16), video then audio
(``PROMPT_KEY``), instead of the raw stack (1024 x 3840 x 49: 385 MB, which the official trainer would run through the
frozen connectors every step). Why after the connectors: the LoRA leaves them alone (its targets are the video
blocks'), so their output is a constant of each caption, exactly as Gemma's is; caching it costs 30x less disk and
page cache than the raw stack, and saves the connectors' 3.2B parameters (6.3 GB bf16) from being loaded, streamed
or planned for at training time at all. (The musubi fork caches post-connector by default for the same reason;
training the connectors would need the pre-connector features and is not offered.)

The connectors' weights belong to the model version (2.3's sit in the checkpoint, 2.5's in its text-encoder file),
and 2.5 pairs them with Gemma 4: a 2.3 cache and a 2.5 cache are different encoders' outputs and never mix (the
cache key holds the text encoder's files and the spec's architecture; Cache Text Embeds reads them from the same
diffusers folder).
"""
from __future__ import annotations

from ..specs import TextEncoderSpec

#: The one cached text tensor: the video connector's output then the audio connector's, per token.
PROMPT_KEY = "prompt_embeds"
#: Tokens every caption is padded (left) to: the transformer always sees 1024 text rows (a shorter pad changes
#: which registers fill them).
MAX_LENGTH = 1024
#: The tiny fixtures' length (a multiple of their 8 registers).
TINY_LENGTH = 32

_ARCH = {"ltx2.3": "gemma3-12b+ltx2.3-connectors", "ltx2.5": "gemma4-12b+ltx2.5-connectors"}


def text_spec(variant: str) -> TextEncoderSpec:
    """The text-encoder spec of ``variant`` (kind ``gemma_connectors``: engine/caching/encoders/)."""
    length = TINY_LENGTH if variant == "ltx2-tiny" else MAX_LENGTH
    return TextEncoderSpec("text_encoder", "tokenizer", "gemma_connectors", length, PROMPT_KEY,
                           architecture=_ARCH.get(variant, "ltx2-tiny" if variant == "ltx2-tiny" else ""))
