"""What a user sets about samples during training (``SamplingConfig``), each setting with its help text."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config import field_help
from ..errors import ConfigError


@dataclass
class SamplingConfig:
    every: int = field(default=0, metadata={"help": (
        "Sample the prompts every N optimizer steps (and after the last step); 0 = no sampling. The prompts "
        "come from Cache Text Embeds' sample_prompts."
    )})
    steps: int = field(default=20, metadata={"help": "Euler steps per sample image (20 is enough to judge a LoRA)."})
    resolution: int = field(default=512, metadata={"help": (
        "Side of the square sample images, a multiple of 16. At or below the training resolution sampling "
        "needs no more VRAM than training."
    )})
    seed: int = field(default=42, metadata={"help": (
        "Noise seed of the samples: fixed, so every checkpoint's images are comparable."
    )})
    at_start: bool = field(default=True, metadata={"help": (
        "Also sample before the first step (the base model), so the LoRA's effect is visible."
    )})
    frames: int = field(default=17, metadata={"help": (
        "Frames of each sample clip for video models (Wan: 4k + 1; 17 is about a second at 16 fps). Every "
        "checkpoint's clip is saved as an animated WebP; the grid shows its first frame and a strip of frames. "
        "Image models draw one image."
    )})
    guidance: float = field(default=3.5, metadata={"help": (
        "Guidance of the samples: the guidance embedding's value for guidance-distilled models (Flux.1-dev 3.5, "
        "Flux.2-dev 4); the classifier-free guidance scale for models sampled with it (Z-Image Base, Lumina 2, "
        "Flux.2 klein base: 4; a second forward per step on the empty prompt); ignored by models with neither "
        "(schnell, the distilled klein, Z-Image Turbo)."
    )})

    def __post_init__(self) -> None:
        for name in ("every", "steps", "resolution", "seed", "frames"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"sample {name}={v!r} must be a whole number >= 0")
        if not isinstance(self.guidance, (int, float)) or not math.isfinite(self.guidance) or self.guidance < 0:
            raise ConfigError(f"sample guidance={self.guidance!r} must be a finite number >= 0")
        if self.every and self.frames < 1:
            raise ConfigError(f"sample frames={self.frames} must be at least 1")
        if self.every and (self.steps < 1 or self.resolution < 64 or self.resolution % 16):
            raise ConfigError(f"sampling needs steps >= 1 (got {self.steps}) and a resolution >= 64 that is a "
                              f"multiple of 16 (got {self.resolution})")

    @property
    def enabled(self) -> bool:
        return self.every > 0


def help_text(name: str) -> str:
    return field_help(SamplingConfig, name)
