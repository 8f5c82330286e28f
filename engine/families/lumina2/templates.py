"""Lumina 2's shipped workflow (``host/templates.py`` writes it to ``example_workflows/`` in UI and API form)."""
from ..specs import TrainingTemplate
from . import FAMILY

_PREVIEW = FAMILY.guidance("lumina2")  # the pipeline's CFG scale, and steps enough for a preview

TEMPLATES = [
    TrainingTemplate(
        name="lumina2_lora",
        variant="lumina2",
        load={"checkpoint": "lumina_2_model_bf16.safetensors", "family": "lumina2", "precision": "bf16"},
        cache={"text_encoders": "(single files below)", "dataset_path": "my_subject", "resolution": 1024,
               "text_encoder_1": "gemma_2_2b_fp16.safetensors", "vae_file": "ae.safetensors",
               "sample_prompts": "ohwx, a photo of a dog on a beach"},
        offload={"mode": "auto", "vram_budget_gb": 2.0},
        train={"steps": 1500, "learning_rate": 1e-4, "rank": 16, "alpha": 16.0, "warmup_steps": 0,
               "training_seed": 42, "sample_every": 250, "sample_steps": _PREVIEW.steps, "sample_resolution": 512,
               "sample_guidance": _PREVIEW.scale},
        save={"filename_prefix": "loras/lumina2_lora"},
        # ComfyUI's own templates ship Lumina 2 only as the all-in-one checkpoint: no URL of theirs names the
        # transformer or Gemma file, so only the VAE (as in ComfyUI's Flux.1 templates) is offered.
        downloads={"ae.safetensors": "https://huggingface.co/Comfy-Org/Lumina_Image_2.0_Repackaged/resolve/main/"
                                     "split_files/vae/ae.safetensors"},
        note=(
            "Lumina-Image-2.0 (2.6B) LoRA at 1024x1024 on a 2 GB VRAM budget.\n\nFiles:\n"
            "- models/diffusion_models/lumina_2_model_bf16.safetensors (the transformer alone; ComfyUI's all-in-one "
            "checkpoints/lumina_2.safetensors is not read).\n"
            "- models/text_encoders/gemma_2_2b_fp16.safetensors (its embedded tokenizer is used) and "
            "models/vae/ae.safetensors (the Flux.1 VAE). Or set "
            "text_encoders to a diffusers folder (models/diffusers/Lumina-Image-2.0).\n"
            "- input/my_subject/: your images with same-name .txt captions.\n\n"
            "Captions are encoded after Lumina's system prompt, as its pipeline does. Samples use CFG 4 against the "
            "empty prompt. The LoRA (ComfyUI format: diffusion_model.* names on the fused qkv, which is the only "
            "form ComfyUI maps for Lumina 2) loads with ComfyUI's LoraLoader."),
    ),
]
