"""``NoiseSchedule``: where on the noise path a family trains and samples, and how its model is asked.

Training noises ``x_sigma = (1 - sigma) x0 + sigma noise`` and regresses the velocity ``noise - x0`` everywhere
(engine/train/flow_matching.py); a family's schedule says how the sigmas are drawn (the exponential timestep shift
``train_shift_mu``, the range ``train_sigma_range``), which sigmas its pipeline steps through when sampling previews
(``sample_shift_mu``, ``sample_sigmas``), the partner expert of a mixture (``preview_partner``), and the model's
convention (``prediction``: the timestep it is given, the sign of its output).

Static shifts are declared as data (``train_shift``, ``sample_shift``); a family whose shift depends on the
resolution or whose pipeline stretches its sigmas subclasses it in its folder and overrides the methods.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Prediction:
    """How a family's transformer is asked and what it answers (new-families-facts §0).

    Training noises ``x_sigma = (1 - sigma) x0 + sigma noise`` and regresses the velocity
    ``noise - x0`` everywhere; the family says how that maps onto its model:
    ``timestep``: what the model is given, ``sigma`` (Flux, Qwen-Image; the model scales by 1000
    inside), ``one_minus_sigma`` (Z-Image, Lumina 2) or ``sigma_x1000`` (Wan);
    ``sign``: +1 when the output is the velocity, -1 when it is ``x0 - noise`` (Z-Image, Lumina 2).
    """

    timestep: str = "sigma"
    sign: float = 1.0

    def model_timestep(self, sigmas: torch.Tensor) -> torch.Tensor:
        if self.timestep == "sigma":
            return sigmas
        if self.timestep == "one_minus_sigma":
            return 1.0 - sigmas
        if self.timestep == "sigma_x1000":
            return sigmas * 1000.0
        raise ValueError(f"unknown timestep convention {self.timestep!r}")


def sigma_schedule(steps: int, mu: float) -> list[float]:
    """The sampling sigmas of the families' pipelines (FlowMatchEulerDiscreteScheduler): ``linspace(1, 1/steps,
    steps)`` under the exponential time shift ``exp(mu) / (exp(mu) + 1/sigma - 1)``, then 0."""
    base = [1.0 - i * (1.0 - 1.0 / steps) / max(steps - 1, 1) for i in range(steps)] if steps > 1 else [1.0]
    return [math.exp(mu) / (math.exp(mu) + (1.0 / s - 1.0)) for s in base] + [0.0]


def static_shift_mu(shift: float) -> float:
    """A static shift s (sigma' = s sigma / (1 + (s - 1) sigma)) as the exponential shift's mu = ln s."""
    return math.log(shift)


@dataclass(frozen=True)
class NoiseSchedule:
    """A family's noise schedule and prediction convention (see the module doc)."""

    prediction: Prediction = Prediction()
    #: The static shift s training samples under (mu = ln s; 1: no shift). None: the subclass's ``train_shift_mu``
    #: (a resolution-dependent shift).
    train_shift: float | None = None
    #: The static shift the family's pipeline samples with. None: the training shift (``train_shift_mu``).
    sample_shift: float | None = None
    #: How training draws its noise levels unless Loss & Validation Options say otherwise
    #: (``flow_matching.TIMESTEP_SAMPLERS``): every family today trains as SD3/Flux do, logit-normal under its shift.
    train_sampling: str = "shift"
    #: The loss weighting over noise levels unless Loss & Validation Options say otherwise
    #: (``flow_matching.LOSS_WEIGHTINGS``): none, the plain velocity MSE, for every family's reference trainer.
    loss_weighting: str = "none"

    def __post_init__(self) -> None:
        # Checked where the family declares its schedule (import time), not at the first training step.
        if self.train_shift is None and type(self).train_shift_mu is NoiseSchedule.train_shift_mu:
            raise TypeError(f"{type(self).__name__} sets no train_shift and does not override train_shift_mu; "
                            f"declare one of them")

    def train_shift_mu(self, latents: torch.Tensor) -> float:
        """The exponential timestep shift training samples with (``flow_matching.sample_sigmas``)."""
        return static_shift_mu(self.train_shift)

    def train_sigma_range(self, variant: str) -> tuple[float, float]:
        """The noise levels (after the shift) training draws from, ``(lo, hi)``: the whole ``(0, 1)`` for a
        model that denoises everything; one expert of a mixture (Wan 2.2 A14B's high- and low-noise models)
        only ever sees its own range when sampling, so it trains on that range alone."""
        return (0.0, 1.0)

    def preview_partner(self, variant: str) -> tuple[str, float] | None:
        """For one expert of a mixture: ``(the other expert's variant, the boundary sigma)``; None for a model that
        denoises the whole path alone. A preview then samples with both (``engine/sampling/``): sigma >= boundary
        through the high-noise expert, below it through the low-noise one, each with its own guidance scale
        (``ModelFamily.guidance``), as the family's pipeline does."""
        return None

    def sample_shift_mu(self, latents: torch.Tensor, steps: int) -> float:
        """The shift the family's pipeline samples with at ``steps`` steps."""
        if self.sample_shift is not None:
            return static_shift_mu(self.sample_shift)
        return self.train_shift_mu(latents)

    def sample_sigmas(self, latents: torch.Tensor, steps: int) -> list[float]:
        """The ``steps`` + 1 noise levels previews step through (the last is 0), as the family's pipeline
        schedules them; by default ``sigma_schedule`` under ``sample_shift_mu``."""
        return sigma_schedule(steps, self.sample_shift_mu(latents, steps))
