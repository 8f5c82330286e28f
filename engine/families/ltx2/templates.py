"""LTX-2.3's shipped workflow (``host/templates.py`` writes it to ``example_workflows/`` in UI and API form)."""
from ..specs import TrainingTemplate
from . import FAMILY
from .comfy_files import GEMMA_FILES, GEMMA_URL

_PREVIEW = FAMILY.guidance("ltx2.3")
#: Lightricks' fp8 release, as ComfyUI's own LTX-2.3 template links it (Comfy-Org/workflow_templates
#: ``video_ltx2_3_id_lora.json``: "27.14 GB", models/checkpoints).
_CKPT = "ltx-2.3-22b-dev-fp8.safetensors"
#: ComfyUI's Gemma 3 12B (bf16: the text cache is made once, at full precision; it runs one layer at a time).
_GEMMA = GEMMA_FILES[0]
_DOWNLOADS = {_CKPT: "https://huggingface.co/Lightricks/LTX-2.3-fp8/resolve/main/" + _CKPT, _GEMMA: GEMMA_URL + _GEMMA}
_FILES = (
    "- models/checkpoints/" + _CKPT + " (Lightricks/LTX-2.3-fp8; or ltx-2.3-22b-dev.safetensors): the transformer; "
    "precision 'int8 slab' builds a 19 GB int8 slab once into models/slabs. Cache Text Embeds also reads the text "
    "connectors, the text projection and the video VAE bundled in it (as ComfyUI's LTXAVTextEncoderLoader does; keep "
    "the file where it is after the slab is built).\n"
    "- models/text_encoders/" + _GEMMA + " (Comfy-Org/ltx-2, split_files/text_encoders; or "
    + GEMMA_FILES[1] + "): Gemma 3 12B, run one layer at a time; the tokenizer it embeds is used. Captions are "
    "left-padded to 1024 tokens, every hidden state goes through the frozen connectors once, and the cache keeps "
    "their output (12.6 MB a caption). A diffusers LTX-2.3 folder (models/diffusers) works instead: set "
    "text_encoders to it.\n")

TEMPLATES = [
    TrainingTemplate(
        name="ltx23_lora",
        variant="ltx2.3",
        load={"checkpoint": _CKPT, "family": "ltx2", "precision": "int8 slab"},
        cache={"text_encoders": "(single files below)", "text_encoder_1": _GEMMA, "dataset_path": "my_clips",
               "resolution": 720, "sample_prompts": "ohwx, a dog running on a beach", "video_frames": "89",
               "video_fps": 24.0},
        offload={"mode": "auto", "vram_budget_gb": 6.0},
        train={"steps": 1500, "learning_rate": 1e-4, "rank": 32, "alpha": 32.0, "warmup_steps": 0,
               "training_seed": 42, "sample_every": 250, "sample_steps": _PREVIEW.steps, "sample_resolution": 512,
               "sample_guidance": _PREVIEW.scale, "sample_frames": 49},
        save={"filename_prefix": "loras/ltx23_lora"},
        downloads=_DOWNLOADS, download_folders={_CKPT: "checkpoints"},
        note=(
            "LTX-2.3 (22B, joint audio-video) video LoRA on clips of 89 frames at 24 fps, resolution 720 (the area "
            "of 960x544: about 6,100 video tokens), on a 6 GB VRAM budget.\n\nFiles:\n" + _FILES +
            "- input/my_clips/: your clips with same-name .txt captions (frame counts 8k+1: 89, 121, ...).\n\n"
            "Video-only LoRA: the video self-attention, text cross-attention and FFN of every block; the audio stream "
            "runs frozen on pure noise at sigma 1. Samples use CFG 3 against the empty prompt, 30 steps; they show "
            "the video only (no audio is decoded). The LoRA (diffusion_model.transformer_blocks.N.attn1.to_q) loads "
            "with ComfyUI's LoraLoaderModelOnly on LTX-2.3; it does not fit LTX-2.5 (a LoRA only works with the "
            "model it was trained on)."),
    ),
    TrainingTemplate(
        name="ltx23_i2v_lora",
        variant="ltx2.3",
        load={"checkpoint": _CKPT, "family": "ltx2", "precision": "int8 slab"},
        cache={"text_encoders": "(single files below)", "text_encoder_1": _GEMMA, "dataset_path": "my_clips",
               "resolution": 720, "sample_prompts": "ohwx, a dog running on a beach", "video_frames": "89",
               "video_fps": 24.0, "image_to_video": True},
        offload={"mode": "auto", "vram_budget_gb": 6.0},
        train={"steps": 1500, "learning_rate": 1e-4, "rank": 32, "alpha": 32.0, "warmup_steps": 0,
               "training_seed": 42, "sample_every": 250, "sample_steps": _PREVIEW.steps, "sample_resolution": 512,
               "sample_guidance": _PREVIEW.scale, "sample_frames": 49},
        save={"filename_prefix": "loras/ltx23_i2v_lora"},
        downloads=_DOWNLOADS, download_folders={_CKPT: "checkpoints"},
        note=(
            "LTX-2.3 (22B, joint audio-video) IMAGE-TO-VIDEO video LoRA: the same checkpoint and files as ltx23_lora, "
            "with Cache Text Embeds' image_to_video on. Each clip's first frame is the condition: given to the model "
            "clean at timestep 0 and left out of the loss (LTX2ImageToVideoPipeline's conditioning; Lightricks' "
            "trainer's first_frame mode); the cache keeps that frame's latent beside each clip's. Clips of 89 frames "
            "at 24 fps, resolution 720 (about 6,100 video tokens), on a 6 GB VRAM budget.\n\nFiles:\n"
            + _FILES + "- input/my_clips/: your clips with same-name .txt captions (frame counts 8k+1).\n\n"
            "Samples: sample prompt line i starts from the first frame of clip window i (at sample_resolution; the "
            "frame is not re-encoded through H.264 as the pipeline does for a still photo: it already is a video "
            "frame), CFG 3 against the empty prompt, 30 steps, video only. The LoRA loads with ComfyUI's "
            "LoraLoaderModelOnly on LTX-2.3 (use it with an image-to-video graph)."),
    ),
]
