"""T5-XXL's encoder, every token (Flux.1's ``prompt_embeds``): ComfyUI's ``t5xxl_fp16.safetensors`` (or an fp8 /
scaled-fp8 file), whose tokenizer ComfyUI bundles (``t5_tokenizer``). Told from umT5, which has every name T5 has,
by its relative-attention bias: T5 keeps one in the first layer only (``umt5.py``)."""
from __future__ import annotations

from ._model import EncoderModelKind

#: T5's and umT5's first self-attention; umT5 also has a relative-attention bias in every later layer.
FIRST_ATTENTION = "encoder.block.0.layer.0.SelfAttention"
LATER_BIAS = "encoder.block.1.layer.0.SelfAttention.relative_attention_bias"


class T5(EncoderModelKind):
    kind = "t5"
    file_kind = "t5xxl"
    display_name = "T5-XXL"
    output = "sequence"
    model_class = "T5EncoderModel"
    comfyui_bundles_tokenizer = True

    def match(self, shapes):
        t5_names = any(FIRST_ATTENTION in k for k in shapes)
        return 2 if t5_names and not any(LATER_BIAS in k for k in shapes) else 0


KIND = T5()
