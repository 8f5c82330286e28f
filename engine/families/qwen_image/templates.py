"""Qwen-Image's shipped workflow (``host/templates.py`` writes it in UI and API form)."""
from ..specs import TrainingTemplate
from . import FAMILY

_PREVIEW = FAMILY.guidance("qwen-image")  # true CFG 4, 20 steps
_REPO = "https://huggingface.co/Comfy-Org/Qwen-Image_ComfyUI/resolve/main/split_files/"
_EDIT_REPO = "https://huggingface.co/Comfy-Org/Qwen-Image-Edit_ComfyUI/resolve/main/split_files/"

TEMPLATES = [
    TrainingTemplate(
        name="qwen_image_lora",
        variant="qwen-image",
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
            "loads with ComfyUI's LoraLoader. For Qwen-Image-Edit LoRAs use the qwen_image_edit_lora template."),
    ),
    TrainingTemplate(
        name="qwen_image_edit_lora",
        variant="qwen-image-edit-2509",
        load={"checkpoint": "qwen_image_edit_2509_fp8_e4m3fn.safetensors", "family": "qwen_image",
              "precision": "int8 slab"},
        cache={"text_encoders": "(single files below)", "dataset_path": "my_edits", "resolution": 1024,
               "text_encoder_1": "qwen_2.5_vl_7b_fp8_scaled.safetensors", "vae_file": "qwen_image_vae.safetensors",
               "sample_prompts": "ohwx, make the cat wear a red hat"},
        offload={"mode": "auto", "vram_budget_gb": 8.0},
        train={"steps": 1500, "learning_rate": 1e-4, "rank": 16, "alpha": 16.0, "warmup_steps": 0,
               "training_seed": 42, "sample_every": 250, "sample_steps": _PREVIEW.steps, "sample_resolution": 512,
               "sample_guidance": _PREVIEW.scale},
        save={"filename_prefix": "loras/qwen_image_edit_lora"},
        downloads={  # as in ComfyUI's own Qwen-Image-Edit-2509 template (comfyui-workflow-templates 0.11.44)
            "qwen_image_edit_2509_fp8_e4m3fn.safetensors": _EDIT_REPO + "diffusion_models/"
                                                           "qwen_image_edit_2509_fp8_e4m3fn.safetensors",
            "qwen_2.5_vl_7b_fp8_scaled.safetensors": _REPO + "text_encoders/qwen_2.5_vl_7b_fp8_scaled.safetensors",
            "qwen_image_vae.safetensors": _REPO + "vae/qwen_image_vae.safetensors",
        },
        note=(
            "Qwen-Image-Edit-2509 (20B) LoRA: teaches an edit (an instruction applied to a given image) at 1024x1024 "
            "on an 8 GB VRAM budget.\n\nFiles (what ComfyUI's own Qwen-Image-Edit-2509 template uses):\n"
            "- models/diffusion_models/qwen_image_edit_2509_fp8_e4m3fn.safetensors (2511: "
            "qwen_image_edit_2511_bf16.safetensors; the first Edit release works too, one control image). "
            "precision 'int8 slab' builds a 20 GB int8 slab once into models/slabs.\n"
            "- models/text_encoders/qwen_2.5_vl_7b_fp8_scaled.safetensors (its vision tower reads the control images) "
            "and models/vae/qwen_image_vae.safetensors.\n"
            "- input/my_edits/: the TARGET images (the result of the edit) with same-name .txt instructions, and "
            "input/my_edits/control/: the CONTROL images (the inputs), named as their targets (cat.png; cat_0.png, "
            "cat_1.png for several). ai-toolkit / musubi-tuner folders: set Cache Text Embeds' control_folder.\n\n"
            "Each instruction is encoded with its control images through Qwen2.5-VL, and the controls' latents are "
            "cached beside it. Sample images: sample_prompts line 1 edits the first target's control images, line 2 "
            "the second's; true CFG 4 against the empty instruction with the same images. The LoRA loads with "
            "ComfyUI's LoraLoader on the Edit model."),
    ),
]
