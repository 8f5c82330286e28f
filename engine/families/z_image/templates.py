"""Z-Image's shipped workflow (``host/templates.py`` writes it to ``example_workflows/`` in UI and API form)."""
from ..specs import TrainingTemplate
from . import FAMILY

_PREVIEW = FAMILY.guidance("z-image-turbo")  # the template's file is Turbo: no CFG
_TURBO = "https://huggingface.co/Comfy-Org/z_image_turbo/resolve/main/split_files/"

TEMPLATES = [
    TrainingTemplate(
        name="z_image_lora",
        variant="z-image-turbo",
        load={"checkpoint": "z_image_turbo_bf16.safetensors", "family": "z_image", "precision": "int8 slab"},
        cache={"text_encoders": "(single files below)", "dataset_path": "my_subject", "resolution": 1024,
               "text_encoder_1": "qwen_3_4b.safetensors", "vae_file": "ae.safetensors",
               "sample_prompts": "ohwx, a photo of a dog on a beach"},
        offload={"mode": "auto", "vram_budget_gb": 4.0},
        train={"steps": 1500, "learning_rate": 1e-4, "rank": 16, "alpha": 16.0, "warmup_steps": 0,
               "training_seed": 42, "sample_every": 250, "sample_steps": _PREVIEW.steps, "sample_resolution": 512},
        save={"filename_prefix": "loras/z_image_lora"},
        downloads={  # as in ComfyUI's image_z_image_turbo template
            "z_image_turbo_bf16.safetensors": _TURBO + "diffusion_models/z_image_turbo_bf16.safetensors",
            "qwen_3_4b.safetensors": _TURBO + "text_encoders/qwen_3_4b.safetensors",
            "ae.safetensors": _TURBO + "vae/ae.safetensors",
        },
        note=(
            "Z-Image (6B) LoRA at 1024x1024 on a 4 GB VRAM budget.\n\nFiles (what ComfyUI users have):\n"
            "- models/diffusion_models/z_image_turbo_bf16.safetensors (or the Base model, z_image_bf16.safetensors: "
            "trainers recommend Base for LoRAs; both have the same shapes). precision 'int8 slab' builds a 6 GB "
            "int8 slab once into models/slabs.\n"
            "- models/text_encoders/qwen_3_4b.safetensors with Qwen3's tokenizer files in models/text_encoders/"
            "qwen_3_4b/ (tokenizer.json or vocab.json + merges.txt, tokenizer_config.json with its chat template), "
            "and models/vae/ae.safetensors (the Flux.1 VAE). Or set text_encoders to a diffusers folder "
            "(models/diffusers/Z-Image-Turbo).\n"
            "- input/my_subject/: your images with same-name .txt captions.\n\n"
            "Samples: Turbo is distilled, so previews use 8 steps without CFG. The LoRA (ComfyUI format: "
            "transformer.* diffusers names) loads with ComfyUI's LoraLoader."),
    ),
]
