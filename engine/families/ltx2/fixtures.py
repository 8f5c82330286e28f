"""Tiny LTX-2 models for tests and the demo, built offline from configs (nothing is downloaded).

``build_tiny_pipeline``: a diffusers ``LTX2Pipeline`` folder: the tiny transformer (LTX-2.3's layout: gated
attention, prompt AdaLN, no caption projection), a tiny ``Gemma3ForConditionalGeneration`` (3 layers: 4 stacked
hidden states) with a word-level tokenizer, tiny ``LTX2TextConnectors`` in 2.3's form (per-modality projections,
8 registers), a tiny video VAE with the real level structure (32x spatial, 8x temporal) and random per-channel
statistics, a tiny audio VAE and vocoder (the pipeline's required parts; never run by training), and Lightricks'
scheduler config. The connectors' and the video VAE's configs are the shipped ``configs/connectors/ltx2-tiny.json``
and ``configs/vae/ltx2-tiny.json`` (what a single file of the tiny model is read with). ``write_single_file``: the
transformer under its native names, bare or as ComfyUI's all-in-one checkpoint (``ltx-2.3-22b-dev.safetensors``: under
``model.diffusion_model.`` with the connectors, the text projection and the VAE beside it, in Lightricks' names).
``write_comfy_gemma``: the Gemma text encoder as ComfyUI's ``gemma_3_12B_it.safetensors`` (or ``_fp8_scaled``).
``comfyui_model``: what ComfyUI's detection makes of it.
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
    """LTX-2.3's ``LTX2TextConnectors`` at tiny widths (the shipped ``configs/connectors/ltx2-tiny.json``):
    per-modality projections, gated attention, split RoPE, 8 registers."""
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    from .comfy_files import connectors_config

    config = connectors_config("ltx2-tiny")
    assert (config["caption_channels"], config["video_hidden_dim"], config["audio_hidden_dim"],
            config["text_proj_in_factor"], config["video_connector_num_learnable_registers"]) == (
        text_width, video_width, audio_width, _TEXT_LAYERS + 1, _REGISTERS), "configs/connectors/ltx2-tiny.json"
    torch.manual_seed(seed + 3)
    return LTX2TextConnectors(**config).eval()


def tiny_video_vae(latent_channels: int, seed: int = 0):
    """A tiny ``AutoencoderKLLTX2Video`` with the released level structure (patch 4, spatial / temporal /
    spatiotemporal x2 downsamplers: 32x, 8x; the shipped ``configs/vae/ltx2-tiny.json``) and random latents_mean /
    latents_std (the released file's are not 0/1)."""
    import json
    from importlib import resources

    from diffusers import AutoencoderKLLTX2Video

    config = json.loads(resources.files(__package__).joinpath("configs", "vae", "ltx2-tiny.json").read_text())
    assert config["latent_channels"] == latent_channels, "configs/vae/ltx2-tiny.json"
    torch.manual_seed(seed)
    vae = AutoencoderKLLTX2Video(**{k: v for k, v in config.items() if not k.startswith("_")})
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

    from .comfy_files import TRANSFORMER_PREFIX, connector_keys

    _, native = native_state(FAMILY, pipeline_folder)
    out = {prefix + k: v.to(dtype) if dtype else v for k, v in native.items()}
    if bundle:
        for k, v in connector_keys(folder_state(Path(pipeline_folder) / "connectors")).items():
            out[prefix + k.removeprefix(TRANSFORMER_PREFIX) if k.startswith(TRANSFORMER_PREFIX) else k] = v
        for k, v in original_vae_state(folder_state(Path(pipeline_folder) / "vae")).items():
            out["vae." + k] = v
    return save_tensors(out, out_file)


def original_vae_state(state: dict) -> dict:
    """An ``AutoencoderKLLTX2Video`` state dict under Lightricks' original names (the checkpoint's ``vae.*``): the
    encoder's levels interleaved resnets / downsampler as down_blocks.0, 1, ..., its mid block last; the decoder's mid
    block as up_blocks.0, then upsampler / resnets pairs; the statistics as ``per_channel_statistics``. Written from
    the layout (not by inverting the reader's rename table); diffusers' own ``convert_ltx2_vae_to_diffusers`` maps it
    back (test_comfy_files.py)."""
    import re

    levels = 1 + max(int(m.group(1)) for k in state for m in [re.match(r"encoder\.down_blocks\.(\d+)\.", k)] if m)
    out = {}
    for key, value in state.items():
        name = key
        if key in ("latents_mean", "latents_std"):
            name = "per_channel_statistics." + ("mean-of-means" if key == "latents_mean" else "std-of-means")
        elif key.startswith("encoder.down_blocks."):
            i, rest = re.match(r"encoder\.down_blocks\.(\d+)\.(.*)", key).groups()
            if rest.startswith("downsamplers.0."):
                name = f"encoder.down_blocks.{2 * int(i) + 1}.{rest[len('downsamplers.0.'):]}"
            else:
                name = f"encoder.down_blocks.{2 * int(i)}.{rest}"
        elif key.startswith("encoder.mid_block."):
            name = f"encoder.down_blocks.{2 * levels}." + key[len("encoder.mid_block."):]
        elif key.startswith("decoder.mid_block."):
            name = "decoder.up_blocks.0." + key[len("decoder.mid_block."):]
        elif key.startswith("decoder.up_blocks."):
            i, rest = re.match(r"decoder\.up_blocks\.(\d+)\.(.*)", key).groups()
            if rest.startswith("upsamplers.0."):
                name = f"decoder.up_blocks.{2 * int(i) + 1}.{rest[len('upsamplers.0.'):]}"
            else:
                name = f"decoder.up_blocks.{2 * int(i) + 2}.{rest}"
        elif key.startswith(("decoder.time_embedder.", "decoder.scale_shift_table")):
            name = key.replace("decoder.", "decoder.last_", 1)
        out[name.replace(".resnets.", ".res_blocks.")] = value
    return out


def fp8_scale(weight: torch.Tensor) -> torch.Tensor:
    """A per-tensor float8_e4m3fn scale: the power of two at or above absmax / 448."""
    return torch.exp2(torch.ceil(torch.log2(weight.float().abs().max().clamp_min(1e-30) / 448.0)))


def write_comfy_gemma(pipeline_folder: str | Path, out_file: str | Path, dtype: torch.dtype | None = None,
                      fp8_scaled: bool = False) -> Path:
    """The pipeline's Gemma 3 as ComfyUI's ``gemma_3_12B_it.safetensors``: the language model under ``model.``
    (``model.embed_tokens``, ``model.layers.N``, ``model.norm``), the SigLIP tower as ``vision_model.`` and the
    projector as ``multi_modal_projector.`` (ai-toolkit's ``convert_comfy_gemma3_to_transformers`` maps exactly these
    back); no ``lm_head`` (tied); in ``dtype`` (None: as stored). ``fp8_scaled``: every layer's 2-D weights
    float8_e4m3fn with a per-tensor ``weight_scale`` and a ``comfy_quant`` tag (the ``_fp8_scaled`` file's form; the
    scale a power of two, so weights already on that grid are stored exactly). The tiny tokenizer and config go in
    the companion folder (a real file embeds its tokenizer as ``spiece_model`` and is read with the shipped config)."""
    import json
    import shutil

    from ..tiny import folder_state

    pipeline_folder, out_file = Path(pipeline_folder), Path(out_file)
    out = {}
    for k, v in folder_state(pipeline_folder / "text_encoder").items():
        for old, new in (("language_model.model.", "model."), ("model.language_model.", "model."),
                         ("vision_tower.vision_model.", "vision_model."), ("model.vision_tower.vision_model.",
                                                                          "vision_model."),
                         ("model.multi_modal_projector.", "multi_modal_projector.")):
            if k.startswith(old):
                k = new + k[len(old):]
                break
        if k.startswith("lm_head.") or k.startswith("language_model.lm_head."):
            continue
        if fp8_scaled and k.startswith("model.layers.") and k.endswith(".weight") and v.dim() == 2:
            scale = fp8_scale(v)
            out[k] = (v.float() / scale).to(torch.float8_e4m3fn)
            out[k[: -len("weight")] + "weight_scale"] = scale.reshape(())
            out[k[: -len("weight")] + "comfy_quant"] = torch.tensor(
                list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
        else:
            out[k] = v.to(dtype) if dtype is not None else v
    path = save_tensors(out, out_file)
    companion = out_file.with_name(out_file.name[: -len(".safetensors")])
    shutil.copytree(pipeline_folder / "tokenizer", companion, dirs_exist_ok=True)
    shutil.copy(pipeline_folder / "text_encoder" / "config.json", companion / "config.json")
    return path


def comfyui_model(config: dict) -> tuple[str, dict]:
    """What ComfyUI builds for an LTX-2.3 / 2.5 transformer of this diffusers ``config``: ``comfy.model_base.LTXAV``
    and the ``unet_config`` its detection derives from a native file (``model_detection``: ``ltxav`` from
    ``audio_adaln_single``, blocks counted, ``attention_head_dim`` = attn2.to_k's rows / 32, ``cross_attention_dim``
    its columns, the keyframe flag from its tensor). Its LoRA key map reads the state dict only."""
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    return "LTXAV", {"image_model": "ltxav", "num_layers": config["num_layers"], "attention_head_dim": inner // 32,
                     "cross_attention_dim": config["cross_attention_dim"],
                     "use_keyframes_abs_pos_embedding": bool(config.get("use_keyframes_abs_pos_embedding", False))}
