"""Plain configuration dataclasses for the engine.

Nodes and the CLI translate their widgets into these; the engine never sees a graph.
Each default is the one a first-time user should keep, with the reason beside it. A field a user sets carries its
help text once, in ``field(metadata={"help": ...})``; the nodes' tooltips read it (``field_help``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Optional

from .errors import ConfigError


def field_help(config_cls, name: str, extra: str = "") -> str:
    """The help text of one field of a config dataclass (``metadata["help"]``), with ``extra`` after it (what a
    node's widget adds: its own stand-in values, where it looks a path up)."""
    for f in fields(config_cls):
        if f.name == name:
            if "help" not in f.metadata:
                raise KeyError(f"{config_cls.__name__}.{name} has no help text; give it field(metadata={{'help': ...}})")
            return f.metadata["help"] + (" " + extra if extra else "")
    raise KeyError(f"{config_cls.__name__} has no field {name!r}")


def _require_finite(obj, names: tuple[str, ...]) -> None:
    """NaN passes every ``x < lo`` check, and JSON workflows can carry it: refuse it first."""
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ConfigError(f"{name}={value!r} must be a finite number")


@dataclass
class ModelConfig:
    """Where the base model comes from."""

    # A diffusers pipeline folder, its transformer/ subfolder, or a single-file
    # checkpoint with original BFL names (ComfyUI's models/diffusion_models/*.safetensors).
    transformer_path: str = ""
    # Family id from the registry ("flux1"); "auto" detects it from the files.
    family: str = "auto"
    # Diffusers pipeline folder holding text_encoder*/tokenizer*/vae (needed for caching).
    # Empty: use transformer_path when it is a pipeline folder.
    pipeline_path: str = ""
    # Compute dtype of the frozen base weights: bf16 halves memory; fp32 is for CPU tests.
    dtype: str = "auto"  # auto -> bf16 on CUDA, fp32 on CPU
    # Instead of a pipeline folder (Flux.1): single text-encoder files (clip_l / t5xxl .safetensors,
    # either order) and a VAE file (ae.safetensors); see engine/caching/single_files.py.
    text_encoder_files: tuple[str, ...] = ()
    vae_file: str = ""
    # Tokenizer folders to fall back on for single files, by kind ("clip_l", "t5xxl"); the ComfyUI
    # node passes ComfyUI's bundled ones.
    tokenizer_dirs: Optional[dict] = None

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bf16", "fp16", "fp32"):
            raise ConfigError(f"dtype={self.dtype!r} is not one of auto, bf16, fp16, fp32")


@dataclass
class DataConfig:
    """A folder of images with same-stem .txt captions."""

    path: str = field(default="", metadata={"help": (
        "Folder of images (png/jpg/webp; for Wan also clips: mp4/webm/mov/gif/webp or folders of frames) with "
        "same-name .txt captions."
    )})
    resolution: int = field(default=1024, metadata={"help": (
        "Training resolution. Images go to aspect-ratio buckets of about this many pixels squared. 1024 is Flux's "
        "native size; 512 trains ~3x faster."
    )})
    trigger_word: str = field(default="", metadata={"help": (
        "Prepended to every caption, e.g. 'ohwx', so the LoRA learns a handle. Use it in prompts to call the LoRA."
    )})
    default_caption: Optional[str] = field(default=None, metadata={"help": (
        "Caption for images without a .txt file. Empty: such images are an error listing them (safer than "
        "training on a missing caption)."
    )})
    repeats: int = field(default=1, metadata={"help": (
        "How often each image appears per epoch; balances several datasets."
    )})
    bucket_step: int = field(default=64, metadata={"help": (
        "Bucket sides are multiples of this: the VAE's /8 then 2x2 packing needs 16; 64 is safer."
    )})
    max_aspect: float = field(default=2.0, metadata={"help": (
        "Widest aspect ratio a bucket may have (long side / short side)."
    )})
    flip: bool = field(default=False, metadata={"help": (
        "Also cache mirrored images and use one at random. Off for text, logos, faces with asymmetric features."
    )})
    caption_extension: str = field(default=".txt", metadata={"help": "The extension of the caption files."})

    def __post_init__(self) -> None:
        if self.resolution < 64 or self.resolution % 16:
            raise ConfigError(f"resolution={self.resolution} must be >= 64 and a multiple of 16")
        if self.repeats < 1:
            raise ConfigError(f"repeats={self.repeats} must be >= 1")
        if self.bucket_step < 16 or self.bucket_step % 16:
            raise ConfigError(f"bucket_step={self.bucket_step} must be a multiple of 16")
        if self.max_aspect < 1.0:
            raise ConfigError(f"max_aspect={self.max_aspect} must be >= 1.0")


#: Adapter types, one handler file each in engine/lora_io/adapters/ (a test checks the two agree). Here, torch-free,
#: because the config (layer 0) checks the choice before anything loads.
ADAPTER_TYPES = ("lora", "loha", "lokr", "dora")


@dataclass
class AdapterConfig:
    """Which kind of adapter trains (the LoRA Adapter node's settings). Rank and alpha stay on Train LoRA."""

    type: str = field(default="lora", metadata={"help": (
        "lora: B @ A, rank r (the default; loads everywhere). loha: LoHa, (A1 @ B1) * (A2 @ B2), a Hadamard product "
        "of two rank-r pairs: rank up to r^2 for 2x LoRA's weights. lokr: LoKr, kron(W1, W2): very few weights, "
        "its size set by lokr_factor (rank only matters where W2 is decomposed). dora: LoRA plus a trained "
        "magnitude per output row (DoRA); about 1.3x LoRA's step time. loha/lokr/dora are saved in ComfyUI's "
        "format only (diffusers has no loader for LoHa/LoKr)."
    )})
    lokr_factor: int = field(default=-1, metadata={"help": (
        "LoKr only: how each side of a layer is split for the Kronecker product (W1 is about factor x factor). "
        "-1 = the most balanced split (smallest file); 4-16 gives W1 more room. Ignored by other types."
    )})
    lokr_decompose_both: bool = field(default=False, metadata={"help": (
        "LoKr only: also split W1 into a rank-r pair (W1 is already small, so this rarely saves anything). "
        "Ignored by other types."
    )})

    continue_from: str = field(default="", metadata={"help": (
        "A LoRA file to start from instead of a fresh adapter: ours (any type), or a LoRA in kohya / musubi, "
        "diffusers / ai-toolkit or ComfyUI-native names for this model's family. Its type, rank and modules must "
        "be this run's (a mismatch is refused, naming it). A DoRA continues from its diffusers-format file, which "
        "holds peft's magnitude. Empty: a fresh adapter."
    )})

    ema_decay: float = field(default=0.0, metadata={"help": (
        "Keep an exponential moving average of the adapter weights (ema = decay * ema + (1 - decay) * weights after "
        "every step): smoother results. Save LoRA writes it as its own file beside the plain one "
        "(<name>_ema.safetensors). 0 = off; 0.99-0.999 is usual (the average spans about 1 / (1 - decay) steps, so "
        "keep it well below the step count). Kept beside the weights on their device (4 bytes per weight), or in "
        "pinned host RAM with the AdamW moments when the plan keeps those there (optimizer_on_host); in the resume "
        "state."
    )})
    ema_previews: bool = field(default=True, metadata={"help": (
        "With ema_decay set: previews (sample_every) draw with the EMA weights, and Train LoRA's lora_model output "
        "applies them; off: the last weights. Both files are saved either way. Ignored without EMA."
    )})
    snapshot_every: int = field(default=0, metadata={"help": (
        "Every N steps, save a loadable LoRA file (the same format as Save LoRA's comfyui, named with its step) in "
        "output/loras/snapshots/<run>/, to compare steps or keep one. 0 = off. Does not change the result."
    )})
    snapshot_keep: int = field(default=3, metadata={"help": (
        "How many of the latest snapshots to keep (older ones of the same run are deleted); 0 = keep all."
    )})
    snapshot_dir: str = field(default="", metadata={"help": (
        "Where snapshots go (the node sets output/loras/snapshots); each run writes into a new sub-folder."
    )})

    def __post_init__(self) -> None:
        _require_finite(self, ("ema_decay",))
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"ema_decay={self.ema_decay} must be in [0, 1); 0 = off, 0.999 is usual")
        if self.snapshot_every < 0 or self.snapshot_keep < 0:
            raise ConfigError(f"snapshot_every={self.snapshot_every} and snapshot_keep={self.snapshot_keep} must be "
                              f">= 0 (0 = off / keep all)")
        if self.type not in ADAPTER_TYPES:
            raise ConfigError(f"adapter type={self.type!r} is not one of {', '.join(ADAPTER_TYPES)}")
        if self.lokr_factor == 0 or self.lokr_factor < -1:
            raise ConfigError(f"lokr_factor={self.lokr_factor} must be -1 (balanced) or a positive factor")
        if self.type != "lokr":  # settings of another type neither matter nor change the run's identity
            self.lokr_factor, self.lokr_decompose_both = -1, False
        if not self.ema_decay:  # the same for the EMA's preview choice without an EMA
            self.ema_previews = True


@dataclass
class LoraSettings:
    """Shape of the adapter."""

    rank: int = field(default=16, metadata={"help": (
        "LoRA rank: capacity and file size. 16 suits most subjects; 32-64 for styles."
    )})
    alpha: float = field(default=16.0, metadata={"help": (
        "LoRA alpha; the update is scaled by alpha/rank. Equal to rank = scale 1, which every loader agrees on."
    )})
    dropout: float = field(default=0.0, metadata={"help": "peft's lora_dropout (on the LoRA's input); 0 = none."})
    target_modules: Optional[list[str]] = field(default=None, metadata={"help": (
        "Module names the LoRA attaches to; None = the family's attention and projection set."
    )})
    adapter: AdapterConfig = field(default_factory=AdapterConfig, metadata={"help": (
        "The adapter type and its own settings (the LoRA Adapter node); plain LoRA when not given."
    )})

    def __post_init__(self) -> None:
        if isinstance(self.adapter, dict):  # from asdict() (a data-parallel worker's spec, a stored run)
            self.adapter = AdapterConfig(**self.adapter)
        _require_finite(self, ("alpha", "dropout"))
        if self.rank < 1:
            raise ConfigError(f"rank={self.rank} must be >= 1")
        if self.alpha <= 0:
            raise ConfigError(f"alpha={self.alpha} must be > 0")


OPTIMIZERS = ("adamw", "adamw8bit")
#: How int8 slab layers multiply (engine/slab/w8a8.py), an OffloadConfig option. Here, torch-free and below
#: both, because the slab kernels (layer 3) check it and the offload config (layer 4) offers it.
INT8_COMPUTE_MODES = ("dequant", "w8a8", "fp8")


@dataclass
class TrainConfig:
    """The optimisation loop."""

    steps: int = field(default=1000, metadata={"help": "Optimizer steps. 500-2000 is typical for a subject or style."})
    learning_rate: float = field(default=1e-4, metadata={"help": (
        "AdamW learning rate. 1e-4 is a safe start for Flux LoRAs."
    )})
    batch_size: int = field(default=1, metadata={"help": (
        "Images per micro-batch (same aspect bucket). More uses more VRAM."
    )})
    gradient_accumulation: int = field(default=1, metadata={"help": (
        "Micro-batches per optimizer step: a larger effective batch without more VRAM."
    )})
    lr_scheduler: str = field(default="constant", metadata={"help": (
        "constant: flat after warmup; cosine: decays to 0."
    )})
    warmup_steps: int = field(default=0, metadata={"help": "Steps of linear learning-rate warmup at the start."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping; 0 disables it."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay of the LoRA weights."})
    seed: int = field(default=42, metadata={"help": (
        "Seeds LoRA init, noise, timesteps and data order: same seed, same run."
    )})
    guidance: float = field(default=1.0, metadata={"help": (
        "Guidance value fed to guidance-distilled models (Flux.1-dev, Flux.2-dev) while training; 1.0 is the usual "
        "recipe. Ignored by models without a guidance embedding (schnell, Flux.2 klein)."
    )})
    timestep_mean: float = field(default=0.0, metadata={"help": (
        "Mean of the logit-normal timestep sampling (SD3/Flux), before the family's resolution-dependent shift."
    )})
    timestep_std: float = field(default=1.0, metadata={"help": "Standard deviation of the logit-normal timesteps."})
    shift_timesteps: bool = field(default=True, metadata={"help": (
        "Apply the family's resolution-dependent shift (Flux's mu) to the sampled timesteps."
    )})
    device: str = field(default="auto", metadata={"help": "auto: cuda if available, else cpu."})
    optimizer: str = field(default="adamw", metadata={"help": (
        "adamw: fp32 optimizer state (16 bytes per LoRA weight with its gradient); fastest. adamw8bit: torchao's "
        "8-bit moments (~10 bytes): 0.28 GB less VRAM for a Flux.1 r16 LoRA at the same speed (one step over all "
        "LoRA weights at once: 0.98x adamw's step time, H100, 1024). Its first step compiles for a few seconds. "
        "CUDA only."
    )})
    save_every: int = field(default=0, metadata={"help": (
        "Save a resumable training state every N steps (0: about 10 per run, at most every 250 steps; -1: never). "
        "Stopping (Cancel, Ctrl-C) also saves one, and running the same graph again resumes from the latest. Does "
        "not change the result, so it is not part of the run's identity."
    )})

    def __post_init__(self) -> None:
        _require_finite(self, ("learning_rate", "max_grad_norm", "weight_decay", "guidance",
                               "timestep_mean", "timestep_std"))
        if self.save_every < -1:
            raise ConfigError(f"save_every={self.save_every} must be -1 (never), 0 (auto) or a step count")
        if self.steps < 1:
            raise ConfigError(f"steps={self.steps} must be >= 1")
        if self.learning_rate <= 0:
            raise ConfigError(f"learning_rate={self.learning_rate} must be > 0")
        if self.batch_size < 1 or self.gradient_accumulation < 1:
            raise ConfigError("batch_size and gradient_accumulation must be >= 1")
        if self.lr_scheduler not in ("constant", "cosine"):
            raise ConfigError(f"lr_scheduler={self.lr_scheduler!r} is not one of constant, cosine")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer={self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if self.warmup_steps < 0 or self.warmup_steps >= self.steps and self.warmup_steps > 0:
            raise ConfigError(f"warmup_steps={self.warmup_steps} must be in [0, steps)")
