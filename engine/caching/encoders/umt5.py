"""umT5-XXL's encoder, every token (Wan's ``prompt_embeds``, padding rows zeroed: ``length="zero_padded"``).

It has T5's names; it has a relative-attention bias in every layer, T5 in the first only (ComfyUI itself cannot
tell them apart: its CLIPLoader type, "wan", says which; the vocabularies, 256384 and 32128 rows of ``shared``,
differ too but not in tiny models). ComfyUI's ``umt5_xxl_fp8_e4m3fn_scaled.safetensors`` embeds its tokenizer as
a ``spiece_model`` tensor, framed as WanPipeline's tokenizer (google/umt5-xxl, a T5Tokenizer) frames it: ``</s>``
(1) appended, no BOS, <pad> 0, right padding; ComfyUI's ``UMT5XXlTokenizer``: ``add_eos=True``, no start token,
pad 0."""
from __future__ import annotations

from ..embedded_tokenizer import SpieceLayout
from ._model import EncoderModelKind
from .t5 import FIRST_ATTENTION, LATER_BIAS


class UMT5(EncoderModelKind):
    kind = "umt5"
    file_kind = "umt5xxl"
    display_name = "umT5-XXL"
    output = "sequence"
    model_class = "UMT5EncoderModel"
    spiece_layouts = {"umt5xxl": SpieceLayout(bos=False, eos=True, padding_side="right", name="umT5-XXL")}
    embedding_files = {"umt5xxl": "umt5_xxl_fp8_e4m3fn_scaled.safetensors"}

    def match(self, shapes):
        both = any(FIRST_ATTENTION in k for k in shapes) and any(LATER_BIAS in k for k in shapes)
        return 2 if both else 0


KIND = UMT5()
