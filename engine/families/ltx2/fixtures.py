"""Tiny LTX-2 models for tests and the demo, built offline from configs (nothing is downloaded).

``build_tiny_pipeline``: a diffusers ``LTX2Pipeline`` folder: the tiny transformer (LTX-2.3's layout: gated
attention, prompt AdaLN, no caption projection), a tiny ``Gemma3ForConditionalGeneration`` (3 layers: 4 stacked
hidden states) with a word-level tokenizer, tiny ``LTX2TextConnectors`` in 2.3's form (per-modality projections,
8 registers), a tiny video VAE with the real level structure (32x spatial, 8x temporal) and random per-channel
statistics, a tiny audio VAE and vocoder (the pipeline's required parts; never run by training), and Lightricks'
scheduler config. ``write_single_file``: the transformer under its native names, bare or as ComfyUI's all-in-one
checkpoint (``ltx-2.3-22b-dev.safetensors``: under ``model.diffusion_model.`` with the connectors, the text projection
and the VAE beside it). ``comfyui_model``: what ComfyUI's detection makes of it.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..tiny import native_state, save_tensors, tiny_transformer, word_level_tokenizer

_TEXT_LAYERS = 3
_REGISTERS = 8


def tiny_gemma_tokenizer(max_length: int):
    """A real fast tokenizer in Gemma's layout (<pad> 0, <eos> 1, <bos> 2 first), left padding as the pipeline sets."""
    tok, vocab = word_level_tokenizer(["<pad>", "<eos>", "<bos>", "<unk>"], "<bos>", "<eos>", "<pad>", "<unk>",
                                      max_length)
    tok.padding_side = "left"
    return tok, vocab


def tiny_gemma3(vocab: int, hidden: int, seed: int):
    """A tiny ``Gemma3ForConditionalGeneration`` (LTX-2.3's text encoder class) with a tiny SigLIP tower."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    config = Gemma3Config(
        text_config=dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=_TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=256, sliding_window=16, pad_token_id=0, eos_token_id=1,
                         bos_token_id=2),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, boi_token_index=3, eoi_token_index=3, image_token_index=3)
    return Gemma3ForConditionalGeneration(config).eval()


def tiny_connectors(text_width: int, video_width: int, audio_width: int, seed: int):
    """LTX-2.3's ``LTX2TextConnectors`` at tiny widths: per-modality projections, gated attention, split RoPE."""
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    torch.manual_seed(seed + 3)
    return LTX2TextConnectors(
        caption_channels=text_width, text_proj_in_factor=_TEXT_LAYERS + 1,
        video_connector_num_attention_heads=2, video_connector_attention_head_dim=video_width // 2,
        video_connector_num_layers=2, video_connector_num_learnable_registers=_REGISTERS, video_gated_attn=True,
        audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=audio_width // 2,
        audio_connector_num_layers=2, audio_connector_num_learnable_registers=_REGISTERS, audio_gated_attn=True,
        rope_type="split", per_modality_projections=True, video_hidden_dim=video_width,
        audio_hidden_dim=audio_width, proj_bias=True).eval()


def tiny_video_vae(latent_channels: int, seed: int = 0):
    """A tiny ``AutoencoderKLLTX2Video`` with the released level structure (patch 4, spatial / temporal /
    spatiotemporal x2 downsamplers: 32x, 8x) and random latents_mean / latents_std (the released file's are not 0/1)."""
    from diffusers import AutoencoderKLLTX2Video

    torch.manual_seed(seed)
    vae = AutoencoderKLLTX2Video(latent_channels=latent_channels, block_out_channels=(8, 8, 16, 16),
                                 decoder_block_out_channels=(8, 16, 32), layers_per_block=(1, 1, 1, 1, 1),
                                 decoder_layers_per_block=(1, 1, 1, 1), decoder_causal=False,
                                 spatial_compression_ratio=32, temporal_compression_ratio=8)
    with torch.no_grad():
        vae.latents_mean.copy_(torch.randn(latent_channels) * 0.1)
        vae.latents_std.copy_(torch.rand(latent_channels) + 0.5)
    return vae.eval()


def tiny_audio(latent_channels: int, mel_bins: int, seed: int = 0):
    """A tiny audio VAE (``latent_channels`` x mel_bins / 4 features per audio token) and vocoder."""
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    torch.manual_seed(seed)
    vae = AutoencoderKLLTX2Audio(base_channels=latent_channels * mel_bins // 4, ch_mult=(1, 2, 4), num_res_blocks=1, latent_channels=latent_channels,
                                 mel_bins=mel_bins)
    vocoder = LTX2Vocoder(in_channels=latent_channels * mel_bins, hidden_channels=8, upsample_kernel_sizes=[4, 4],
                          upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1]])
    return vae.eval(), vocoder.eval()


def tiny_scheduler():
    """Lightricks' scheduler config (FlowMatchEulerDiscreteScheduler): the token-dependent exponential shift and
    ``shift_terminal`` 0.1."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from .family import BASE_SEQ, BASE_SHIFT, MAX_SEQ, MAX_SHIFT, SHIFT_TERMINAL

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True,
                                           base_image_seq_len=BASE_SEQ, max_image_seq_len=MAX_SEQ,
                                           base_shift=BASE_SHIFT, max_shift=MAX_SHIFT, shift_terminal=SHIFT_TERMINAL,
                                           time_shift_type="exponential")


def build_tiny_pipeline(folder: str | Path, seed: int = 0) -> Path:
    """Write a complete tiny ``LTX2Pipeline`` folder, loadable with ``LTX2Pipeline.from_pretrained``."""
    from diffusers import LTX2Pipeline

    from . import FAMILY
    from .text import TINY_LENGTH

    folder = Path(folder)
    transformer = tiny_transformer(FAMILY, seed)
    cfg = transformer.config
    tokenizer, vocab = tiny_gemma_tokenizer(TINY_LENGTH)
    text_encoder = tiny_gemma3(vocab, 16, seed)
    connectors = tiny_connectors(16, cfg.cross_attention_dim, cfg.audio_cross_attention_dim, seed)
    audio_vae, vocoder = tiny_audio(2, 16)
    pipe = LTX2Pipeline(scheduler=tiny_scheduler(), vae=tiny_video_vae(cfg.in_channels), audio_vae=audio_vae,
                        text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors,
                        transformer=transformer, vocoder=vocoder)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def write_single_file(pipeline_folder: str | Path, out_file: str | Path, dtype: torch.dtype | None = None,
                      prefix: str = "", bundle: bool = False) -> Path:
    """The pipeline's transformer as one file with the native names. ``prefix="model.diffusion_model.", bundle=True``
    writes ComfyUI's all-in-one ``ltx-2.3-22b-dev.safetensors`` layout: the connectors beside the transformer
    (``video_embeddings_connector.``, native names) and the tensors the transformer never reads
    (``text_embedding_projection.``, ``vae.``)."""
    from ..tiny import folder_state
    from . import FAMILY

    _, native = native_state(FAMILY, pipeline_folder)
    out = {prefix + k: v.to(dtype) if dtype else v for k, v in native.items()}
    if bundle:
        for k, v in folder_state(Path(pipeline_folder) / "connectors").items():
            if k.startswith(("video_connector.", "audio_connector.")):
                name = k.replace("video_connector.", "video_embeddings_connector.").replace(
                    "audio_connector.", "audio_embeddings_connector.").replace("transformer_blocks",
                                                                               "transformer_1d_blocks")
                out[prefix + name] = v
            else:
                out["text_embedding_projection." + k.replace("_text_proj_in", "_aggregate_embed")] = v
        for k, v in folder_state(Path(pipeline_folder) / "vae").items():
            out["vae." + k] = v
    return save_tensors(out, out_file)


def comfyui_model(config: dict) -> tuple[str, dict]:
    """What ComfyUI builds for an LTX-2.3 / 2.5 transformer of this diffusers ``config``: ``comfy.model_base.LTXAV``
    and the ``unet_config`` its detection derives from a native file (``model_detection``: ``ltxav`` from
    ``audio_adaln_single``, blocks counted, ``attention_head_dim`` = attn2.to_k's rows / 32, ``cross_attention_dim``
    its columns, the keyframe flag from its tensor). Its LoRA key map reads the state dict only."""
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    return "LTXAV", {"image_model": "ltxav", "num_layers": config["num_layers"], "attention_head_dim": inner // 32,
                     "cross_attention_dim": config["cross_attention_dim"],
                     "use_keyframes_abs_pos_embedding": bool(config.get("use_keyframes_abs_pos_embedding", False))}
