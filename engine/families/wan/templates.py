"""Wan's shipped workflow (``host/templates.py`` writes it in UI and API form)."""
from ..specs import TrainingTemplate
from . import FAMILY

_REPO = "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/"
#: Wan 2.2's files, as ComfyUI's own Wan 2.2 templates link them (comfyui-workflow-templates 0.11.44: the TI2V-5B
#: and T2V-A14B workflows; umT5 stays in the Wan 2.1 repository there too).
_REPO22 = "https://huggingface.co/Comfy-Org/Wan_2.2_ComfyUI_Repackaged/resolve/main/split_files/"
_UMT5 = "umt5_xxl_fp8_e4m3fn_scaled.safetensors"
_HIGH, _LOW = "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors"
_I2V_HIGH = "wan2.2_i2v_high_noise_14B_fp8_scaled.safetensors"
_I2V_LOW = "wan2.2_i2v_low_noise_14B_fp8_scaled.safetensors"
_I2V21, _CLIP_H = "wan2.1_i2v_480p_14B_fp16.safetensors", "clip_vision_h.safetensors"
_CLIPS = ("- input/my_clips/: your clips (.mp4, .webm, .mov, animated .gif/.webp, or a folder of frames) with same-name "
          ".txt captions. Each training window's first frame is the image the model is conditioned on (the cache "
          "keeps its condition latents beside the window's latents).\n\n")

_PREVIEW = FAMILY.guidance("wan2.1-t2v-1.3b")  # CFG 5, 20 steps
_TOKENIZER = ("with umT5's tokenizer files (google/umt5-xxl: tokenizer.json, tokenizer_config.json, spiece.model) in "
              "models/text_encoders/umt5_xxl_fp8_e4m3fn_scaled/")


def _a14b(task: str, high: str, low: str, note: str, **extra) -> TrainingTemplate:
    """A Wan 2.2 A14B template (``task`` t2v or i2v): one chain per expert, each previewing with the other as its
    partner and saving its own LoRA; 24 GB is the budget at which auto's plan also fits a 32 GB RAM machine (below
    it the plan offloads every block's activations: ~58 GB of RAM; host/template_needs.py says so). The I2V expert
    differs only by 20 input channels of patch_embedding. The downloads are the files ComfyUI's own Wan 2.2
    template of the task uses."""
    variant = f"wan2.2-{task}-a14b-"
    return TrainingTemplate(
        name=f"wan22_{task}_lora",
        variant=variant + "high-noise",
        partner_variant=variant + "low-noise",
        label="high noise",
        load={"checkpoint": high, "family": "wan", "precision": "int8 slab"},
        cache={"text_encoders": "(single files below)", "dataset_path": "my_clips", "resolution": 624,
               "text_encoder_1": _UMT5, "vae_file": "wan_2.1_vae.safetensors",
               "sample_prompts": "ohwx, a dog running on a beach", "video_frames": "81", "video_fps": 16.0},
        offload={"mode": "auto", "vram_budget_gb": 24.0},
        train={"steps": 1500, "learning_rate": 1e-4, "rank": 16, "alpha": 16.0, "warmup_steps": 0,
               "training_seed": 42, "sample_every": 250, "sample_steps": _PREVIEW.steps, "sample_resolution": 512,
               "sample_guidance": FAMILY.guidance(variant + "high-noise").scale, "sample_frames": 17},
        save={"filename_prefix": f"loras/wan22_{task}_high_noise_lora"},
        chains=({"label": "low noise", "load": {"checkpoint": low},
                 "train": {"sample_guidance": FAMILY.guidance(variant + "low-noise").scale},
                 "save": {"filename_prefix": f"loras/wan22_{task}_low_noise_lora"}},),
        # Previews need both experts (each denoises only its side of the boundary): each chain's Train LoRA takes
        # the other chain's model as its preview_partner.
        chain_links=((0, "preview_partner", 1), (1, "preview_partner", 0)),
        downloads={high: _REPO22 + "diffusion_models/" + high, low: _REPO22 + "diffusion_models/" + low,
                   _UMT5: _REPO + "text_encoders/" + _UMT5,
                   "wan_2.1_vae.safetensors": _REPO22 + "vae/wan_2.1_vae.safetensors"},
        note=note, **extra,
    )

TEMPLATES = [
    TrainingTemplate(
        name="wan21_t2v_1_3b_lora",
        variant="wan2.1-t2v-1.3b",
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
            "empty prompt (two forwards per step); each is a 17-frame clip (sample_frames), saved as an animated WebP "
            "that the node shows and Save LoRA copies next to the LoRA. The LoRA (self- and cross-attention, Wan's own "
            "names: diffusion_model.blocks.N.self_attn.q) loads with ComfyUI's LoraLoaderModelOnly."),
    ),
    TrainingTemplate(
        name="wan22_ti2v_5b_lora",
        variant="wan2.2-ti2v-5b",
        load={"checkpoint": "wan2.2_ti2v_5B_fp16.safetensors", "family": "wan", "precision": "int8 slab"},
        cache={"text_encoders": "(single files below)", "dataset_path": "my_clips", "resolution": 896,
               "text_encoder_1": _UMT5, "vae_file": "wan2.2_vae.safetensors",
               "sample_prompts": "ohwx, a dog running on a beach", "video_frames": "49", "video_fps": 24.0},
        offload={"mode": "auto", "vram_budget_gb": 6.0},
        train={"steps": 1500, "learning_rate": 1e-4, "rank": 16, "alpha": 16.0, "warmup_steps": 0,
               "training_seed": 42, "sample_every": 250, "sample_steps": _PREVIEW.steps, "sample_resolution": 512,
               "sample_guidance": FAMILY.guidance("wan2.2-ti2v-5b").scale, "sample_frames": 17},
        save={"filename_prefix": "loras/wan22_ti2v_5b_lora"},
        downloads={
            "wan2.2_ti2v_5B_fp16.safetensors": _REPO22 + "diffusion_models/wan2.2_ti2v_5B_fp16.safetensors",
            _UMT5: _REPO + "text_encoders/" + _UMT5,
            "wan2.2_vae.safetensors": _REPO22 + "vae/wan2.2_vae.safetensors",
        },
        note=(
            "Wan 2.2 TI2V-5B text-to-video LoRA on 49-frame clips at 24 fps, buckets of about 896x896 pixels (e.g. "
            "1152x704), on a 6 GB VRAM budget. Measured on an H100 (bench/NOTES.md): 1280x704x49 trains in 5.1 GB "
            "(compiled) / 5.4 GB (eager) under 'auto' at 6 GB; these buckets hold fewer tokens.\n\n"
            "Files (what ComfyUI's own Wan 2.2 TI2V-5B template uses):\n"
            "- models/diffusion_models/wan2.2_ti2v_5B_fp16.safetensors. precision 'int8 slab' builds a slab once into "
            "models/slabs.\n"
            f"- models/text_encoders/{_UMT5} {_TOKENIZER}, and models/vae/wan2.2_vae.safetensors (TI2V-5B's own "
            "48-channel VAE; not wan_2.1_vae).\n"
            "- input/my_clips/: your clips (.mp4, .webm, .mov, animated .gif/.webp, or a folder of frames; images "
            "count as one-frame clips) with same-name .txt captions. A clip shorter than 49 frames at 24 fps is "
            "named in the log; list several counts in video_frames (e.g. 17,33,49) to keep short ones.\n\n"
            "Samples: every 250 steps a 17-frame 512x512 clip per prompt, CFG 5 against the empty prompt, saved as an "
            "animated WebP beside the sample grid and next to the LoRA (<name>_samples_p00.webp); the node shows it "
            "animated, the grid shows each clip's first frame and a strip of frames. The LoRA (Wan's own names) loads "
            "with ComfyUI's LoraLoaderModelOnly."),
    ),
    _a14b("t2v", _HIGH, _LOW,
        note=(
            "Wan 2.2 T2V-A14B LoRAs, one per expert: the top chain trains the high-noise expert (sigma >= 0.875: "
            "layout and motion), the bottom one the low-noise expert (sigma < 0.875: detail), each on its own noise "
            "levels, each saving its own LoRA (loras/wan22_t2v_high_noise_lora / _low_noise_lora). Only the expert "
            "a chain trains streams while it trains; the chains run one after the other. To train one expert, bypass "
            "(Ctrl-B) the other chain's Save LoRA.\n\n"
            "Two GPUs, both experts at once: add a Dual-GPU Split node (mode experts, devices cuda:0,cuda:1) to the "
            "top Train LoRA's split input and bypass (Ctrl-B) the bottom chain's Save LoRA. The top Train LoRA then "
            "trains the high-noise expert on the first GPU and its preview_partner (the low-noise expert) on the "
            "second at the same time, each exactly as its own chain would, and its Save LoRA writes both "
            "(..._high_noise_00001_ and ..._low_noise_00001_). The two processes share the RAM budget.\n\n"
            "Clips: 81 frames at 16 fps, buckets of about 624x624 pixels (832x480), on a 24 GB VRAM budget, planned "
            "for 32 GB of RAM. Smaller cards: at 832x480x81 the smallest plan is about 7.6 GB (vram_budget_gb 8; "
            "measured on an H200: an A14B expert at 8 GB peaked at 6.6 GB, 18.0 s a step, 1.03x the resident step), "
            "but it offloads "
            "every block's activations to pinned RAM: about 58 GB of RAM (the plan line says what your machine "
            "allows).\n\n"
            "Files (what ComfyUI's own Wan 2.2 T2V template uses):\n"
            f"- models/diffusion_models/{_HIGH} and {_LOW}. precision 'int8 slab' builds each expert's slab once into "
            "models/slabs.\n"
            f"- models/text_encoders/{_UMT5} {_TOKENIZER}, and models/vae/wan_2.1_vae.safetensors (A14B uses the Wan "
            "2.1 VAE).\n"
            "- input/my_clips/: your clips (.mp4, .webm, .mov, animated .gif/.webp, or a folder of frames; images "
            "count as one-frame clips) with same-name .txt captions.\n\n"
            "Samples: every 250 steps a 17-frame 512x512 clip per prompt. A preview needs both experts, switching at "
            "sigma 0.875 as ComfyUI's own Wan 2.2 workflow does, so each Train LoRA's preview_partner input takes the "
            "other chain's Load Quantized Slab: the expert being trained runs with its LoRA (CFG 4 high, 3 low), the "
            "other with its base weights (its LoRA from the other chain is not applied). The partner streams only "
            "while sampling (about 1 GB of VRAM) and is kept in host RAM between previews only where the machine has "
            "room (the log says which). Disconnect preview_partner (or set sample_every 0) for no samples. To see "
            "both LoRAs together, load them in ComfyUI's own Wan 2.2 T2V workflow (LoraLoaderModelOnly after each "
            "expert's loader)."),
    ),
    _a14b("i2v", _I2V_HIGH, _I2V_LOW, tiny_variant="wan2.2-i2v-tiny",
        note=(
            "Wan 2.2 I2V-A14B image-to-video LoRAs, one per expert: the top chain trains the high-noise expert (sigma "
            ">= 0.9), the bottom one the low-noise expert (sigma < 0.9), each saving its own LoRA "
            "(loras/wan22_i2v_high_noise_lora / _low_noise_lora). The chains run one after the other; bypass (Ctrl-B) "
            "a chain's Save LoRA to train one expert.\n\n"
            "Clips: 81 frames at 16 fps, buckets of about 624x624 pixels (832x480), on a 24 GB VRAM budget, planned "
            "for 32 GB of RAM. Smaller cards: vram_budget_gb 8 trains an expert in 6.6 GB (measured on an H200, 18.0 s "
            "a step, 1.03x the resident step), but offloads every block's activations to pinned RAM: about 58 GB of "
            "RAM. The model sees each window's first frame as its condition (the mask and one VAE encode "
            "of the first frame followed by grey frames, as WanImageToVideoPipeline and ComfyUI's WanImageToVideo "
            "build it); frame 0 stays in the loss, as the pipeline and other trainers do.\n\n"
            "Files (what ComfyUI's own Wan 2.2 I2V template uses):\n"
            f"- models/diffusion_models/{_I2V_HIGH} and {_I2V_LOW}. precision 'int8 slab' builds each expert's slab "
            "once into models/slabs.\n"
            f"- models/text_encoders/{_UMT5} {_TOKENIZER}, and models/vae/wan_2.1_vae.safetensors.\n"
            + _CLIPS +
            "Samples: every 250 steps a 17-frame 512x512 clip per prompt, drawn from a first frame of the dataset "
            "(sample prompt line i from clip window i). Each Train LoRA's preview_partner takes the other chain's "
            "model so previews switch expert at sigma 0.9 (CFG 3.5 both, the official setting). The LoRA (Wan's own "
            "names) loads with ComfyUI's LoraLoaderModelOnly after each expert's loader."),
    ),
    TrainingTemplate(
        name="wan21_i2v_lora",
        variant="wan2.1-i2v-14b",
        tiny_variant="wan-i2v-tiny",
        load={"checkpoint": _I2V21, "family": "wan", "precision": "int8 slab"},
        cache={"text_encoders": "(single files below)", "dataset_path": "my_clips", "resolution": 624,
               "text_encoder_1": _UMT5, "text_encoder_2": _CLIP_H, "vae_file": "wan_2.1_vae.safetensors",
               "sample_prompts": "ohwx, a dog running on a beach", "video_frames": "81", "video_fps": 16.0},
        offload={"mode": "auto", "vram_budget_gb": 24.0},
        train={"steps": 1500, "learning_rate": 1e-4, "rank": 16, "alpha": 16.0, "warmup_steps": 0,
               "training_seed": 42, "sample_every": 250, "sample_steps": _PREVIEW.steps, "sample_resolution": 512,
               "sample_guidance": FAMILY.guidance("wan2.1-i2v-14b").scale, "sample_frames": 17},
        save={"filename_prefix": "loras/wan21_i2v_lora"},
        downloads={  # as in ComfyUI's own Wan 2.1 image-to-video example
            _I2V21: _REPO + "diffusion_models/" + _I2V21,
            _UMT5: _REPO + "text_encoders/" + _UMT5,
            _CLIP_H: _REPO + "clip_vision/" + _CLIP_H,
            "wan_2.1_vae.safetensors": _REPO + "vae/wan_2.1_vae.safetensors",
        },
        download_folders={_CLIP_H: "clip_vision"},  # where ComfyUI keeps it (Cache Text Embeds lists it there too)
        note=(
            "Wan 2.1 I2V 14B image-to-video LoRA on 81-frame clips at 16 fps, buckets of about 624x624 pixels "
            "(832x480), on a 24 GB VRAM budget, planned for 32 GB of RAM. Smaller cards: vram_budget_gb 8 trains it in "
            "6.8 GB (measured on an H200, 18.8 s a step, 1.07x the resident step), but offloads every block's "
            "activations to pinned RAM: about 60 GB of RAM. The model sees each window's first frame "
            "twice: as its condition channels (the mask and one VAE encode of the first frame followed by grey "
            "frames) and as CLIP ViT-H's penultimate hidden state (257 x 1280) through its image cross-attention; "
            "the cache keeps both per window. Frame 0 stays in the loss, as the pipeline and other trainers do.\n\n"
            "Files (what ComfyUI's own Wan 2.1 image-to-video example uses):\n"
            f"- models/diffusion_models/{_I2V21} (or the 720p file). precision 'int8 slab' builds a slab once into "
            "models/slabs.\n"
            f"- models/text_encoders/{_UMT5} {_TOKENIZER}; models/clip_vision/{_CLIP_H} (text_encoder_2: the image "
            "encoder, told apart by its tensors); models/vae/wan_2.1_vae.safetensors.\n"
            + _CLIPS +
            "Samples: every 250 steps a 17-frame 512x512 clip per prompt, drawn from a first frame of the dataset "
            "(sample prompt line i from clip window i), CFG 5. The LoRA covers self- and cross-attention including "
            "the image cross-attention (Wan's own names: diffusion_model.blocks.N.cross_attn.k_img / v_img) and loads "
            "with ComfyUI's LoraLoaderModelOnly."),
    ),
]
