"""Tiny Flux.1 fixtures, built offline from configs: a full diffusers pipeline folder (transformer, CLIP-L
and T5 with working tokenizers, VAE, scheduler), its transformer as a BFL single file, and its text
encoders and VAE as the single files ComfyUI users keep. Nothing is downloaded."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from ..tiny import add_tiny_controls  # noqa: F401  (edit pairs: Kontext / Flux.2 references)
from ..tiny import (native_state, save_tensors, tiny_flux_ae, tiny_transformer, word_level_tokenizer,
                    write_ldm_vae_file)
from . import FAMILY


def build_tiny_pipeline(folder: str | Path, seed: int = 0, variant: str | None = None) -> Path:
    """Write a complete tiny Flux.1 diffusers pipeline folder; returns its path. ``variant``: the family's
    ``tiny_variant`` by default; ``flux1-demo`` is the demo's (one ComfyUI loads)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    folder = Path(folder)
    transformer = tiny_transformer(FAMILY, seed, variant)
    config = dict(transformer.config)
    torch.manual_seed(seed)

    clip_tok, clip_vocab = word_level_tokenizer(
        ["<|endoftext|>", "<|startoftext|>", "<unk>"], "<|startoftext|>", "<|endoftext|>", "<|endoftext|>", "<unk>", 77
    )
    t5_tok, t5_vocab = word_level_tokenizer(["<pad>", "</s>", "<unk>"], None, "</s>", "<pad>", "<unk>", 512)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=clip_vocab, hidden_size=config["pooled_projection_dim"], intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=77, projection_dim=32,
        bos_token_id=1, eos_token_id=0, pad_token_id=0,
    ))
    t5 = T5EncoderModel(T5Config(
        vocab_size=t5_vocab, d_model=config["joint_attention_dim"], d_kv=8, d_ff=64, num_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ))
    vae = tiny_flux_ae(config["in_channels"] // 4)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tok,
        text_encoder_2=t5, tokenizer_2=t5_tok, transformer=transformer,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def write_single_file(pipeline_folder: str | Path, out_file: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write the pipeline's transformer as one safetensors file with original BFL names,
    the way ComfyUI users have Flux in models/diffusion_models/."""
    _, native = native_state(FAMILY, pipeline_folder)
    return save_tensors({k: v.to(dtype) if dtype else v for k, v in native.items()}, out_file)


def write_text_and_vae_files(pipeline_folder: str | Path, folder: str | Path, with_tokenizers: bool = True) -> dict:
    """The tiny pipeline's text encoders and VAE as the single files ComfyUI users keep:
    ``clip_l.safetensors`` (``text_model.`` names), ``t5xxl.safetensors`` and ``ae.safetensors`` (BFL/LDM
    names), each with a companion folder holding its (tiny) config and, optionally, its tokenizer."""
    import shutil

    from safetensors.torch import load_file

    pipeline_folder, folder = Path(pipeline_folder), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, sub, tok, prefix in (("clip_l", "text_encoder", "tokenizer", "text_model."),
                                   ("t5xxl", "text_encoder_2", "tokenizer_2", "")):
        state = {}
        for f in sorted((pipeline_folder / sub).glob("*.safetensors")):
            state.update(load_file(str(f)))
        state = {(prefix + k if prefix and not k.startswith(prefix) else k): v.contiguous() for k, v in state.items()}
        save_file(state, str(folder / f"{name}.safetensors"))
        companion = folder / name
        companion.mkdir(exist_ok=True)
        shutil.copy(pipeline_folder / sub / "config.json", companion / "config.json")
        if with_tokenizers:
            for f in (pipeline_folder / tok).iterdir():
                shutil.copy(f, companion / f.name)
        out[name] = folder / f"{name}.safetensors"
    out["vae"] = write_ldm_vae_file(pipeline_folder / "vae", folder / "ae.safetensors")
    return out


def comfyui_model(config: dict) -> tuple[str, dict]:
    """What ComfyUI builds for a Flux.1 transformer of this diffusers ``config``: the ``comfy.model_base`` class
    name and the part of its ``unet_config`` that ``comfy.lora.model_lora_keys_unet`` reads (via
    ``comfy.utils.flux_to_diffusers``), with the values ``comfy.model_detection`` derives from the file."""
    return "Flux", {"depth": config["num_layers"], "depth_single_blocks": config["num_single_layers"],
                    "hidden_size": config["num_attention_heads"] * config["attention_head_dim"]}
