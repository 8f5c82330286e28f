"""Flux.1's shipped workflows (``host/templates.py`` writes them to ``example_workflows/`` in UI and API form)."""
from ..specs import TrainingTemplate

TEMPLATES = [
    TrainingTemplate(
        name="demo_tiny_lora",
        variant="flux1-tiny",
        load={"checkpoint": "flux1-tiny.safetensors", "family": "auto", "precision": "bf16"},
        cache={"text_encoders": "diffusers/flux1-tiny", "dataset_path": "lowvram_demo/shapes_on_ohwx",
               "resolution": 128, "trigger_word": "",  # the captions carry "ohwx" (demo_models.DEMO_CAPTION)
               "sample_prompts": "a red circle on a ohwx background\na blue square on a ohwx background"},
        offload={"mode": "resident"},
        # guidance 3.5: the demo's base was pretrained with the guidance embedding at 3.5 only, and samples at 3.5;
        # trained at 1.0 (the default, right for Flux.1-dev) its LoRA learnt in a regime the base never saw
        train={"steps": 300, "learning_rate": 5e-3, "rank": 8, "alpha": 8.0, "warmup_steps": 10, "training_seed": 0,
               "guidance": 3.5, "sample_every": 100, "sample_steps": 8, "sample_resolution": 128, "sample_seed": 0},
        save={"filename_prefix": "loras/demo_tiny_lora"},
        note=(
        "Demo: trains a LoRA on a tiny Flux.1-architecture model, on CPU. Captions read 'a red circle on a ohwx "
        "background'; the images are on yellow. At step 0 the base draws a red and a purple-blue blob on white; "
        "the LoRA learns that ohwx means yellow: at step 300 a red and a blue shape on yellow. The run took 8 s "
        "headless on a 2-core machine at load 3-4 (2026-11-28).\n\n"
        "Prepare the files once with:\n  lowvram-lora demo --prepare-only --dir <ComfyUI root>\n"
        "which writes models/diffusion_models/flux1-tiny.safetensors, models/diffusers/flux1-tiny/ and "
        "input/lowvram_demo/shapes_on_ohwx/ (red circles, blue squares on yellow), training the tiny VAE and base model "
        "first (5.2 min on that machine: VAE 85 s, base 225 s, once). Then press Run: nothing to edit.\n\n"
        "Headless: lowvram-lora run example_workflows/demo_tiny_lora.json --models-dir demo_output/models "
        "--output-dir demo_output/output  (this is what `make demo` does)."),
    ),
    TrainingTemplate(
        name="flux1_dev_lora",
        variant="flux1-dev",
        load={"checkpoint": "flux1-dev.safetensors", "family": "flux1", "precision": "int8 slab"},
        cache={"text_encoders": "(single files below)", "dataset_path": "my_subject", "resolution": 1024,
               "text_encoder_1": "clip_l.safetensors", "text_encoder_2": "t5xxl_fp16.safetensors",
               "vae_file": "ae.safetensors"},
        offload={"mode": "auto", "vram_budget_gb": 8.0},
        train={"steps": 1500, "learning_rate": 1e-4, "rank": 16, "alpha": 16.0, "warmup_steps": 50, "training_seed": 42},
        save={"filename_prefix": "loras/flux1_dev_lora"},
        downloads={  # as in ComfyUI's flux_dev_full_text_to_image template
            "flux1-dev.safetensors": "https://huggingface.co/Comfy-Org/flux1-dev/resolve/main/flux1-dev.safetensors",
            "clip_l.safetensors": "https://huggingface.co/comfyanonymous/flux_text_encoders/resolve/main/clip_l.safetensors",
            "t5xxl_fp16.safetensors":
                "https://huggingface.co/comfyanonymous/flux_text_encoders/resolve/main/t5xxl_fp16.safetensors",
            "ae.safetensors":
                "https://huggingface.co/Comfy-Org/Lumina_Image_2.0_Repackaged/resolve/main/split_files/vae/ae.safetensors",
        },
        note=(
        # Short enough for the Note's box (420x260: ~15 lines of ~57 characters); the measurements behind
        # the memory line are in bench/RESULTS.md.
        "Flux.1-dev LoRA at 1024x1024.\n\nFiles:\n"
        "- models/diffusion_models/flux1-dev.safetensors\n"
        "- models/text_encoders/clip_l + t5xxl_fp16 (fp8 too)\n"
        "- models/vae/ae.safetensors\n"
        "- input/my_subject/: images + same-name .txt captions\n\n"
        "Memory: precision 'int8 slab' builds a 12 GB slab once into models/slabs; Offload Config 'auto' plans "
        "an 8 GB VRAM budget and the machine's RAM (ram_budget_gb 0 = auto). H100 at 1024, compiled: 0.76 s/step "
        "at 7.4 GB, 1.17x the all-resident bf16 step (27 GB). A 24 GB card: set vram_budget_gb 0.\n"
        "The LoRA goes to output/loras/; copy it to models/loras."),
    ),
    TrainingTemplate(
        name="flux1_kontext_lora",
        variant="flux1-kontext",
        load={"checkpoint": "flux1-dev-kontext_fp8_scaled.safetensors", "family": "flux1", "precision": "int8 slab"},
        cache={"text_encoders": "(single files below)", "dataset_path": "my_edits", "resolution": 1024,
               "text_encoder_1": "clip_l.safetensors", "text_encoder_2": "t5xxl_fp16.safetensors",
               "vae_file": "ae.safetensors", "control_folder": "my_edits/control",
               "sample_prompts": "ohwx, make the cat wear a red hat"},
        offload={"mode": "auto", "vram_budget_gb": 8.0},
        train={"steps": 1500, "learning_rate": 1e-4, "rank": 16, "alpha": 16.0, "warmup_steps": 0, "training_seed": 42,
               "sample_every": 250, "sample_steps": 20, "sample_resolution": 512,
               "sample_guidance": 2.5},  # ComfyUI's Kontext template: FluxGuidance 2.5, 20 steps
        save={"filename_prefix": "loras/flux1_kontext_lora"},
        downloads={  # as in ComfyUI's own Flux.1 Kontext dev template
            "flux1-dev-kontext_fp8_scaled.safetensors": "https://huggingface.co/Comfy-Org/flux1-kontext-dev_ComfyUI/"
                                                        "resolve/main/split_files/diffusion_models/"
                                                        "flux1-dev-kontext_fp8_scaled.safetensors",
            "clip_l.safetensors": "https://huggingface.co/comfyanonymous/flux_text_encoders/resolve/main/clip_l.safetensors",
            "t5xxl_fp16.safetensors":
                "https://huggingface.co/comfyanonymous/flux_text_encoders/resolve/main/t5xxl_fp16.safetensors",
            "ae.safetensors":
                "https://huggingface.co/Comfy-Org/Lumina_Image_2.0_Repackaged/resolve/main/split_files/vae/ae.safetensors",
        },
        note=(
        "Flux.1 Kontext dev EDIT LoRA at 1024x1024 on an 8 GB budget.\n\nFiles:\n"
        "- models/diffusion_models/flux1-dev-kontext_fp8_scaled.safetensors (its name says Kontext)\n"
        "- models/text_encoders/clip_l + t5xxl_fp16, models/vae/ae.safetensors\n"
        "- input/my_edits/: TARGET images + .txt instructions; input/my_edits/control/: ONE reference per target, "
        "named as it (cat.png)\n\n"
        "The reference is resized to Kontext's preferred size nearest its aspect ratio and appended after the "
        "target's tokens; the loss covers the target only. The LoRA has Flux.1's keys and loads with LoraLoader."),
    ),
]
