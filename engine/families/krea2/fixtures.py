"""Tiny Krea 2 models for tests and the demo, built offline from configs (nothing is downloaded).

``build_tiny_pipeline``: a diffusers ``Krea2Pipeline`` folder (the tiny transformer, a tiny ``Qwen3VLModel`` with
Qwen-Image's tiny word-level tokenizer, Qwen-Image's tiny VAE, the Raw scheduler config) whose pipeline taps the tiny
encoder's three layers. ``write_single_file``: the transformer under the native names (``names.py``).
``write_text_and_vae_files``: the text encoder as ComfyUI's ``qwen3vl_4b_bf16.safetensors`` keeps it
(``model.language_model.``, ``model.visual.``) with a companion folder (config, tokenizer), and the VAE as
``qwen_image_vae.safetensors``.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..qwen_image.fixtures import tiny_qwen25_tokenizer, tiny_qwen_image_vae
from ..tiny import folder_state, native_state, save_tensors, tiny_transformer, write_wan_vae_file

_TEXT_LAYERS = 4  # one more than the last tap: hidden_states[-1] is normed, the real taps (<= 35 of 36) are raw


def tiny_qwen3_vl(vocab: int, hidden: int, seed: int):
    """A tiny ``Qwen3VLModel`` (Krea2Pipeline's text encoder class) with a tiny vision tower, interleaved mRoPE."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    torch.manual_seed(seed)
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=_TEXT_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=hidden // 4, max_position_embeddings=1024, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 1, 1],
                                          "mrope_interleaved": True},
                         pad_token_id=0, tie_word_embeddings=False),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0]),
        image_token_id=6, video_token_id=7, vision_start_token_id=4, vision_end_token_id=5,
        tie_word_embeddings=False)
    return Qwen3VLModel(config).eval()


def tiny_scheduler():
    """The Raw pipeline's scheduler: the resolution-aware exponential shift (Krea2Pipeline's docstring)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from .family import BASE_SEQ, BASE_SHIFT, MAX_SEQ, MAX_SHIFT

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True,
                                           base_image_seq_len=BASE_SEQ, max_image_seq_len=MAX_SEQ,
                                           base_shift=BASE_SHIFT, max_shift=MAX_SHIFT, time_shift_type="exponential")


def build_tiny_pipeline(folder: str | Path, seed: int = 0) -> Path:
    """Write a complete tiny ``Krea2Pipeline`` folder, loadable with ``Krea2Pipeline.from_pretrained``."""
    from diffusers import Krea2Pipeline

    from . import FAMILY
    from .family import TINY_TAPS

    folder = Path(folder)
    transformer = tiny_transformer(FAMILY, seed)
    tokenizer, vocab = tiny_qwen25_tokenizer()
    text_encoder = tiny_qwen3_vl(vocab, transformer.config.text_hidden_dim, seed)
    pipe = Krea2Pipeline(scheduler=tiny_scheduler(), vae=tiny_qwen_image_vae(), text_encoder=text_encoder,
                         tokenizer=tokenizer, transformer=transformer, text_encoder_select_layers=TINY_TAPS)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def write_single_file(pipeline_folder: str | Path, out_file: str | Path, dtype: torch.dtype | None = None,
                      prefix: str = "") -> Path:
    """The pipeline's transformer as one file with the native names (``krea2_raw_bf16.safetensors``);
    ``prefix`` = ``"model.diffusion_model."`` writes the full-checkpoint form."""
    from . import FAMILY

    _, native = native_state(FAMILY, pipeline_folder)
    return save_tensors({prefix + k: v.to(dtype) if dtype else v for k, v in native.items()}, out_file)


def write_text_and_vae_files(pipeline_folder: str | Path, folder: str | Path) -> dict[str, Path]:
    """The tiny Qwen3-VL as ``qwen3vl_4b_bf16.safetensors`` in the layout ComfyUI detects (``model.language_model.``,
    ``model.visual.``: comfy/sd.py ``model.visual.deepstack_merger_list``) with a companion folder (config,
    tokenizer), and the VAE as ``qwen_image_vae.safetensors`` with the original Wan names."""
    import shutil

    pipeline_folder, folder = Path(pipeline_folder), Path(folder)
    state = {f"model.{k}": v for k, v in folder_state(pipeline_folder / "text_encoder").items()}
    text_file = save_tensors(state, folder / "qwen3vl_4b_bf16.safetensors")
    companion = folder / "qwen3vl_4b_bf16"
    shutil.copytree(pipeline_folder / "tokenizer", companion, dirs_exist_ok=True)
    shutil.copy(pipeline_folder / "text_encoder" / "config.json", companion / "config.json")
    vae = write_wan_vae_file(pipeline_folder / "vae", folder / "qwen_image_vae.safetensors")
    return {"text_encoder": text_file, "vae": vae}


def comfyui_model(config: dict) -> tuple[str, dict]:
    """What ComfyUI builds for a Krea 2 transformer of this diffusers ``config``: ``comfy.model_base.Krea2`` and the
    ``unet_config`` its detection derives from a native file (``model_detection``: ``features`` and ``channels`` from
    ``first``, ``layers`` by counting blocks, heads and KV heads from ``blocks.0.attn.wq/wk`` at head dim 128,
    ``txtlayers`` from the projector, ``txtdim`` from the first fusion norm). Its LoRA key map reads ``layers``."""
    heads = config["num_attention_heads"] * config["attention_head_dim"] // 128
    kvheads = config["num_key_value_heads"] * config["attention_head_dim"] // 128
    return "Krea2", {"image_model": "krea2", "features": config["num_attention_heads"] * config["attention_head_dim"],
                     "channels": config["in_channels"] // 4, "patch": 2, "layers": config["num_layers"],
                     "heads": heads, "kvheads": kvheads, "txtlayers": config["num_text_layers"],
                     "txtdim": config["text_hidden_dim"]}
