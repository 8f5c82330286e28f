"""Loss & Validation Options: how the training loss is weighted, how validation is measured, what is logged.

Torch-free (the node and the CLI build it cheaply). Each field carries its help text once; the "Loss & Validation
Options" node's tooltips read it. What changes the trained weights (``unmasked_weight``) is part of the run's
identity (``result_key_settings``); validation and logs only watch the run, so they are not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import ConfigError


@dataclass
class LossOptions:
    """Optional controls of Train LoRA's loss, validation and logs (the "Loss & Validation Options" node)."""

    unmasked_weight: float = field(default=0.0, metadata={"help": (
        "Masked loss (Dataset Options' mask_source): how much the loss outside the mask counts, 0..1. 0: only the "
        "masked area trains; 1: the mask has no effect. The loss is the mean over every latent element of "
        "weight x squared error (sd-scripts' rule: a small mask gives a small loss)."
    )})
    validation_every: int = field(default=0, metadata={"help": (
        "With a validation split (Dataset Options), measure the loss on it every N steps (0: about 20 times per "
        "run, and after the last step; -1: never). Measured at fixed timesteps with fixed noise, so the curve is "
        "comparable from step to step; drawn on the live chart beside the training loss."
    )})
    validation_timesteps: int = field(default=4, metadata={"help": (
        "Noise levels each validation image is measured at, evenly spread over (0, 1) (the mid-points of as many "
        "equal intervals). More gives a smoother curve and costs one forward pass each."
    )})
    tensorboard: bool = field(default=True, metadata={"help": (
        "Also write TensorBoard event files (needs the optional 'tensorboard' package: pip install tensorboard). "
        "Without it the run goes on and says so; the CSV log is always written."
    )})

    def __post_init__(self) -> None:
        w = self.unmasked_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or not 0.0 <= w <= 1.0:
            raise ConfigError(f"unmasked_weight={w!r} must be a number in [0, 1]")
        if self.validation_every < -1:
            raise ConfigError(f"validation_every={self.validation_every} must be -1 (never), 0 (auto) or a step count")
        if not 1 <= self.validation_timesteps <= 64:
            raise ConfigError(f"validation_timesteps={self.validation_timesteps} must be between 1 and 64")

    def validation_interval(self, steps: int) -> int:
        """Steps between validations (0: never)."""
        if self.validation_every < 0:
            return 0
        return self.validation_every or max(1, steps // 20)

    def result_key_settings(self) -> dict:
        """The settings that change the trained weights (into the run's key); empty when all are the defaults,
        so a run without options keeps its key."""
        return {"unmasked_weight": self.unmasked_weight} if self.unmasked_weight != 0.0 else {}
