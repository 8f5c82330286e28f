"""Rectified-flow (flow matching) training objective, as Flux, Z-Image and Lumina 2 were trained.

x_t = (1 - t) * x0 + t * noise, and the target is the velocity noise - x0. t is drawn logit-normal
(SD3/Flux), then shifted toward noise by the family's shift (Flux: resolution-dependent; Z-Image: a
static 3). Families whose model answers x0 - noise (``Prediction.sign`` = -1) or takes 1 - t are
handled by ``ModelFamily.predict_velocity``, so the objective is written once. Latents may have any number of
dimensions after the batch (images (B, C, H, W); video (B, C, F, H, W)).
"""
from __future__ import annotations

import math

import torch


def sample_sigmas(batch: int, generator: torch.Generator, mean: float = 0.0, std: float = 1.0,
                  mu: float | None = None) -> torch.Tensor:
    """(B,) noise levels in (0, 1); ``mu`` applies Flux's time shift e^mu / (e^mu + 1/t - 1)."""
    u = torch.sigmoid(torch.randn(batch, generator=generator) * std + mean)
    u = u.clamp(1e-5, 1 - 1e-5)
    if mu is not None:
        u = math.exp(mu) / (math.exp(mu) + (1.0 / u - 1.0))
    return u


def noisy_latents_and_target(latents: torch.Tensor, noise: torch.Tensor,
                             sigmas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_t, velocity target) for latents (B, ...) and sigmas (B,)."""
    s = sigmas.view((-1,) + (1,) * (latents.dim() - 1)).to(latents.dtype)
    return (1.0 - s) * latents + s * noise, noise - latents

