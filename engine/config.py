"""Plain configuration dataclasses for the engine.

Nodes and the CLI translate their widgets into these; the engine never sees a graph.
Each default is the one a first-time user should keep, with the reason beside it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .errors import ConfigError


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

    path: str = ""
    # Target side length; buckets keep about resolution**2 pixels at other aspect ratios.
    resolution: int = 1024
    # Prepended to every caption ("ohwx, a photo of ..."), so the LoRA learns a handle.
    trigger_word: str = ""
    # Used for images with no .txt; None makes a missing caption an error (safer).
    default_caption: Optional[str] = None
    # How many times each image appears per epoch (balances small datasets).
    repeats: int = 1
    # Bucket sides are multiples of this (VAE /8 then 2x2 packing needs 16; 64 is safer).
    bucket_step: int = 64
    # Widest aspect ratio a bucket may have (long side / short side).
    max_aspect: float = 2.0
    # Also cache a horizontally flipped latent and pick one of the two at random.
    flip: bool = False
    caption_extension: str = ".txt"

    def __post_init__(self) -> None:
        if self.resolution < 64 or self.resolution % 16:
            raise ConfigError(f"resolution={self.resolution} must be >= 64 and a multiple of 16")
        if self.repeats < 1:
            raise ConfigError(f"repeats={self.repeats} must be >= 1")
        if self.bucket_step < 16 or self.bucket_step % 16:
            raise ConfigError(f"bucket_step={self.bucket_step} must be a multiple of 16")
        if self.max_aspect < 1.0:
            raise ConfigError(f"max_aspect={self.max_aspect} must be >= 1.0")


@dataclass
class LoraSettings:
    """Shape of the adapter."""

    rank: int = 16
    # Scale = alpha / rank. alpha == rank gives scale 1, which every loader agrees on.
    alpha: float = 16.0
    dropout: float = 0.0
    # "default" = the family's attention + projection set; or explicit module names.
    target_modules: Optional[list[str]] = None

    def __post_init__(self) -> None:
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

    steps: int = 1000
    learning_rate: float = 1e-4
    batch_size: int = 1
    gradient_accumulation: int = 1
    lr_scheduler: str = "constant"  # constant | cosine
    warmup_steps: int = 0
    max_grad_norm: float = 1.0  # 0 disables clipping
    weight_decay: float = 0.0
    seed: int = 42
    # Flux.1-dev is guidance-distilled; training at guidance 1.0 is the common recipe.
    guidance: float = 1.0
    # Logit-normal timestep sampling (SD3/Flux), then Flux's resolution-dependent shift.
    timestep_mean: float = 0.0
    timestep_std: float = 1.0
    shift_timesteps: bool = True
    device: str = "auto"  # auto -> cuda if available, else cpu
    # adamw: fp32 moments (8 bytes per LoRA weight). adamw8bit: torchao's 8-bit moments
    # (2 bytes): 0.28 GB less VRAM for Flux.1 r16 but ~0.5 s/step slower (its per-tensor
    # step over ~1000 LoRA tensors, H100); CUDA only.
    optimizer: str = "adamw"
    # Write a resumable state every N steps (0: about 10 per run, see train/resume.py;
    # -1: never). Does not change the result, so it is not part of the run's identity.
    save_every: int = 0

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
