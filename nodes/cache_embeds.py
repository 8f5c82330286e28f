"""Cache Text Embeds: encode captions and images once, into an on-disk cache."""
from __future__ import annotations

import os

from .load_model import CATEGORY
from .paths import (TEXT_ENCODER_FOLDERS, VAE_FOLDERS, cache_dir, comfy_tokenizer_dirs, list_diffusers_folders,
                    list_files, resolve_choice, resolve_dataset_path, resolve_file)

FROM_CHECKPOINT = "(from checkpoint)"
SINGLE_FILES = "(single files below)"
NONE = "(none)"


class LowVRAMCacheTextEmbeds:
    DESCRIPTION = (
        "Encodes every caption with the text encoders and every image with the VAE, once, into a cache on disk. "
        "Text encoders run layer by layer on the GPU, so they never need to fit it whole. Reruns reuse the cache; "
        "a changed caption, image or setting re-encodes only what changed."
    )
    CATEGORY = CATEGORY
    RETURN_TYPES = ("LOWVRAM_DATASET",)
    RETURN_NAMES = ("dataset",)
    OUTPUT_TOOLTIPS = ("A handle to the cached text embeddings and latents.",)
    FUNCTION = "cache"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("LOWVRAM_MODEL", {"tooltip": "The base model from Load Quantized Slab."}),
                "text_encoders": ([FROM_CHECKPOINT, SINGLE_FILES] + list_diffusers_folders(), {
                    "default": FROM_CHECKPOINT,
                    "tooltip": "Diffusers pipeline folder (models/diffusers) whose text encoders, tokenizers and "
                               "VAE are used. Flux.1: text_encoder (CLIP-L), text_encoder_2 (T5-XXL), tokenizer, "
                               "tokenizer_2, vae. Flux.2-dev: text_encoder (Mistral-Small 3.x 24B; only layers 0-29 "
                               "are ever read), tokenizer, vae (AutoencoderKLFlux2). Flux.2 klein: text_encoder "
                               "(Qwen3 4B/8B), tokenizer, vae. '(from checkpoint)' works when the checkpoint is "
                               "itself a pipeline folder. '(single files below)' uses the text_encoder_1/2 and "
                               "vae_file inputs instead (Flux.1: clip_l, t5xxl, ae.safetensors; Flux.2: the "
                               "Mistral or Qwen3 file and the Flux.2 VAE).",
                }),
                "dataset_path": ("STRING", {
                    "default": "",
                    "tooltip": "Folder of images (png/jpg/webp) with same-name .txt captions. Relative paths are "
                               "looked up from the working directory, then ComfyUI's input folder.",
                }),
                "resolution": ("INT", {
                    "default": 1024, "min": 64, "max": 4096, "step": 64,
                    "tooltip": "Training resolution. Images go to aspect-ratio buckets of about this many pixels "
                               "squared. 1024 is Flux's native size; 512 trains ~3x faster.",
                }),
                "trigger_word": ("STRING", {
                    "default": "",
                    "tooltip": "Prepended to every caption, e.g. 'ohwx'. Use it in prompts to call the LoRA.",
                }),
                "default_caption": ("STRING", {
                    "default": "",
                    "tooltip": "Caption for images without a .txt file. Empty: such images are an error listing them.",
                }),
                "repeats": ("INT", {
                    "default": 1, "min": 1, "max": 1000,
                    "tooltip": "How often each image appears per epoch; balances several datasets.",
                }),
                "flip": ("BOOLEAN", {
                    "default": False,
                    "tooltip": "Also cache mirrored images and use one at random. Off for text, logos, faces with "
                               "asymmetric features.",
                }),
                "max_sequence_length": ("INT", {
                    "default": 0, "min": 0, "max": 512,
                    "tooltip": "Text tokens kept per caption (T5 for Flux.1, the LLM for Flux.2). 0 = the model's "
                               "default (512 for Flux.1-dev and Flux.2). Shorter is faster if captions are short.",
                }),
                # Last: UI-format workflows store widget values by position.
                "text_encoder_1": ([NONE] + list_files(TEXT_ENCODER_FOLDERS), {
                    "default": NONE,
                    "tooltip": "With text_encoders '(single files below)'. Flux.1: clip_l.safetensors or "
                               "t5xxl_fp16.safetensors (fp8 / scaled fp8 too) from models/text_encoders; the two "
                               "inputs may be in either order; tokenizers: inside ComfyUI its bundled ones, else a "
                               "folder named like the file (without .safetensors) beside it. Flux.2: the Mistral "
                               "(dev, mistral_3_small_flux2_bf16.safetensors: its embedded tokenizer is used) or "
                               "Qwen3 (klein: tokenizer files in that folder beside it) file here, and "
                               "text_encoder_2 '(none)'.",
                }),
                "text_encoder_2": ([NONE] + list_files(TEXT_ENCODER_FOLDERS), {
                    "default": NONE, "tooltip": "The other Flux.1 text encoder file (see text_encoder_1).",
                }),
                "vae_file": ([NONE] + list_files(VAE_FOLDERS), {
                    "default": NONE,
                    "tooltip": "With text_encoders '(single files below)': the VAE file from models/vae "
                               "(Flux.1 ae.safetensors, or the Flux.2 VAE; BFL names).",
                }),
                "sample_prompts": ("STRING", {
                    "default": "", "multiline": True,
                    "tooltip": "Prompts for sample images while training, one per line (empty: none). Encoded "
                               "here once with the captions; Train LoRA's sample_every turns sampling on. Include "
                               "the trigger word where you want the LoRA's subject.",
                }),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @classmethod
    def IS_CHANGED(cls, dataset_path="", **_):
        # Rerun when files in the dataset folder change; the cache then re-encodes only those.
        try:
            folder = resolve_dataset_path(dataset_path)
            return ";".join(f"{e.name}:{e.stat().st_size}:{e.stat().st_mtime_ns}"
                            for e in sorted(os.scandir(folder), key=lambda e: e.name))
        except OSError:
            return dataset_path

    def cache(self, model, text_encoders: str, dataset_path: str, resolution: int = 1024, trigger_word: str = "",
              default_caption: str = "", repeats: int = 1, flip: bool = False, max_sequence_length: int = 0,
              text_encoder_1: str = NONE, text_encoder_2: str = NONE, vae_file: str = NONE, sample_prompts: str = "",
              unique_id=None):
        from dataclasses import replace

        from ..engine.caching import build_dataset_cache
        from ..engine.config import DataConfig
        from .progress import free_comfy_vram, make_callback

        free_comfy_vram()
        model_cfg = model.config
        if text_encoders == SINGLE_FILES:
            files = tuple(str(resolve_file(f, TEXT_ENCODER_FOLDERS)) for f in (text_encoder_1, text_encoder_2)
                          if f != NONE)
            vae = str(resolve_file(vae_file, VAE_FOLDERS)) if vae_file != NONE else ""
            model_cfg = replace(model_cfg, text_encoder_files=files, vae_file=vae, tokenizer_dirs=comfy_tokenizer_dirs())
        elif text_encoders != FROM_CHECKPOINT:
            model_cfg = replace(model_cfg, pipeline_path=str(resolve_choice(text_encoders)))
        data = DataConfig(path=str(resolve_dataset_path(dataset_path)) if dataset_path else "", resolution=resolution,
                          trigger_word=trigger_word.strip(), default_caption=default_caption.strip() or None,
                          repeats=repeats, flip=flip)
        dataset = build_dataset_cache(model_cfg, data, cache_dir(), max_sequence_length=max_sequence_length,
                                      callback=make_callback(unique_id), sample_prompts=sample_prompts.splitlines())
        return (dataset,)
