"""Krea 2's shipped workflow (``host/templates.py`` writes it to ``example_workflows/`` in UI and API form)."""
from ..specs import TrainingTemplate
from . import FAMILY

_PREVIEW = FAMILY.guidance("krea2-raw")  # the template trains Raw: Krea's CFG 4.5, 28 steps
#: Comfy-Org's repack (ComfyUI's own image_krea2_turbo_t2i template, comfyui-workflow-templates 0.11.44, links its
#: Turbo file, text encoder and VAE here; the Raw files sit beside Turbo's in diffusion_models/).
_REPO = "https://huggingface.co/Comfy-Org/Krea-2/resolve/main/"

TEMPLATES = [
    TrainingTemplate(
        name="krea2_lora",
        variant="krea2-raw",
        load={"checkpoint": "krea2_raw_fp8_scaled.safetensors", "family": "krea2", "precision": "int8 slab"},
        cache={"text_encoders": "(single files below)", "dataset_path": "my_subject", "resolution": 1024,
               "text_encoder_1": "qwen3vl_4b_fp8_scaled.safetensors", "vae_file": "qwen_image_vae.safetensors",
               "sample_prompts": "ohwx, a photo of a dog on a beach"},
        offload={"mode": "auto", "vram_budget_gb": 4.0},
        # rank / alpha 32, lr 1e-4: musubi-tuner's Krea 2 recipe ("the model authors' recommended default").
        train={"steps": 1500, "learning_rate": 1e-4, "rank": 32, "alpha": 32.0, "warmup_steps": 0,
               "training_seed": 42, "sample_every": 250, "sample_steps": _PREVIEW.steps, "sample_resolution": 512,
               "sample_guidance": _PREVIEW.scale},
        save={"filename_prefix": "loras/krea2_lora"},
        downloads={
            "krea2_raw_fp8_scaled.safetensors": _REPO + "diffusion_models/krea2_raw_fp8_scaled.safetensors",
            "qwen3vl_4b_fp8_scaled.safetensors": _REPO + "text_encoders/qwen3vl_4b_fp8_scaled.safetensors",
            "qwen_image_vae.safetensors": _REPO + "vae/qwen_image_vae.safetensors",
        },
        note=(
            "Krea 2 (12.8B) LoRA at 1024x1024 on a 4 GB VRAM budget.\n\nFiles (Comfy-Org's Krea 2 repack):\n"
            "- models/diffusion_models/krea2_raw_fp8_scaled.safetensors (or krea2_raw_bf16.safetensors). Train on "
            "Raw and apply the LoRA on Turbo, as Krea's model card says; a Turbo file also loads (previews then use "
            "8 steps without CFG). int8_convrot files cannot be read: use bf16 or fp8_scaled. precision 'int8 slab' "
            "builds a 13 GB int8 slab once into models/slabs.\n"
            "- models/text_encoders/qwen3vl_4b_fp8_scaled.safetensors (or _bf16; its tokenizer is the Qwen one "
            "ComfyUI bundles; outside ComfyUI put Qwen's vocab.json, merges.txt, tokenizer_config.json in "
            "models/text_encoders/qwen3vl_4b_fp8_scaled/), and models/vae/qwen_image_vae.safetensors.\n"
            "- input/my_subject/: your images with same-name .txt captions.\n\n"
            "Captions are encoded after Qwen-Image's system prompt into Qwen3-VL's twelve tapped layers, as "
            "Krea2Pipeline does. Samples use Krea's CFG 4.5 against the empty prompt, 28 steps (two forwards per "
            "step). The LoRA (attention + gate of every block, diffusers names) loads with ComfyUI's LoraLoader on "
            "Raw or Turbo."),
    ),
]
