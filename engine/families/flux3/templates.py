"""FLUX.3 Image Klein's shipped workflow (``host/templates.py`` writes it to ``example_workflows/`` in UI and API form)."""
from ..specs import TrainingTemplate
from . import FAMILY

_PREVIEW = FAMILY.guidance("flux3-klein-base")  # the template trains Base: CFG 3.5, 50 steps
#: Qwen3-VL-4B-Instruct in ComfyUI's layout (Comfy-Org's Krea 2 repack ships it; FLUX.3 reads the same encoder) and
#: the Flux.2 VAE (Comfy-Org's Flux.2 repack; FLUX.3's autoencoder class is diffusers' AutoencoderKLFlux2).
#: The fp8-scaled file: the one ComfyUI's own Krea 2 template links (its bf16 twin works the same, slower to fetch).
_TEXT = "https://huggingface.co/Comfy-Org/Krea-2/resolve/main/text_encoders/qwen3vl_4b_fp8_scaled.safetensors"
_VAE = "https://huggingface.co/Comfy-Org/flux2-dev/resolve/main/split_files/vae/flux2-vae.safetensors"

TEMPLATES = [
    TrainingTemplate(
        name="flux3_klein_lora",
        variant="flux3-klein-base",
        # BFL's and Comfy-Org's FLUX.3 Klein file names were searched for (Hugging Face pages, GitHub code, the
        # workflow_templates releases) and not found; this default is ours, and the Note says any name works.
        load={"checkpoint": "flux3_klein_base_bf16.safetensors", "family": "flux3", "precision": "int8 slab"},
        cache={"text_encoders": "(single files below)", "dataset_path": "my_subject", "resolution": 1024,
               "text_encoder_1": "qwen3vl_4b_fp8_scaled.safetensors", "vae_file": "flux2-vae.safetensors",
               "sample_prompts": "ohwx, a photo of a dog on a beach"},
        offload={"mode": "auto", "vram_budget_gb": 2.0},
        # lr 1e-4, rank 16: fal's FLUX 3 Klein LoRA trainer defaults (lr) and the project's rank.
        train={"steps": 1000, "learning_rate": 1e-4, "rank": 16, "alpha": 16.0, "warmup_steps": 0,
               "training_seed": 42, "sample_every": 250, "sample_steps": _PREVIEW.steps, "sample_resolution": 512,
               "sample_guidance": _PREVIEW.scale},
        save={"filename_prefix": "loras/flux3_klein_lora"},
        downloads={"qwen3vl_4b_fp8_scaled.safetensors": _TEXT, "flux2-vae.safetensors": _VAE},
        note=(
            "FLUX.3 Image Klein (5.5B) LoRA at 1024x1024 on a 2 GB VRAM budget.\n\nFiles:\n"
            "- models/diffusion_models/: FLUX 3 Image Klein Base's transformer in bf16 (or fp8) with BFL's tensor "
            "names, from black-forest-labs/flux-3-image-klein-comfy or black-forest-labs/flux-3-image-klein-base, "
            "under any file name: the Load node identifies a file by its tensors, never by its name, so pick yours "
            "in the checkpoint list. Train on Base, as BFL says; the "
            "step-distilled file loads and previews (16 steps, no CFG) but does not train. int8 and NVFP4 files "
            "cannot be read: use bf16. precision 'int8 slab' builds a 5.5 GB int8 slab once into models/slabs.\n"
            "- models/text_encoders/qwen3vl_4b_fp8_scaled.safetensors (or _bf16; Qwen3-VL-4B-Instruct; layers 0-31 are read; its "
            "tokenizer is the Qwen one ComfyUI bundles; outside ComfyUI put Qwen's vocab.json, merges.txt, "
            "tokenizer_config.json in models/text_encoders/qwen3vl_4b_fp8_scaled/), and models/vae/flux2-vae.safetensors "
            "(if BFL's repository ships its own FLUX.3 autoencoder, use that).\n"
            "- input/my_subject/: your images with same-name .txt captions. FLUX.3 is trained on full scene "
            "captions: write long, dense ones.\n\n"
            "Captions are encoded as Flux3ModularPipeline does: one user turn, Qwen3-VL's hidden states 4, 8, ..., "
            "32, the window padded to a multiple of 80 tokens and the padding kept (the model reads it). Batches "
            "only mix captions of one window (batch_size 1 always works). Samples use CFG 3.5 against the empty "
            "prompt, 50 steps (two forwards per step). The LoRA (attention of every text, image and joint block) "
            "is saved with BFL's module names, which diffusers' FLUX.3 loader reads; ComfyUI 0.33 has no FLUX.3, "
            "and whether a ComfyUI with FLUX.3 maps these names was not checked."),
    ),
]
