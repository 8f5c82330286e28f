"""A vision-language text encoder (Qwen2.5-VL) for prompts that carry images, from the file's memory map.

Qwen-Image-Edit's prompt runs the control images through Qwen2.5-VL's vision tower into its 7B language model. The
family says what happens (``families/qwen_image/edit_text.py``: template, processor, image embeddings, 3-D
positions); this module provides the parts it runs on, read through the one checkpoint reader (fp8 and ComfyUI's
scaled files decode with their scales):

- the vision tower (0.68B), whole, on the device: it is small and runs once per group of prompts;
- the embedding table, on the host (as ``stacked_text`` keeps it);
- the language model layer-major (``layer_major``): all prompts of a group through layer i before layer i+1, each
  layer read from the memory map once per group (prefetched on a worker thread), the final norm on the host; it is
  given ``inputs_embeds`` and the (3, B, L) positions, so the result equals the whole model's ``hidden_states[-1]``.

The same folder layouts as ``stacked_text``: a diffusers pipeline's ``text_encoder/`` (``model.visual.``,
``model.language_model.``) or ComfyUI's single file (``visual.``, ``model.``) with a config.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..checkpoint import TensorStore, open_files
from ..errors import ModelLoadError
from .layer_major import layer_major
from .stacked_text import _LayerPrefetcher, load_truncated_decoder

#: Where the vision tower's tensors live: transformers 5's ``Qwen2_5_VLForConditionalGeneration`` and ComfyUI's file.
VISUAL_PREFIXES = ("model.visual.", "visual.")


@dataclass
class VisionLanguageParts:
    """What a multimodal prompt encoder needs: ``visual`` (on the device), ``embed_tokens`` (host), ``config`` (the
    whole VL config), ``language_model(inputs_embeds, attention_mask, position_ids) -> normed last hidden states``
    (layer-major), and ``close()`` to drop the prefetcher and the weights."""

    visual: torch.nn.Module
    embed_tokens: torch.nn.Module
    config: object
    language_model: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    close: Callable[[], None]


def load_vision_tower(files: list[Path], config, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The VL model's vision tower with every weight read from ``files`` (an error names a missing one)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    store = TensorStore(open_files(files, "the text encoder"), VISUAL_PREFIXES)
    with torch.device("meta"):
        visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(config.vision_config, dtype=dtype)
    state = {}
    for name, _ in visual.state_dict().items():
        if name not in store:
            raise ModelLoadError(f"'{files[0]}' has no vision tower tensor '{name}' (under {' or '.join(VISUAL_PREFIXES)});"
                                 f" Qwen-Image-Edit needs the whole Qwen2.5-VL file, vision tower included")
        state[name] = store.get(name, dtype, device)
    visual.load_state_dict(state, assign=True, strict=True)
    # buffers computed from the config, not stored (the rotary inverse frequencies)
    visual.rotary_pos_emb = type(visual.rotary_pos_emb)(config.vision_config).to(device)
    return visual.requires_grad_(False).eval()


def vision_language_parts(files: list[Path], config, device: torch.device, dtype: torch.dtype) -> VisionLanguageParts:
    """The parts of a Qwen2.5-VL encoder (``config``: its ``Qwen2_5_VLConfig``) from its weight ``files``."""
    text_config = config.text_config
    layers = text_config.num_hidden_layers
    visual = load_vision_tower(files, config, device, dtype)
    model, weights = load_truncated_decoder(files[0].parent, layers, dtype, files, text_config, final_norm=True)
    prefetch = _LayerPrefetcher(weights, model.layers[0], layers, dtype, pin=device.type == "cuda")
    host = torch.device("cpu")

    def language_model(embeds, mask, positions):
        prefetch.pending.clear()  # every call reads every layer again, from layer 0
        with torch.no_grad(), layer_major(model, device, chunk_size=4, load_layer=prefetch, host=host) as m:
            m.norm.to(host)
            out = m(inputs_embeds=embeds.to(host), attention_mask=mask.to(host),
                    position_ids=None if positions is None else positions.to(host), use_cache=False)
        return out.last_hidden_state

    return VisionLanguageParts(visual, model.embed_tokens, config, language_model, prefetch.close)
