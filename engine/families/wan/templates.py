"""Wan's shipped workflow (``host/templates.py`` writes it in UI and API form)."""
from ..base import TrainingTemplate
from . import FAMILY

_REPO = "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/"

_PREVIEW = FAMILY.guidance("wan2.1-t2v-1.3b")  # CFG 5, 20 steps

TEMPLATES = [
    TrainingTemplate(
        name="wan21_t2v_1_3b_lora",
        load={"checkpoint": "wan2.1_t2v_1.3B_fp16.safetensors", "family": "wan", "precision": "int8 slab"},
        cache={"text_encoders": "(single files below)", "dataset_path": "my_subject", "resolution": 512,
               "text_encoder_1": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "vae_file": "wan_2.1_vae.safetensors",
               "sample_prompts": "ohwx, a photo of a dog on a beach"},
        offload={"mode": "auto", "vram_budget_gb": 4.0},
        train={"steps": 1500, "learning_rate": 1e-4, "rank": 16, "alpha": 16.0, "warmup_steps": 0,
               "training_seed": 42, "sample_every": 250, "sample_steps": _PREVIEW.steps, "sample_resolution": 512,
               "sample_guidance": _PREVIEW.scale},
        save={"filename_prefix": "loras/wan21_t2v_1_3b_lora"},
        downloads={  # as in ComfyUI's own Wan 2.1 templates (comfyui-workflow-templates 0.11.44)
            "wan2.1_t2v_1.3B_fp16.safetensors": _REPO + "diffusion_models/wan2.1_t2v_1.3B_fp16.safetensors",
            "umt5_xxl_fp8_e4m3fn_scaled.safetensors": _REPO + "text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors",
            "wan_2.1_vae.safetensors": _REPO + "vae/wan_2.1_vae.safetensors",
        },
        note=(
            "Wan 2.1 T2V 1.3B LoRA trained on images (each a one-frame clip) at 512x512 on a 4 GB VRAM budget. "
            "Video clips come with the video dataset wiring (a later release); the LoRA already loads for video.\n\n"
            "Files (what ComfyUI's own Wan 2.1 template uses):\n"
            "- models/diffusion_models/wan2.1_t2v_1.3B_fp16.safetensors (or the _bf16 file). precision 'int8 slab' builds a "
            "1.5 GB slab once into models/slabs.\n"
            "- models/text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors (its embedded tokenizer is used) and "
            "models/vae/wan_2.1_vae.safetensors.\n"
            "- input/my_subject/: your images with same-name .txt captions.\n\n"
            "Captions are umT5-encoded to 512 tokens, zero-padded as WanPipeline does. Samples use CFG 5 against the "
            "empty prompt (two forwards per step) and show one frame. The LoRA (self- and cross-attention, Wan's own "
            "names: diffusion_model.blocks.N.self_attn.q) loads with ComfyUI's LoraLoaderModelOnly."),
    ),
]
