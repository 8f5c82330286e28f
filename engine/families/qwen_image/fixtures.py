"""Tiny Qwen-Image models for tests and the demo, built offline from configs (nothing is downloaded).

``build_tiny_pipeline``: a diffusers ``QwenImagePipeline`` folder (tiny transformer, a tiny
Qwen2.5-VL with a word-level tokenizer that knows Qwen's turn tokens, a tiny ``AutoencoderKLQwenImage`` with
the real level structure, the hub scheduler config). ``write_single_file``: the transformer as ComfyUI keeps it
(diffusers names). ``write_text_and_vae_files``: the text encoder and VAE as ComfyUI keeps them
(``qwen_2.5_vl_7b.safetensors`` with ``model.``/``visual.`` names, ``qwen_image_vae.safetensors`` with the
original Wan names), each with a companion folder holding the tiny config (and the tokenizer).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..tiny import add_tiny_controls  # noqa: F401  (the pairs layout, shared by every edit family)
from ..tiny import (folder_state, native_state, save_tensors, tiny_transformer, word_level_tokenizer,
                    write_wan_vae_file)

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "<|vision_start|>", "<|vision_end|>",
             "<|image_pad|>", "<|video_pad|>"]
_TEXT_LAYERS = 2


def tiny_qwen25_tokenizer(max_length: int = 1024):
    """A real fast tokenizer with Qwen2's turn tokens (matched whole), no BOS/EOS added (Qwen adds none), right
    padding with <|endoftext|>."""
    from tokenizers import processors

    tokenizer, vocab = word_level_tokenizer(_SPECIALS + ["user", "assistant", "system"], None, "<|im_end|>",
                                            "<|endoftext|>", "<unk>", max_length)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|vision_start|>",
                                                                "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]})
    tokenizer.padding_side = "right"
    return tokenizer, vocab


def tiny_qwen25_vl(vocab: int, hidden: int, seed: int):
    """A tiny ``Qwen2_5_VLForConditionalGeneration`` (the pipeline's text encoder class) with a tiny vision tower."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=_TEXT_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=1000000.0,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, pad_token_id=0,
                         bos_token_id=None, eos_token_id=2, tie_word_embeddings=False),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=28,
                           fullatt_block_indexes=[0]),
        image_token_id=6, vision_start_token_id=4, vision_end_token_id=5, video_token_id=7)
    model = Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():  # the final norm at 1 would hide whether it is applied
        model.model.language_model.norm.weight.uniform_(0.5, 1.5)
    return model.eval()


def tiny_qwen_image_vae():
    """A tiny AutoencoderKLQwenImage: the released level structure (4 levels, 2 residual blocks, the same
    temporal downsampling) at base width 8, and the real latents_mean / latents_std."""
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    return AutoencoderKLQwenImage(base_dim=8, z_dim=16)


def build_tiny_pipeline(folder: str | Path, seed: int = 0) -> Path:
    """Write a complete tiny ``QwenImagePipeline`` folder, loadable with ``QwenImagePipeline.from_pretrained``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    from . import FAMILY
    from .family import BASE_SEQ, BASE_SHIFT, MAX_SEQ, MAX_SHIFT, SHIFT_TERMINAL

    folder = Path(folder)
    transformer = tiny_transformer(FAMILY, seed)
    tokenizer, vocab = tiny_qwen25_tokenizer()
    text_encoder = tiny_qwen25_vl(vocab, transformer.config.joint_attention_dim, seed)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_image_seq_len=BASE_SEQ,
        max_image_seq_len=MAX_SEQ, base_shift=BASE_SHIFT, max_shift=MAX_SHIFT, shift_terminal=SHIFT_TERMINAL,
        time_shift_type="exponential")
    pipe = QwenImagePipeline(scheduler=scheduler, vae=tiny_qwen_image_vae(), text_encoder=text_encoder,
                             tokenizer=tokenizer, transformer=transformer)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def write_single_file(pipeline_folder: str | Path, out_file: str | Path, dtype: torch.dtype | None = None,
                      prefix: str = "") -> Path:
    """The pipeline's transformer as one file, as ``qwen_image_bf16.safetensors`` is kept in
    ``models/diffusion_models/`` (diffusers names); ``prefix`` = ``"model.diffusion_model."`` writes the
    full-checkpoint form."""
    from . import FAMILY

    _, native = native_state(FAMILY, pipeline_folder)
    return save_tensors({prefix + k: v.to(dtype) if dtype else v for k, v in native.items()}, out_file)


def write_text_and_vae_files(pipeline_folder: str | Path, folder: str | Path) -> dict[str, Path]:
    """The tiny Qwen2.5-VL as ``qwen_2.5_vl_7b.safetensors`` in ComfyUI's layout (``model.layers.N``,
    ``model.embed_tokens``, ``model.norm``, ``visual.``, ``lm_head``) with a companion folder (config, tokenizer),
    and the VAE as ``qwen_image_vae.safetensors`` with the original Wan names."""
    import shutil

    pipeline_folder, folder = Path(pipeline_folder), Path(folder)
    state = {}
    for k, v in folder_state(pipeline_folder / "text_encoder").items():
        k = k.replace("model.language_model.", "model.", 1) if k.startswith("model.language_model.") else k
        state[k.replace("model.visual.", "visual.", 1) if k.startswith("model.visual.") else k] = v
    text_file = save_tensors(state, folder / "qwen_2.5_vl_7b.safetensors")
    companion = folder / "qwen_2.5_vl_7b"
    shutil.copytree(pipeline_folder / "tokenizer", companion, dirs_exist_ok=True)
    shutil.copy(pipeline_folder / "text_encoder" / "config.json", companion / "config.json")
    vae = write_wan_vae_file(pipeline_folder / "vae", folder / "qwen_image_vae.safetensors")
    return {"text_encoder": text_file, "vae": vae}


def comfyui_model(config: dict) -> tuple[str, dict]:
    """What ComfyUI builds for a Qwen-Image transformer of this diffusers ``config``: ``comfy.model_base.QwenImage``
    and the ``unet_config`` its detection derives from the file (``model_detection``: ``in_channels`` from
    ``img_in``, ``num_layers`` by counting blocks). Its LoRA key map reads none of it."""
    return "QwenImage", {"image_model": "qwen_image", "in_channels": config["in_channels"],
                         "num_layers": config["num_layers"]}


def tiny_qwen2vl_processor(tokenizer):
    """A ``Qwen2VLProcessor`` (the Edit pipelines' ``processor``) over the tiny tokenizer and a ``Qwen2VLImageProcessor``
    with Qwen2.5-VL's defaults (patch 14, merge 2). It holds no video processor: transformers builds that only with
    torchvision, and the Edit pipelines never pass videos."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor

    class _ImagesOnlyProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    return _ImagesOnlyProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer)


def tiny_edit_pipeline(mode: str = "plus", variant: str = "qwen-image-edit-tiny", seed: int = 0):
    """An in-memory tiny ``QwenImageEditPlusPipeline`` (``mode`` "plus") or ``QwenImageEditPipeline`` ("edit") whose
    transformer has ``variant``'s config (``qwen-image-edit-2511-tiny``: zero_cond_t); the template's drop count is
    set to what the tiny tokenizer makes of the Edit system turn (``edit_text.tiny_drop``)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline, QwenImageEditPlusPipeline

    from ..tiny import randomize_zero_inits
    from . import FAMILY
    from .edit_text import tiny_drop
    from .family import BASE_SEQ, BASE_SHIFT, MAX_SEQ, MAX_SHIFT, SHIFT_TERMINAL

    torch.manual_seed(seed)
    transformer = FAMILY.transformer_class().from_config(FAMILY.load_config(variant))
    randomize_zero_inits(transformer, seed)
    tokenizer, vocab = tiny_qwen25_tokenizer()
    text_encoder = tiny_qwen25_vl(vocab, transformer.config.joint_attention_dim, seed)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_image_seq_len=BASE_SEQ,
        max_image_seq_len=MAX_SEQ, base_shift=BASE_SHIFT, max_shift=MAX_SHIFT, shift_terminal=SHIFT_TERMINAL,
        time_shift_type="exponential")
    cls = QwenImageEditPlusPipeline if mode == "plus" else QwenImageEditPipeline
    pipe = cls(scheduler=scheduler, vae=tiny_qwen_image_vae(), text_encoder=text_encoder, tokenizer=tokenizer,
               processor=tiny_qwen2vl_processor(tokenizer), transformer=transformer)
    pipe.prompt_template_encode_start_idx = tiny_drop(tokenizer, mode)
    return pipe
