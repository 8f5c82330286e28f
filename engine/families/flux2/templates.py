"""Flux.2's shipped workflows (``host/templates.py`` writes them to ``example_workflows/`` in UI and API form)."""
from ..specs import TrainingTemplate

_DEV = "https://huggingface.co/Comfy-Org/flux2-dev/resolve/main/split_files/"
_DEV_DOWNLOADS = {  # as in ComfyUI's own Flux.2-dev templates
    "flux2_dev_fp8mixed.safetensors": _DEV + "diffusion_models/flux2_dev_fp8mixed.safetensors",
    "mistral_3_small_flux2_bf16.safetensors": _DEV + "text_encoders/mistral_3_small_flux2_bf16.safetensors",
    "flux2-vae.safetensors": _DEV + "vae/flux2-vae.safetensors",
}

# klein as ComfyUI's own templates give it (Comfy-Org/workflow_templates, templates/image_flux2_klein_text_to_image.json,
# its "Model links" note: the diffusion model and Qwen3-4B from Comfy-Org/flux2-klein, the VAE from Comfy-Org/flux2-dev).
# The 9B (named in the notes, not downloaded: the templates train 4B) as image_flux2_klein_image_edit_9b_base.json
# gives it: qwen_3_8b_fp8mixed.safetensors from Comfy-Org/flux2-klein-9B, flux-2-klein-base-9b-fp8.safetensors from
# black-forest-labs/FLUX.2-klein-base-9b-fp8 (gated: accept BFL's agreement there).
_KLEIN = "https://huggingface.co/Comfy-Org/flux2-klein/resolve/main/split_files/"
_KLEIN_DOWNLOADS = {
    "flux-2-klein-base-4b.safetensors": _KLEIN + "diffusion_models/flux-2-klein-base-4b.safetensors",
    "qwen_3_4b.safetensors": _KLEIN + "text_encoders/qwen_3_4b.safetensors",
    "flux2-vae.safetensors": _DEV_DOWNLOADS["flux2-vae.safetensors"],
}
_KLEIN_CACHE = {"text_encoders": "(single files below)", "text_encoder_1": "qwen_3_4b.safetensors",
                "vae_file": "flux2-vae.safetensors"}
_KLEIN_FILES = (
    "- models/diffusion_models/flux-2-klein-base-4b.safetensors (ComfyUI's file). The 9B: "
    "flux-2-klein-base-9b-fp8.safetensors (from black-forest-labs/FLUX.2-klein-base-9b-fp8) with "
    "qwen_3_8b_fp8mixed.safetensors (Comfy-Org/flux2-klein-9B) as text_encoder_1.\n"
    "- models/text_encoders/qwen_3_4b.safetensors (ComfyUI's Qwen3-4B, as Z-Image's; layers 0-26 are "
    "read, one at a time; inside ComfyUI its bundled Qwen tokenizer is used, standalone put Qwen3's tokenizer files in "
    "models/text_encoders/qwen_3_4b/) and models/vae/flux2-vae.safetensors. Or set text_encoders to a diffusers "
    "folder (models/diffusers/FLUX.2-klein-base-4B).\n")
_EDIT_DATASET = (
    "- input/my_edits/: the TARGET images (the result of the edit) with same-name .txt instructions, and "
    "input/my_edits/control/: the REFERENCE images (the inputs), named as their targets (cat.png; cat_0.png, "
    "cat_1.png ... for several, 1-3 usual). ai-toolkit / musubi-tuner folders: point control_folder at them "
    "(';' between several).\n\n"
    "Each reference is encoded as Flux.2's pipelines do it (over 1024x1024 scaled down, sides to multiples of 16) "
    "and appended after the target's tokens (time index 10, 20, ...); it costs tokens, which the plan counts. The "
    "loss covers the target only. Sample images (sample_prompts, sample_every): line 1 edits the first target's references, line 2 "
    "the second's.")

TEMPLATES = [
    TrainingTemplate(
        name="flux2_dev_lora",
        variant="flux2-dev",
        load={"checkpoint": "flux2_dev_fp8mixed.safetensors", "family": "flux2", "precision": "int8 slab"},
        cache={"text_encoders": "(single files below)", "dataset_path": "my_subject", "resolution": 1024,
               "text_encoder_1": "mistral_3_small_flux2_bf16.safetensors", "vae_file": "flux2-vae.safetensors"},
        offload={"mode": "auto", "vram_budget_gb": 8.5},
        train={"steps": 1500, "learning_rate": 1e-4, "rank": 16, "alpha": 16.0, "warmup_steps": 0,
               "training_seed": 42},
        save={"filename_prefix": "loras/flux2_dev_lora"},
        downloads=_DEV_DOWNLOADS,
        note=(
        "Flux.2-dev (32B) LoRA at 1024x1024 on an 8.5 GB VRAM budget. Smaller cards: set vram_budget_gb lower; "
        "measured on an H100 (bench/NOTES.md, compiled): a 6 GB budget peaks at 5.6 GB at 0.90x the eager "
        "all-resident step, 5.5 GB at 4.9 GB at 0.84x (auto then keeps the global modulation and text embedder in "
        "host RAM between their runs: outer_on_host), 5 GB at 4.0 GB at 0.94x.\n\nFiles:\n"
        "- models/diffusion_models/flux2_dev_fp8mixed.safetensors (ComfyUI's file; flux2-dev.safetensors in bf16 "
        "works too). precision 'int8 slab' builds a 32 GB int8 slab once into models/slabs.\n"
        "- models/text_encoders/mistral_3_small_flux2_bf16.safetensors (ComfyUI's file, or its pruned 30-layer "
        "version; only layers 0-29 are read, one at a time; its embedded tokenizer is used) and "
        "models/vae/flux2-vae.safetensors. Or set text_encoders to a diffusers folder (models/diffusers/FLUX.2-dev).\n"
        "- input/my_subject/: your images with same-name .txt captions.\n\n"
        "Memory: blocks stream from pinned host RAM, and from the slab file where RAM is short (ram_budget_gb 0 = auto). The LoRA loads in ComfyUI "
        "versions with Flux.2 support (0.33 checked)."),
    ),
    TrainingTemplate(
        name="flux2_klein_lora",
        variant="flux2-klein-base-4b",
        load={"checkpoint": "flux-2-klein-base-4b.safetensors", "family": "flux2", "precision": "bf16"},
        cache={**_KLEIN_CACHE, "dataset_path": "my_subject", "resolution": 1024},
        offload={"mode": "auto", "vram_budget_gb": 5.0},
        train={"steps": 1500, "learning_rate": 1e-4, "rank": 16, "alpha": 16.0, "warmup_steps": 0,
               "training_seed": 42},
        save={"filename_prefix": "loras/flux2_klein_lora"},
        downloads=_KLEIN_DOWNLOADS,
        tiny_variant="flux2-klein-tiny",
        note=(
        "Flux.2 klein LoRA at 1024x1024 on a 5 GB VRAM budget (klein 4B measured 3.3 GB at 1.01x the resident "
        "step; auto accepts 4.1 GB at the least). Trainers recommend the undistilled 'base' "
        "variants for LoRA training; the 9B works the same way (pick its files).\n\nFiles:\n"
        + _KLEIN_FILES +
        "- input/my_subject/: your images with same-name .txt captions.\n\n"
        "klein has no guidance embedding: Train LoRA's guidance value is ignored."),
    ),
    TrainingTemplate(
        name="flux2_dev_dual_gpu",
        variant="flux2-dev",
        load={"checkpoint": "flux2_dev_fp8mixed.safetensors", "family": "flux2", "precision": "int8 slab"},
        cache={"text_encoders": "(single files below)", "dataset_path": "my_subject", "resolution": 1024,
               "text_encoder_1": "mistral_3_small_flux2_bf16.safetensors", "vae_file": "flux2-vae.safetensors"},
        offload={"mode": "auto", "vram_budget_gb": 0.0},  # the per-GPU budgets come from Dual-GPU Split
        train={"steps": 1500, "learning_rate": 1e-4, "rank": 16, "alpha": 16.0, "warmup_steps": 0,
               "training_seed": 42},
        save={"filename_prefix": "loras/flux2_dev_dual_gpu"},
        downloads=_DEV_DOWNLOADS,
        split={"mode": "split", "devices": "cuda:0,cuda:1", "cut": -1, "vram_budget_gb": "14,14"},
        note=(
        "Flux.2-dev (32B) LoRA at 1024x1024 on two GPUs (files as in flux2_dev_lora).\n\n"
        "Dual-GPU Split, mode split: the blocks are cut in two; each GPU holds its part of the int8 slab within "
        "its budget (14 GB each here) and streams the rest from pinned host RAM. The cut is chosen so both GPUs "
        "peak at about the same level; the plan for each GPU is printed before training. micro_batches 4 with Train "
        "LoRA's batch_size 4 pipelines each batch through both GPUs at once (1F1B, the same gradient); at 1 the "
        "parts run one after the other.\n"
        "mode data_parallel instead: one training process per GPU, each with the whole streamed model and its "
        "own images; LoRA gradients are averaged, so the effective batch doubles and images/s about double "
        "(measured figures: bench/RESULTS.md, 'parallel' rows).\n\n"
        "Several hosts: data parallel runs under torchrun too; see README 'Multi-GPU'."),
        note_pos=(40, 640),
    ),
    TrainingTemplate(
        name="flux2_dev_edit_lora",
        variant="flux2-dev",
        load={"checkpoint": "flux2_dev_fp8mixed.safetensors", "family": "flux2", "precision": "int8 slab"},
        cache={"text_encoders": "(single files below)", "dataset_path": "my_edits", "resolution": 1024,
               "text_encoder_1": "mistral_3_small_flux2_bf16.safetensors", "vae_file": "flux2-vae.safetensors",
               "control_folder": "my_edits/control", "sample_prompts": "ohwx, make the cat wear a red hat"},
        offload={"mode": "auto", "vram_budget_gb": 8.5},
        train={"steps": 1500, "learning_rate": 1e-4, "rank": 16, "alpha": 16.0, "warmup_steps": 0,
               "training_seed": 42, "sample_every": 250, "sample_steps": 20, "sample_resolution": 512,
               "sample_guidance": 4.0},
        save={"filename_prefix": "loras/flux2_dev_edit_lora"},
        downloads=_DEV_DOWNLOADS,
        note=(
        "Flux.2-dev (32B) EDIT LoRA: teaches an edit of given reference images at 1024x1024 on an 8.5 GB VRAM "
        "budget (one 1024x1024 reference doubles the image tokens).\n\nFiles (as flux2_dev_lora):\n"
        "- models/diffusion_models/flux2_dev_fp8mixed.safetensors (a 32 GB int8 slab is built once into "
        "models/slabs), models/text_encoders/mistral_3_small_flux2_bf16.safetensors, models/vae/flux2-vae.safetensors.\n"
        + _EDIT_DATASET + " The LoRA loads with ComfyUI's LoraLoader on Flux.2-dev (ReferenceLatent nodes)."),
    ),
    TrainingTemplate(
        name="flux2_klein_edit_lora",
        variant="flux2-klein-base-4b",
        load={"checkpoint": "flux-2-klein-base-4b.safetensors", "family": "flux2", "precision": "bf16"},
        cache={**_KLEIN_CACHE, "dataset_path": "my_edits", "resolution": 1024, "control_folder": "my_edits/control"},
        offload={"mode": "auto", "vram_budget_gb": 5.0},
        train={"steps": 1500, "learning_rate": 1e-4, "rank": 16, "alpha": 16.0, "warmup_steps": 0,
               "training_seed": 42},
        save={"filename_prefix": "loras/flux2_klein_edit_lora"},
        downloads=_KLEIN_DOWNLOADS,
        tiny_variant="flux2-klein-tiny",
        note=(
        "Flux.2 klein EDIT LoRA: teaches an edit of given reference images at 1024x1024 on a 5 GB VRAM budget. "
        "Train on the undistilled 'base' model; the 9B works the same way (pick its files). klein 9B KV files "
        "(references first, KV cache) are refused: use klein 9B / base 9B.\n\nFiles (as flux2_klein_lora):\n"
        + _KLEIN_FILES + _EDIT_DATASET + " klein has no guidance embedding: Train LoRA's guidance value is ignored."),
    ),
]
