"""CLIP-L's pooled vector (Flux.1's ``pooled_prompt_embeds``): ComfyUI's ``clip_l.safetensors``, whose tokenizer
ComfyUI bundles (``sd1_tokenizer``)."""
from __future__ import annotations

from ._model import EncoderModelKind


class ClipPooled(EncoderModelKind):
    kind = "clip_pooled"
    file_kind = "clip_l"
    display_name = "CLIP-L"
    output = "pooled"
    model_class = "CLIPTextModel"
    comfyui_bundles_tokenizer = True

    def match(self, shapes):
        return 2 if any("embeddings.token_embedding" in k for k in shapes) else 0

    def caption_length(self, spec, max_length):
        return spec.max_length  # CLIP's own 77 tokens, whatever the sequence encoder's length


KIND = ClipPooled()
