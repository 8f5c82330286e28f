"""Tiny FLUX.3 Image Klein models for tests and the demo, built offline from configs (nothing is downloaded).

``build_tiny_pipeline``: a pipeline folder as diffusers' modular ``Flux3ModularPipeline`` uses its components (the
tiny transformer, a tiny ``Qwen3VLForConditionalGeneration`` with a word-level tokenizer whose chat template renders
Qwen's turns, the Flux.2 VAE with its BatchNorm, the FLUX.3 scheduler: static shift 6.93); ``variant`` picks Base or the
flow map. ``write_single_file``: the transformer under BFL's native names (``names.py``).
``write_text_and_vae_files``: the text encoder as ComfyUI's ``qwen3vl_4b_bf16.safetensors`` keeps it
(``model.language_model.``, ``model.visual.``) with a companion folder (config, tokenizer), and the VAE as
``flux2-vae.safetensors`` (LDM names plus ``bn.*``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..tiny import folder_state, native_state, save_tensors, tiny_transformer, write_ldm_vae_file

#: What Qwen3-VL's chat template renders for one user turn with the generation prompt (the family's plain template).
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                      "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_text_encoder(vocab: int, hidden: int, seed: int):
    """A tiny ``Qwen3VLForConditionalGeneration`` (Flux3TextEncoderStep's class): Krea 2's tiny Qwen3-VL config."""
    from transformers import Qwen3VLForConditionalGeneration

    from ..krea2.fixtures import tiny_qwen3_vl

    config = tiny_qwen3_vl(vocab, hidden, seed).config
    torch.manual_seed(seed)
    return Qwen3VLForConditionalGeneration(config).eval()


def tiny_scheduler():
    """``Flux3SetTimestepsStep``'s scheduler: ``FlowMatchEulerDiscreteScheduler`` from ``{"shift": 6.93}``."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from .family import SHIFT

    return FlowMatchEulerDiscreteScheduler(shift=SHIFT)


def tiny_vae(latent_channels: int, seed: int):
    """A tiny AutoencoderKLFlux2 with BatchNorm statistics as a trained VAE has them (not 0 / 1)."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 16, 16, 16), layers_per_block=1, latent_channels=latent_channels,
                             norm_num_groups=4, sample_size=128, use_quant_conv=False, use_post_quant_conv=False)
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn(vae.bn.running_mean.shape) * 0.1)
        vae.bn.running_var.copy_(torch.rand(vae.bn.running_var.shape) + 0.5)
    return vae


def tiny_tokenizer():
    """Qwen-Image's tiny word-level tokenizer (Qwen's turn tokens matched whole) with a Qwen chat template."""
    from ..qwen_image.fixtures import tiny_qwen25_tokenizer

    tokenizer, vocab = tiny_qwen25_tokenizer()
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer, vocab


def build_tiny_pipeline(folder: str | Path, seed: int = 0, variant: str = "") -> Path:
    """Write a tiny FLUX.3 pipeline folder (the components of ``Flux3ModularPipeline``, each loadable with its class's
    ``from_pretrained``, and a ``model_index.json``); ``variant`` ``flux3-tiny-distilled`` writes the flow map."""
    from . import FAMILY

    folder = Path(folder)
    transformer = tiny_transformer(FAMILY, seed) if variant in ("", FAMILY.tiny_variant) else None
    if transformer is None:
        torch.manual_seed(seed)
        from ..tiny import randomize_zero_inits

        transformer = FAMILY.transformer_class().from_config(FAMILY.load_config(variant))
        randomize_zero_inits(transformer, seed)
    config = dict(transformer.config)
    tokenizer, vocab = tiny_tokenizer()
    text_encoder = tiny_text_encoder(vocab, config["joint_attention_dim"] // 3, seed)  # three taps
    parts = {"transformer": transformer, "vae": tiny_vae(config["in_channels"] // 4, seed),
             "text_encoder": text_encoder}
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in parts.items():
        part.save_pretrained(folder / name, safe_serialization=True)
    tokenizer.save_pretrained(folder / "tokenizer")
    tiny_scheduler().save_pretrained(folder / "scheduler")
    (folder / "model_index.json").write_text(json.dumps({
        "_class_name": "Flux3ModularPipeline", "_diffusers_version": "0.42.1",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": ["diffusers", "Flux3Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLFlux2"],
    }, indent=2))
    return folder


def write_single_file(pipeline_folder: str | Path, out_file: str | Path, dtype: torch.dtype | None = None,
                      prefix: str = "") -> Path:
    """The pipeline's transformer as one file with BFL's native names; ``prefix`` = ``"model.diffusion_model."``
    writes the full-checkpoint form."""
    from . import FAMILY

    _, native = native_state(FAMILY, pipeline_folder)
    return save_tensors({prefix + k: v.to(dtype) if dtype else v for k, v in native.items()}, out_file)


def write_text_and_vae_files(pipeline_folder: str | Path, folder: str | Path) -> dict[str, Path]:
    """The tiny Qwen3-VL as ``qwen3vl_4b_bf16.safetensors`` in the layout ComfyUI detects (``model.language_model.``,
    ``model.visual.``) with a companion folder (config, tokenizer), and the VAE as ``flux2-vae.safetensors``."""
    import shutil

    pipeline_folder, folder = Path(pipeline_folder), Path(folder)
    state = {k: v for k, v in folder_state(pipeline_folder / "text_encoder").items() if k.startswith("model.")}
    text_file = save_tensors(state, folder / "qwen3vl_4b_bf16.safetensors")
    companion = folder / "qwen3vl_4b_bf16"
    shutil.copytree(pipeline_folder / "tokenizer", companion, dirs_exist_ok=True)
    shutil.copy(pipeline_folder / "text_encoder" / "config.json", companion / "config.json")
    vae = write_ldm_vae_file(pipeline_folder / "vae", folder / "flux2-vae.safetensors")
    return {"text_encoder": text_file, "vae": vae}


def comfyui_model(config: dict) -> tuple[str, dict]:
    """The ``comfy.model_base`` class a ComfyUI with FLUX.3 would build and the ``unet_config`` keys its LoRA key map
    would read: not known (ComfyUI 0.33, the one at hand, has no FLUX.3; no later release was read). The class name
    is a guess that no ComfyUI here has, so ComfyUI's own LoRA-loader check skips FLUX.3 rather than pass on it."""
    return "Flux3", {"depth": config["num_layers"], "depth_single_blocks": config["num_single_layers"],
                     "hidden_size": config["num_attention_heads"] * config["attention_head_dim"]}
