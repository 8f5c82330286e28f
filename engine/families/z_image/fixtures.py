"""Tiny Z-Image models for tests and the demo, built offline from configs (nothing is downloaded).

``build_tiny_pipeline``: a diffusers ``ZImagePipeline`` folder (tiny transformer, a tiny Qwen3 with a
word-level tokenizer whose chat template has Qwen3's shape, the tiny Flux.1-layout AE, the Turbo scheduler).
``write_single_file``: its transformer with ComfyUI's native names. ``write_text_and_vae_files``: its text
encoder and VAE as ComfyUI keeps them (``qwen_3_4b.safetensors``, ``ae.safetensors``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..tiny import (native_state, save_tensors, tiny_decoder_lm, tiny_flux_ae, tiny_transformer,
                    word_level_tokenizer, write_decoder_lm_files)

#: Qwen3's chat template reduced to what ZImagePipeline uses: one user turn, the assistant prompt, and the
#: empty think block only when ``enable_thinking`` is false (Z-Image passes True: no block).
TINY_QWEN3_THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
#: Ids 0 / 1 / 2 are tiny_decoder_lm's pad / bos / eos ids; Qwen pads with <|endoftext|>.
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "<think>", "</think>"]
_TEXT_LAYERS = 3  # the tiny Qwen3's layers; the family's tiny spec keeps hidden_states[-2] = 2 layers


def tiny_qwen3_tokenizer(max_length: int = 512):
    """A real fast tokenizer with Qwen's special tokens (matched whole, before word splitting), no BOS/EOS
    added (Qwen adds none), right padding with <|endoftext|>, and a Qwen3-shaped chat template."""
    from tokenizers import processors

    tokenizer, vocab = word_level_tokenizer(_SPECIALS + ["user", "assistant", "system"], None, "<|im_end|>",
                                            "<|endoftext|>", "<unk>", max_length)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<think>", "</think>"]})
    tokenizer.chat_template = TINY_QWEN3_THINKING_TEMPLATE
    tokenizer.padding_side = "right"
    return tokenizer, vocab


def build_tiny_pipeline(folder: str | Path, seed: int = 0) -> Path:
    """Write a complete tiny ``ZImagePipeline`` folder, loadable with ``ZImagePipeline.from_pretrained``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    from . import FAMILY

    folder = Path(folder)
    transformer = tiny_transformer(FAMILY, seed)
    config = dict(transformer.config)
    torch.manual_seed(seed)
    tokenizer, vocab = tiny_qwen3_tokenizer()
    # The released pipeline's text_encoder is a Qwen3Model (no lm_head): the decoder without its head.
    text_encoder = tiny_decoder_lm("qwen3", vocab, config["cap_feat_dim"], _TEXT_LAYERS, seed).model
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = ZImagePipeline(scheduler=scheduler, vae=tiny_flux_ae(), text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder



def write_single_file(pipeline_folder: str | Path, out_file: str | Path, dtype: torch.dtype | None = None,
                      prefix: str = "") -> Path:
    """The pipeline's transformer as one file with ComfyUI's native names (fused qkv, ``x_embedder``, ...), as
    ``z_image_turbo_bf16.safetensors`` is kept in ``models/diffusion_models/``; ``prefix`` =
    ``"model.diffusion_model."`` writes the full-checkpoint form."""
    from . import FAMILY

    _, native = native_state(FAMILY, pipeline_folder)
    return save_tensors({prefix + k: v.to(dtype) if dtype else v for k, v in native.items()}, out_file)


def write_text_and_vae_files(pipeline_folder: str | Path, folder: str | Path) -> dict[str, Path]:
    """The tiny Qwen3 as ``qwen_3_4b.safetensors`` (``model.`` names, companion folder) and ``ae.safetensors``."""
    return write_decoder_lm_files(pipeline_folder, folder, "qwen_3_4b")


def comfyui_model(config: dict) -> tuple[str, dict]:
    """What ComfyUI builds for a Z-Image transformer of this diffusers ``config``: ``comfy.model_base.Lumina2``
    (``supported_models.ZImage`` subclasses Lumina2 and keeps its model class) and the part of its
    ``unet_config`` that ``comfy.lora.model_lora_keys_unet`` reads (``comfy.utils.z_image_to_diffusers``:
    ``dim``, ``n_layers``), with the values ``comfy.model_detection`` derives from the file. Detection sets no
    ``n_refiner_layers``: ComfyUI assumes 2, which Z-Image has."""
    return "Lumina2", {"image_model": "lumina2", "dim": config["dim"], "cap_feat_dim": config["cap_feat_dim"],
                       "n_layers": config["n_layers"]}
