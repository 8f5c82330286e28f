"""Loss & Validation Options: how the training loss is weighted, how validation is measured, what is logged.

Torch-free (the node and the CLI build it cheaply). Each field carries its help text once; the "Loss & Validation
Options" node's tooltips read it. What changes the trained weights (``unmasked_weight``) is part of the run's
identity (``result_key_settings``); validation and logs only watch the run, so they are not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import ConfigError

#: Noise-level samplers (``flow_matching.draw_sigmas``): ``shift`` logit-normal(mean, std) under the family's shift
#: (SD3/Flux); ``logit_normal`` the same without a shift; ``uniform`` U(0, 1); ``sigmoid`` sigmoid(scale x N(0, 1))
#: (sd-scripts' ``--timestep_sampling sigmoid``). "family" here means the family's ``NoiseSchedule.train_sampling``.
TIMESTEP_SAMPLERS = ("shift", "logit_normal", "uniform", "sigmoid")
#: Loss weightings over noise levels (``flow_matching.loss_weights``): ``none``; ``min_snr`` min-SNR-gamma (Hang et
#: al. 2023) for the velocity target; ``sigma_sqrt`` and ``cosmap`` as SD3 / diffusers' ``compute_loss_weighting_for_sd3``.
LOSS_WEIGHTINGS = ("none", "min_snr", "sigma_sqrt", "cosmap")


@dataclass
class LossOptions:
    """Optional controls of Train LoRA's loss, validation and logs (the "Loss & Validation Options" node)."""

    unmasked_weight: float = field(default=0.0, metadata={"help": (
        "Masked loss (Dataset Options' mask_source): how much the loss outside the mask counts, 0..1. 0: only the "
        "masked area trains; 1: the mask has no effect. The loss is the mean over every latent element of "
        "weight x squared error (sd-scripts' rule: a small mask gives a small loss)."
    )})
    reg_ratio: float = field(default=0.5, metadata={"help": (
        "With regularization images (Dataset Options' reg_folder): the share of micro-batches drawn from them, "
        "interleaved evenly (0.5: every other one; 0.25: one in four). 0 leaves them out."
    )})
    prior_loss_weight: float = field(default=1.0, metadata={"help": (
        "With regularization images: the weight of their loss against the dataset's (sd-scripts' "
        "prior_loss_weight)."
    )})
    preservation_weight: float = field(default=0.0, metadata={"help": (
        "Differential output preservation (needs Dataset Options' preservation_prompt, e.g. 'a photo of a woman'): "
        "each step also runs the class prompt on the same noisy images with the adapter off (the base model's "
        "answer) and on, and adds this weight x their squared difference to the loss, so the LoRA leaves the class "
        "as the base model draws it. 0: off. Costs one forward without the adapter and one forward + backward more "
        "per step (about 2.3x the step time)."
    )})
    first_frame_p: float = field(default=1.0, metadata={"help": (
        "Image-to-video training with the first frame held (LTX-2 with Cache Text Embeds' image_to_video on): the "
        "share of clips trained as image-to-video, drawn anew for each clip of each step; the others train as "
        "text-to-video (frame 0 noised and in the loss), so one LoRA learns both. 1: every clip (the default); "
        "Lightricks' own image-to-video recipe uses 0.5 (its first_frame_conditioning_p). Models without a held "
        "first frame refuse a value below 1."
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
    timestep_sampling: str = field(default="family", metadata={"help": (
        "How each step draws its noise level. family: the model family's own recipe (logit-normal under its "
        "shift for every family here). shift: logit-normal(logit_mean, logit_std) under the family's shift "
        "(Flux: resolution-dependent; Z-Image: 3). logit_normal: the same without the shift. uniform: evenly over "
        "(0, 1). sigmoid: sigmoid(sigmoid_scale x a normal draw), as sd-scripts."
    )})
    logit_mean: float = field(default=0.0, metadata={"help": (
        "shift / logit_normal sampling: the mean of the normal draw before the sigmoid; above 0 trains noisier."
    )})
    logit_std: float = field(default=1.0, metadata={"help": "shift / logit_normal sampling: its standard deviation."})
    sigmoid_scale: float = field(default=1.0, metadata={"help": "sigmoid sampling: the scale of the normal draw."})
    loss_weighting: str = field(default="family", metadata={"help": (
        "How the loss of each noise level is weighted. family: the family's own (none for every family here). "
        "none: plain MSE of the velocity. min_snr: min-SNR-gamma for the velocity target, min(SNR, gamma) x "
        "sigma^2 (damps the low-noise steps). sigma_sqrt, cosmap: SD3's weightings (diffusers' "
        "compute_loss_weighting_for_sd3)."
    )})
    snr_gamma: float = field(default=5.0, metadata={"help": "min_snr weighting: gamma (5 in the paper)."})
    tensorboard: bool = field(default=True, metadata={"help": (
        "Also write TensorBoard event files (needs the optional 'tensorboard' package: pip install tensorboard). "
        "Without it the run goes on and says so; the CSV log is always written."
    )})

    def __post_init__(self) -> None:
        w = self.unmasked_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or not 0.0 <= w <= 1.0:
            raise ConfigError(f"unmasked_weight={w!r} must be a number in [0, 1]")
        p = self.first_frame_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or not 0.0 <= p <= 1.0:
            raise ConfigError(f"first_frame_p={p!r} must be a number in [0, 1]")
        for name in ("reg_ratio", "prior_loss_weight", "preservation_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name}={value!r} must be a finite number >= 0")
        if self.reg_ratio >= 1:
            raise ConfigError(f"reg_ratio={self.reg_ratio} must be below 1: at 1 no step would train on the dataset")
        if self.timestep_sampling not in ("family",) + TIMESTEP_SAMPLERS:
            raise ConfigError(f"timestep_sampling={self.timestep_sampling!r} is not one of family, "
                              f"{', '.join(TIMESTEP_SAMPLERS)}")
        if self.loss_weighting not in ("family",) + LOSS_WEIGHTINGS:
            raise ConfigError(f"loss_weighting={self.loss_weighting!r} is not one of family, {', '.join(LOSS_WEIGHTINGS)}")
        for name in ("logit_mean", "logit_std", "sigmoid_scale", "snr_gamma"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{name}={value!r} must be a finite number")
        if self.logit_std <= 0 or self.sigmoid_scale <= 0 or self.snr_gamma <= 0:
            raise ConfigError("logit_std, sigmoid_scale and snr_gamma must be > 0")
        if self.validation_every < -1:
            raise ConfigError(f"validation_every={self.validation_every} must be -1 (never), 0 (auto) or a step count")
        if not 1 <= self.validation_timesteps <= 64:
            raise ConfigError(f"validation_timesteps={self.validation_timesteps} must be between 1 and 64")

    def is_reg(self, index: int) -> bool:
        """Whether micro-batch ``index`` (0-based, global) is drawn from the regularization images: the ratio
        spread evenly, floor((i + 1) r) > floor(i r), a pure function of the index (a resumed run draws the same)."""
        r = self.reg_ratio
        return math.floor((index + 1) * r + 1e-9) > math.floor(index * r + 1e-9)

    def validation_interval(self, steps: int) -> int:
        """Steps between validations (0: never)."""
        if self.validation_every < 0:
            return 0
        return self.validation_every or max(1, steps // 20)

    def result_key_settings(self) -> dict:
        """The settings that change the trained weights (into the run's key): those not at their defaults, so a
        run without options keeps its key."""
        defaults = LossOptions()
        return {name: getattr(self, name) for name in _WEIGHT_SETTINGS if getattr(self, name) != getattr(defaults, name)}

    def sampler(self, schedule) -> tuple[str, bool]:
        """(the sampler to draw with, whether it is the family's default draw, which TrainConfig's timestep_mean,
        timestep_std and shift_timesteps govern)."""
        if self.timestep_sampling == "family":
            return schedule.train_sampling, True
        return self.timestep_sampling, False

    def weighting(self, schedule) -> str:
        return schedule.loss_weighting if self.loss_weighting == "family" else self.loss_weighting


#: The fields that change the trained weights (validation and logs only watch).
_WEIGHT_SETTINGS = ("unmasked_weight", "reg_ratio", "prior_loss_weight", "preservation_weight", "timestep_sampling", "logit_mean", "logit_std", "sigmoid_scale",
                    "loss_weighting", "snr_gamma")
