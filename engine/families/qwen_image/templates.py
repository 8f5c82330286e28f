"""Qwen-Image's shipped workflow (``host/templates.py`` writes it in UI and API form)."""
from ..base import TrainingTemplate
from . import FAMILY

_PREVIEW = FAMILY.guidance("qwen-image")  # true CFG 4, 20 steps
_REPO = "https://huggingface.co/Comfy-Org/Qwen-Image_ComfyUI/resolve/main/split_files/"

TEMPLATES = [
    TrainingTemplate(
        name="qwen_image_lora",
        load={"checkpoint": "qwen_image_fp8_e4m3fn.safetensors", "family": "qwen_image", "precision": "int8 slab"},
        cache={"text_encoders": "(single files below)", "dataset_path": "my_subject", "resolution": 1024,
               "text_encoder_1": "qwen_2.5_vl_7b_fp8_scaled.safetensors", "vae_file": "qwen_image_vae.safetensors",
               "sample_prompts": "ohwx, a photo of a dog on a beach"},
        offload={"mode": "auto", "vram_budget_gb": 6.0},
        train={"steps": 1500, "learning_rate": 1e-4, "rank": 16, "alpha": 16.0, "warmup_steps": 0,
               "training_seed": 42, "sample_every": 250, "sample_steps": _PREVIEW.steps, "sample_resolution": 512,
               "sample_guidance": _PREVIEW.scale},
        save={"filename_prefix": "loras/qwen_image_lora"},
        downloads={  # as in ComfyUI's own Qwen-Image templates (comfyui-workflow-templates 0.11.44)
            "qwen_image_fp8_e4m3fn.safetensors": _REPO + "diffusion_models/qwen_image_fp8_e4m3fn.safetensors",
            "qwen_2.5_vl_7b_fp8_scaled.safetensors": _REPO + "text_encoders/qwen_2.5_vl_7b_fp8_scaled.safetensors",
            "qwen_image_vae.safetensors": _REPO + "vae/qwen_image_vae.safetensors",
        },
        note=(
            "Qwen-Image (20B) LoRA at 1024x1024 on a 6 GB VRAM budget (4 GB works, a little slower).\n\nFiles "
            "(what ComfyUI's own Qwen-Image template uses):\n"
            "- models/diffusion_models/qwen_image_fp8_e4m3fn.safetensors (or qwen_image_bf16.safetensors, or the 2512 "
            "release). precision 'int8 slab' builds a 20 GB int8 slab once into models/slabs; 64 GB of RAM helps.\n"
            "- models/text_encoders/qwen_2.5_vl_7b_fp8_scaled.safetensors (its tokenizer is the one ComfyUI bundles; "
            "outside ComfyUI put Qwen2.5's vocab.json, merges.txt, tokenizer_config.json in "
            "models/text_encoders/qwen_2.5_vl_7b_fp8_scaled/), and models/vae/qwen_image_vae.safetensors.\n"
            "- input/my_subject/: your images with same-name .txt captions.\n\n"
            "Captions are encoded after Qwen-Image's system prompt, as its pipeline does. Samples use true CFG 4 "
            "against the empty prompt (two forwards per step). The LoRA (attention of both streams, diffusers names) "
            "loads with ComfyUI's LoraLoader. Qwen-Image-Edit files are not supported yet."),
    ),
]
