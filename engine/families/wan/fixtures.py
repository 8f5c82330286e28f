"""Tiny Wan models for tests and the demo, built offline from configs (nothing is downloaded).

``build_tiny_pipeline``: a diffusers ``WanPipeline`` folder (the tiny transformer, a tiny ``UMT5EncoderModel``
with a word-level tokenizer in T5's style: pad 0, EOS 1 appended, a tiny ``AutoencoderKLWan`` with the released
level structure, the hub's UniPC scheduler config). ``variant="wan2.2-ti2v-tiny"`` builds the TI2V-5B layout
instead (48 channels, the Wan 2.2 VAE, ``expand_timesteps``). ``write_single_file``: the transformer under the
original Wan names, as ComfyUI keeps it. ``write_text_and_vae_files``: ``umt5_xxl_fp16.safetensors`` (T5 names)
and the VAE with the original Wan names (``wan_2.1_vae.safetensors`` / ``wan2.2_vae.safetensors``), each with a
companion folder holding the tiny config (and the tokenizer).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from ..tiny import (folder_state, native_state, randomize_zero_inits, save_tensors, wan_vae_original_key,
                    word_level_tokenizer, write_wan_vae_file)


def tiny_umt5_tokenizer(max_length: int = 512):
    """A real fast tokenizer in T5's layout (``<pad>`` 0, ``</s>`` 1 appended, ``<unk>`` 2), as umT5's."""
    return word_level_tokenizer(["<pad>", "</s>", "<unk>"], None, "</s>", "<pad>", "<unk>", max_length)


def tiny_umt5(vocab: int, width: int, seed: int):
    """A tiny ``UMT5EncoderModel`` (WanPipeline's text encoder class): a relative-attention bias in every layer."""
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    config = UMT5Config(vocab_size=vocab, d_model=width, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                        relative_attention_num_buckets=8, relative_attention_max_distance=32,
                        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return UMT5EncoderModel(config).eval()


def tiny_wan_vae(wan22: bool = False):
    """A tiny AutoencoderKLWan with the released level structure at base width 8: the Wan 2.1 VAE's real
    latents_mean / latents_std (16 channels), or the Wan 2.2 VAE's config (48 channels, 2x2 patchify, residual)."""
    from diffusers import AutoencoderKLWan

    from ..base import load_package_json

    torch.manual_seed(0)
    if not wan22:
        return AutoencoderKLWan(base_dim=8, z_dim=16)
    config = {k: v for k, v in load_package_json(__name__, "configs", "vae", "wan2_2", "config.json").items()
              if not k.startswith("_")}
    return AutoencoderKLWan(**{**config, "base_dim": 8, "decoder_base_dim": 8})


def build_tiny_pipeline(folder: str | Path, seed: int = 0, variant: str | None = None) -> Path:
    """Write a complete tiny ``WanPipeline`` folder, loadable with ``WanPipeline.from_pretrained``."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    from . import FAMILY
    from .family import FLOW_SHIFT_T2V, FLOW_SHIFT_TI2V

    variant = variant or FAMILY.tiny_variant
    if FAMILY.first_frame(variant) is not None:
        return build_tiny_i2v_pipeline(folder, seed, variant)
    ti2v = variant == "wan2.2-ti2v-tiny"
    folder = Path(folder)
    torch.manual_seed(seed)
    transformer = FAMILY.transformer_class().from_config(FAMILY.load_config(variant))
    randomize_zero_inits(transformer, seed)
    tokenizer, vocab = tiny_umt5_tokenizer()
    text_encoder = tiny_umt5(vocab, transformer.config.text_dim, seed)
    # The hub's scheduler (diffusers convert_wan_to_diffusers.py): UniPC over flow sigmas.
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000,
                                        flow_shift=FLOW_SHIFT_TI2V if ti2v else FLOW_SHIFT_T2V)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer,
                       vae=tiny_wan_vae(ti2v), scheduler=scheduler, expand_timesteps=ti2v)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def tiny_clip_vision(hidden: int, seed: int):
    """A tiny ``CLIPVisionModel`` (Wan 2.1 I2V's image encoder class) at 56 px with 14 px patches: 17 tokens (the
    real ViT-H/14 at 224 px gives 257) of width ``hidden`` (the transformer's ``image_dim``), and its processor with
    CLIP's released settings at that size (shortest side, center crop, OpenAI CLIP mean / std)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    config = CLIPVisionConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=3,
                              num_attention_heads=2, image_size=56, patch_size=14, hidden_act="gelu")
    processor = CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    return CLIPVisionModel(config).eval(), processor


def build_tiny_i2v_pipeline(folder: str | Path, seed: int = 0, variant: str = "wan-i2v-tiny") -> Path:
    """A complete tiny ``WanImageToVideoPipeline`` folder: Wan 2.1 I2V's layout (``wan-i2v-tiny``: a tiny CLIP image
    encoder and processor) or Wan 2.2 I2V's (``wan2.2-i2v-tiny``: none, ``boundary_ratio`` 0.9)."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline

    from . import FAMILY
    from .family import FLOW_SHIFT_T2V, I2V_BOUNDARY

    folder = Path(folder)
    torch.manual_seed(seed)
    config = FAMILY.load_config(variant)
    transformer = FAMILY.transformer_class().from_config(config)
    randomize_zero_inits(transformer, seed)
    tokenizer, vocab = tiny_umt5_tokenizer()
    clip = config.get("image_dim") is not None
    encoder, processor = tiny_clip_vision(config["image_dim"], seed) if clip else (None, None)
    # The hub's I2V schedulers (convert_wan_to_diffusers.py): UniPC, flow_shift 3.0 for every I2V model.
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=FLOW_SHIFT_T2V)
    pipe = WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=tiny_umt5(vocab, config["text_dim"], seed),
                                   vae=tiny_wan_vae(), scheduler=scheduler, image_processor=processor,
                                   image_encoder=encoder, transformer=transformer,
                                   boundary_ratio=None if clip else I2V_BOUNDARY)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def write_clip_vision_file(pipeline_folder: str | Path, out_file: str | Path) -> Path:
    """The pipeline's image encoder as ComfyUI keeps ``clip_vision_h.safetensors`` (HF ``vision_model.*`` names and a
    ``visual_projection`` the Wan states do not use), with a companion folder holding the tiny config and processor
    settings (the real file uses the shipped ViT-H ones)."""
    pipeline_folder, out_file = Path(pipeline_folder), Path(out_file)
    state = {"vision_model." + k: v for k, v in folder_state(pipeline_folder / "image_encoder").items()}
    width = state["vision_model.post_layernorm.weight"].shape[0]
    state["visual_projection.weight"] = torch.randn(width, width)
    path = save_tensors(state, out_file)
    companion = path.with_suffix("")
    companion.mkdir(exist_ok=True)
    shutil.copy(pipeline_folder / "image_encoder" / "config.json", companion / "config.json")
    shutil.copy(pipeline_folder / "image_processor" / "preprocessor_config.json",
                companion / "preprocessor_config.json")
    return path


def write_single_file(pipeline_folder: str | Path, out_file: str | Path, dtype: torch.dtype | None = None,
                      prefix: str = "") -> Path:
    """The pipeline's transformer as one file with the original Wan names, as ComfyUI keeps
    ``wan2.1_t2v_1.3B_bf16.safetensors`` in ``models/diffusion_models/``; ``prefix`` = ``"model.diffusion_model."``
    writes the full-checkpoint form."""
    from . import FAMILY

    _, native = native_state(FAMILY, pipeline_folder)
    return save_tensors({prefix + k: v.to(dtype) if dtype else v for k, v in native.items()}, out_file)


_RESNET = (("norm1.gamma", "residual.0.gamma"), ("conv1.", "residual.2."), ("norm2.gamma", "residual.3.gamma"),
           ("conv2.", "residual.6."), ("conv_shortcut.", "shortcut."))


def wan22_vae_original_key(key: str, num_res_blocks: int = 2) -> str:
    """diffusers Wan 2.2 VAE name -> the original one (``wan2.2_vae.safetensors``): the inverse of
    ``vae.wan22_vae_diffusers_key`` inside the down/up blocks (resnets nested one level deeper, the resampler after
    them), ``tiny.wan_vae_original_key`` elsewhere. For writing test files in the layout users have."""
    m = re.fullmatch(r"(encoder\.down_blocks|decoder\.up_blocks)\.(\d+)\.(resnets\.(\d+)|downsampler|upsampler)\.(.*)",
                     key)
    if m is None:
        return wan_vae_original_key(key)
    enc = m[1].startswith("encoder")
    outer, inner = ("encoder.downsamples", "downsamples") if enc else ("decoder.upsamples", "upsamples")
    if m[4] is None:  # the resampler follows the resnets (one more in the decoder)
        return f"{outer}.{m[2]}.{inner}.{num_res_blocks + (0 if enc else 1)}.{m[5]}"
    rest = m[5]
    for a, b in _RESNET:
        if rest.startswith(a):
            rest = b + rest[len(a):]
            break
    return f"{outer}.{m[2]}.{inner}.{m[4]}.{rest}"


def write_text_and_vae_files(pipeline_folder: str | Path, folder: str | Path) -> dict[str, Path]:
    """The tiny umT5 as ``umt5_xxl_fp16.safetensors`` (T5 names: ``shared``, ``encoder.block.N``) with a companion
    folder (config, tokenizer), and the VAE with the original Wan names: ``wan_2.1_vae.safetensors``, or
    ``wan2.2_vae.safetensors`` for the TI2V layout."""
    pipeline_folder, folder = Path(pipeline_folder), Path(folder)
    state = {k: v for k, v in folder_state(pipeline_folder / "text_encoder").items()
             if k != "encoder.embed_tokens.weight"}  # tied to shared.weight; ComfyUI's file has shared only
    text_file = save_tensors(state, folder / "umt5_xxl_fp16.safetensors")
    companion = folder / "umt5_xxl_fp16"
    shutil.copytree(pipeline_folder / "tokenizer", companion, dirs_exist_ok=True)
    shutil.copy(pipeline_folder / "text_encoder" / "config.json", companion / "config.json")
    config = json.loads((pipeline_folder / "vae" / "config.json").read_text())
    if config["z_dim"] != 48:
        out = {"text_encoder": text_file, "vae": write_wan_vae_file(pipeline_folder / "vae",
                                                                    folder / "wan_2.1_vae.safetensors")}
        if (pipeline_folder / "image_encoder").is_dir():  # Wan 2.1 I2V: ComfyUI's clip_vision_h.safetensors
            out["image_encoder"] = write_clip_vision_file(pipeline_folder, folder / "clip_vision_h.safetensors")
        return out
    vae = save_tensors({wan22_vae_original_key(k, config["num_res_blocks"]): v
                        for k, v in folder_state(pipeline_folder / "vae").items()}, folder / "wan2.2_vae.safetensors")
    vae.with_suffix("").mkdir(exist_ok=True)
    shutil.copy(pipeline_folder / "vae" / "config.json", vae.with_suffix("") / "config.json")
    return {"text_encoder": text_file, "vae": vae}


def comfyui_model(config: dict) -> tuple[str, dict]:
    """What ComfyUI builds for a Wan transformer of this diffusers ``config``: ``comfy.model_base.WAN21`` (``WAN22``
    for the 48-channel TI2V-5B) and the ``unet_config`` its detection derives from the file (``model_detection``:
    ``model_type`` "i2v" where the file has Wan 2.1 I2V's ``img_emb``;
    ``dim`` from ``head.modulation``, ``out_dim`` from ``head.head``, ``ffn_dim``, the block count, ``in_dim`` from
    ``patch_embedding``). Its LoRA key map reads none of it: it maps the native names generically."""
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    return ("WAN22" if config["out_channels"] == 48 else "WAN21"), {
        "image_model": "wan2.1", "model_type": "i2v" if config.get("image_dim") else "t2v", "dim": dim, "out_dim": config["out_channels"],
        "ffn_dim": config["ffn_dim"], "num_layers": config["num_layers"], "in_dim": config["in_channels"]}
