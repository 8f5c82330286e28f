"""Qwen-Image-Edit's multimodal prompt: the instruction and the control images through Qwen2.5-VL.

What the Edit pipelines (diffusers 0.42.1 ``QwenImageEditPipeline`` / ``QwenImageEditPlusPipeline``
``_get_qwen_prompt_embeds``) do, taken apart so the 7B language model can run layer-major while the 0.68B vision
tower runs whole:

1. the text: the Edit system turn (``EDIT_SYSTEM``), then per control image ``"Picture {i}: <|vision_start|>
   <|image_pad|><|vision_end|>"`` (EditPlus) or one bare ``<|vision_start|><|image_pad|><|vision_end|>`` (Edit),
   then the instruction and the assistant turn (``prompt_text``);
2. the images the VL processor sees (``prompt_images``): EditPlus resizes each control image to a 384² area
   (``CONDITION_AREA``, sides multiples of 32); Edit gives it the control image at the 1024² area it also VAE-encodes;
3. the processor (``Qwen2VLProcessor``) expands each ``<|image_pad|>`` to one token per merged 28x28 patch and cuts
   the pixels into patches (``multimodal_inputs``);
4. the vision tower's merged patch embeddings replace the ``<|image_pad|>`` embeddings (``inputs_embeds``);
5. the language model runs with Qwen2.5-VL's 3-D (mRoPE) positions: text tokens count up on all three axes, image
   tokens take (t, row, column) of their patch grid (``mrope_position_ids``, transformers' own ``get_rope_index``);
6. ``hidden_states[-1]`` (after the final norm), each prompt's real tokens, the first 64 (the system turn and
   ``<|im_start|>user\\n``; ``EDIT_DROP``) dropped.

Positions (step 5): with transformers >= 5 the processor marks image tokens in ``mm_token_type_ids`` and the model
needs it to build the 3-D positions; diffusers 0.42.1's Edit pipelines do not pass it, so with transformers 5 they
silently fall back to 1-D positions (diffusers issue #14194, fix in PR #14189). Qwen-Image-Edit was trained with the
3-D positions (transformers 4.x computed them from the vision tokens), so this module computes them; the tests
compare against the pipeline with ``mm_token_type_ids`` forwarded, as that fix does.

Nothing here reads files: the caller hands in the processor, the vision tower, the embedding table and a runner for
the language model (the whole model for the reference path, or a layer-major runner from ``engine/caching``).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

#: The Edit pipelines' system turn through "<|im_start|>user\n" (``prompt_template_encode`` before ``{}``).
EDIT_SYSTEM = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
               "objects, background), then explain how the user's text instruction should alter or modify the image. "
               "Generate a new image that meets the user's requirements while maintaining consistency with the "
               "original input where appropriate.<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
#: ``prompt_template_encode_start_idx`` of both Edit pipelines: the system turn + "<|im_start|>user\n" in Qwen2 tokens.
EDIT_DROP = 64
#: Per control image before the instruction: EditPlus numbers them, Edit has one bare slot.
IMAGE_SLOT = {"plus": "Picture {}: <|vision_start|><|image_pad|><|vision_end|>",
              "edit": "<|vision_start|><|image_pad|><|vision_end|>"}
#: EditPlus: the VL processor sees each control image at this area; the VAE references (and Edit's one image, for
#: both) are at ``VAE_AREA``.
CONDITION_AREA = 384 * 384
VAE_AREA = 1024 * 1024

#: ``language_model(inputs_embeds, attention_mask, position_ids) -> hidden states after the final norm (B, L, D)``.
LanguageModel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def calculate_dimensions(area: int, ratio: float) -> tuple[int, int]:
    """(width, height) of about ``area`` pixels at aspect ``ratio`` (width / height), each a multiple of 32: the Edit
    pipelines' ``calculate_dimensions``."""
    width = math.sqrt(area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


def _check_mode(mode: str) -> None:
    if mode not in IMAGE_SLOT:
        raise ValueError(f"unknown Qwen-Image-Edit mode {mode!r}: 'plus' (Edit-2509/2511) or 'edit' (Edit)")


def prompt_text(caption: str, num_images: int, mode: str) -> str:
    """The text the processor gets for one instruction with ``num_images`` control images."""
    _check_mode(mode)
    if mode == "edit" and num_images != 1:
        raise ValueError(f"Qwen-Image-Edit (the first release) takes exactly one control image, got {num_images}; "
                         f"use Qwen-Image-Edit-2509 or 2511 for several")
    slots = "".join(IMAGE_SLOT[mode].format(i + 1) for i in range(num_images))
    return EDIT_SYSTEM + slots + caption + SUFFIX


def tiny_drop(tokenizer, mode: str = "plus") -> int:
    """What ``tokenizer`` makes of ``EDIT_SYSTEM`` (64 with Qwen2's; the tiny fixtures' word-level one cuts it apart
    differently). Edit's slot follows the dropped part, so both modes drop the same count."""
    _check_mode(mode)
    return len(tokenizer(EDIT_SYSTEM).input_ids)


def resize_image(image, width: int, height: int):
    """PIL resize as the Edit pipelines' ``VaeImageProcessor.resize`` does it (Lanczos; a same-size resize is a copy)."""
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor(vae_scale_factor=16).resize(image, height, width)


def prompt_images(images: Sequence, mode: str, condition_area: int = CONDITION_AREA, vae_area: int = VAE_AREA) -> list:
    """The control images (PIL, RGB) as the VL processor gets them: EditPlus at a 384² area, Edit at 1024² (the
    areas are parameters for tests on tiny images only)."""
    _check_mode(mode)
    area = condition_area if mode == "plus" else vae_area
    out = []
    for image in images:
        width, height = calculate_dimensions(area, image.width / image.height)
        out.append(resize_image(image, width, height))
    return out


def multimodal_inputs(processor, captions: Sequence[str], images: Sequence[Sequence], mode: str) -> dict:
    """The processor's tensors for a group of instructions, each with its own control images (PIL, as given: the
    caller resizes them with ``prompt_images``): ``input_ids``, ``attention_mask`` (right padding to the group's
    longest), ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``."""
    if len(captions) != len(images):
        raise ValueError(f"{len(captions)} instructions but {len(images)} lists of control images")
    texts = [prompt_text(c, len(imgs), mode) for c, imgs in zip(captions, images)]
    flat = [im for imgs in images for im in imgs]
    processor.tokenizer.padding_side = "right"  # a causal LM's real tokens do not see right padding
    out = processor(text=texts, images=flat or None, padding=True, return_tensors="pt")
    return dict(out)


def image_embeds(visual, inputs: dict) -> torch.Tensor:
    """The vision tower's merged patch embeddings of every control image of the group, in order (N, D)."""
    pixels = inputs["pixel_values"].to(next(visual.parameters()).device, next(visual.parameters()).dtype)
    return visual(pixels, grid_thw=inputs["image_grid_thw"].to(pixels.device)).pooler_output


def inputs_embeds(embed_tokens, inputs: dict, images: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """Token embeddings with the ``<|image_pad|>`` rows replaced by the image embeddings, as Qwen2_5_VLModel does."""
    ids = inputs["input_ids"]
    embeds = embed_tokens(ids.to(embed_tokens.weight.device))
    mask = (ids == image_token_id).to(embeds.device)
    if int(mask.sum()) != images.shape[0]:
        raise ValueError(f"{int(mask.sum())} image tokens in the prompts but {images.shape[0]} image embeddings; the "
                         f"processor and the vision tower disagree (patch or merge size)")
    return embeds.masked_scatter(mask.unsqueeze(-1), images.to(embeds.device, embeds.dtype))


def mrope_position_ids(config, inputs: dict) -> torch.Tensor:
    """(3, B, L) positions as Qwen2_5_VLModel computes them from the processor's ``mm_token_type_ids`` (its own
    ``get_rope_index``, run on a shell of the model built on the meta device: no weights)."""
    from transformers import Qwen2_5_VLModel

    if "mm_token_type_ids" not in inputs:
        raise ValueError("the processor gave no mm_token_type_ids (transformers < 5?); Qwen2.5-VL's 3-D positions need "
                         "them: update transformers")
    with torch.device("meta"):
        shell = Qwen2_5_VLModel(config)
    positions, _ = shell.get_rope_index(inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
                                        image_grid_thw=inputs.get("image_grid_thw"),
                                        attention_mask=inputs["attention_mask"])
    return positions


def encode_edit_prompts(captions: Sequence[str], images: Sequence[Sequence], mode: str, processor, visual,
                        embed_tokens, config, language_model: LanguageModel, drop: int = EDIT_DROP,
                        dtype: torch.dtype = torch.float32, **areas) -> list[torch.Tensor]:
    """One (L_i, D) tensor per instruction: ``hidden_states[-1]`` over its real tokens, the first ``drop`` cut, as
    the Edit pipeline's ``encode_prompt(prompt, image=...)`` gives it (with the 3-D positions; see the module doc).
    ``images``: each instruction's control images as the pipeline gets them (PIL); resized here (``prompt_images``).
    ``config``: the Qwen2_5_VLConfig (its ``image_token_id`` and vision merge size). ``areas``: ``condition_area`` /
    ``vae_area`` of ``prompt_images`` (tests only)."""
    prepared = [prompt_images(imgs, mode, **areas) for imgs in images]
    inputs = multimodal_inputs(processor, captions, prepared, mode)
    mask = inputs["attention_mask"]
    with torch.no_grad():
        if "pixel_values" in inputs:
            embeds = inputs_embeds(embed_tokens, inputs, image_embeds(visual, inputs), config.image_token_id)
        else:
            embeds = embed_tokens(inputs["input_ids"].to(embed_tokens.weight.device))
        positions = mrope_position_ids(config, inputs) if "pixel_values" in inputs else None
        hidden = language_model(embeds, mask, positions)
    return [row[m.bool().to(row.device)][drop:].to("cpu", dtype) for row, m in zip(hidden, mask)]


def whole_language_model(text_encoder) -> LanguageModel:
    """The reference runner: a loaded ``Qwen2_5_VLForConditionalGeneration``'s language model, whole."""
    lm = text_encoder.model.language_model

    def run(embeds, mask, positions):
        device = embeds.device
        out = lm(inputs_embeds=embeds, attention_mask=mask.to(device),
                 position_ids=None if positions is None else positions.to(device), use_cache=False)
        return out.last_hidden_state

    return run


def encode_with_model(text_encoder, processor, captions: Sequence[str], images: Sequence[Sequence], mode: str,
                      drop: int = EDIT_DROP, **areas) -> list[torch.Tensor]:
    """``encode_edit_prompts`` through a whole loaded ``Qwen2_5_VLForConditionalGeneration`` (vision tower, embedding
    table and language model in memory): the exact reference path, for small models and GPUs that hold 16 GB."""
    return encode_edit_prompts(captions, images, mode, processor, text_encoder.model.visual,
                               text_encoder.model.language_model.embed_tokens, text_encoder.config,
                               whole_language_model(text_encoder), drop, text_encoder.dtype, **areas)
