"""Tiny Lumina 2 fixtures, built offline from configs: a pipeline folder and the single files users keep.

- ``build_tiny_pipeline``: a ``Lumina2Pipeline`` folder (tiny transformer with GQA, a 3-layer
  ``Gemma2Model`` with a word-level tokenizer that adds BOS as Gemma's does, the tiny Flux AE,
  ``FlowMatchEulerDiscreteScheduler`` with a static shift 6); loads with
  ``Lumina2Pipeline.from_pretrained(folder, use_safetensors=True)``.
- ``write_single_file``: the transformer with native NextDiT names (ComfyUI's ``lumina_2_model_bf16``
  layout), optionally ``model.diffusion_model.``-prefixed (the all-in-one checkpoint), with the unused
  ``norm_final.weight`` that original files carry.
- ``write_text_and_vae_files``: Gemma with ``model.`` names (ComfyUI's ``gemma_2_2b_fp16``) and the
  VAE with LDM names (``ae.safetensors``), each with a companion folder holding the tiny config.

The real tokenizer is SentencePiece and gated; the tiny one is a fast word-level tokenizer with Gemma's
special ids (pad 0, eos 1, bos 2, unk 3), adding ``<bos>`` and no EOS, as GemmaTokenizer does.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..tiny import (native_state, save_tensors, tiny_flux_ae, tiny_transformer, word_level_tokenizer,
                    write_decoder_lm_files)
from .names import UNUSED_NATIVE_KEYS

#: The tiny Gemma2Model; ``text_encoder_specs("lumina2-tiny")`` keeps the output of its layer 2
#: (= hidden_states[-2] of 3 layers). Its width is the tiny transformer's ``cap_feat_dim``.
TINY_GEMMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, max_position_embeddings=128,
                  sliding_window=4096, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def tiny_gemma_tokenizer(max_length: int = 256):
    """A fast word-level tokenizer with Gemma's special tokens and ids; BOS first, no EOS."""
    from tokenizers import processors

    tokenizer, vocab = word_level_tokenizer(["<pad>", "<eos>", "<bos>", "<unk>"], "<bos>", "<eos>", "<pad>",
                                            "<unk>", max_length)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 2)])
    tokenizer.padding_side = "right"  # Lumina2Pipeline sets it too
    return tokenizer, vocab


def build_tiny_pipeline(folder: str | Path, seed: int = 0) -> Path:
    """Write a complete tiny Lumina 2 diffusers pipeline folder; returns its path."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline
    from transformers import Gemma2Config, Gemma2Model

    from . import FAMILY

    folder = Path(folder)
    transformer = tiny_transformer(FAMILY, seed)
    config = dict(transformer.config)
    torch.manual_seed(seed)
    tokenizer, vocab = tiny_gemma_tokenizer()
    gemma = Gemma2Model(Gemma2Config(vocab_size=vocab, **{**TINY_GEMMA, "hidden_size": config["cap_feat_dim"]}))
    with torch.no_grad():  # Gemma's RMSNorms scale by (1 + w) and start at w = 0: make them matter
        gen = torch.Generator().manual_seed(seed + 2)
        for name, p in gemma.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    # Static shift 6, as Lumina samples (ComfyUI sampling_settings, Alpha-VLLM sample.sh); the hub's
    # scheduler_config.json was not available to check (new-families-facts §6).
    scheduler = FlowMatchEulerDiscreteScheduler(shift=6.0, use_dynamic_shifting=False)
    pipe = Lumina2Pipeline(transformer=transformer, scheduler=scheduler, vae=tiny_flux_ae(),
                           text_encoder=gemma, tokenizer=tokenizer)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder



def write_single_file(pipeline_folder: str | Path, out_file: str | Path, dtype: torch.dtype | None = None,
                      prefix: str = "", norm_final: bool = True) -> Path:
    """The pipeline's transformer as one file with native NextDiT names (``prefix`` before each, e.g.
    ``model.diffusion_model.``); ``norm_final`` adds the unused ``norm_final.weight`` real files have."""
    from . import FAMILY

    config, native = native_state(FAMILY, pipeline_folder)
    out = {prefix + k: v.to(dtype) if dtype else v for k, v in native.items()}
    if norm_final:
        (name,) = UNUSED_NATIVE_KEYS
        out[prefix + name] = torch.ones(config["hidden_size"], dtype=dtype or torch.float32)
    return save_tensors(out, out_file)


def write_text_and_vae_files(pipeline_folder: str | Path, folder: str | Path) -> dict[str, Path]:
    """The tiny Gemma-2 as ``gemma_2_2b.safetensors`` (``model.`` names, companion folder) and ``ae.safetensors``."""
    return write_decoder_lm_files(pipeline_folder, folder, "gemma_2_2b")


def comfyui_model(config: dict) -> tuple[str, dict]:
    """What ComfyUI builds for a Lumina 2 transformer of this diffusers ``config``: ``comfy.model_base.Lumina2``
    and the part of its ``unet_config`` that ``comfy.lora.model_lora_keys_unet`` reads (``dim``, ``n_layers``),
    with the values ``comfy.model_detection`` derives from the file. (Its diffusers-name map,
    ``z_image_to_diffusers``, assumes as many key/value heads as query heads, which Lumina 2's GQA does not
    have: our "comfyui" LoRA uses the native names that the generic part of the key map loads.)"""
    return "Lumina2", {"image_model": "lumina2", "dim": config["hidden_size"], "cap_feat_dim": config["cap_feat_dim"],
                       "n_layers": config["num_layers"]}
