"""Rectified-flow (flow matching) training objective, as Flux, Z-Image and Lumina 2 were trained.

x_t = (1 - t) * x0 + t * noise, and the target is the velocity noise - x0. t is drawn logit-normal
(SD3/Flux), then shifted toward noise by the family's shift (Flux: resolution-dependent; Z-Image: a
static 3). Families whose model answers x0 - noise (``Prediction.sign`` = -1) or takes 1 - t are
handled by ``families.predict_velocity``, so the objective is written once. Latents may have any number of
dimensions after the batch (images (B, C, H, W); video (B, C, F, H, W)).

Beside the family's draw, other noise-level samplers (``draw_sigmas``) and loss weightings over noise levels
(``loss_weights``) that Loss & Validation Options choose; masked loss's weights (``mask_weights``, ``weighted_mse``).
"""
from __future__ import annotations

import math

import torch

from .loss_options import LOSS_WEIGHTINGS, TIMESTEP_SAMPLERS


def sample_sigmas(batch: int, generator: torch.Generator, mean: float = 0.0, std: float = 1.0,
                  mu: float | None = None, lo: float = 0.0, hi: float = 1.0) -> torch.Tensor:
    """(B,) noise levels in (0, 1); ``mu`` applies Flux's time shift e^mu / (e^mu + 1/t - 1). ``lo``/``hi``
    restrict the (shifted) result to that range with the same distribution inside it (a truncated logit-normal,
    drawn by inverse CDF: no rejection loop), for one expert of a mixture; the whole range draws as before."""
    if (lo, hi) == (0.0, 1.0):
        n = torch.randn(batch, generator=generator)
    else:
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"sigma range ({lo}, {hi}) must satisfy 0 <= lo < hi <= 1")
        shift = math.exp(mu) if mu is not None else 1.0

        def z_of(sigma: float) -> float:  # the standard-normal value whose shifted sigmoid is sigma
            if sigma <= 0.0:
                return -math.inf
            if sigma >= 1.0:
                return math.inf
            u = 1.0 / (1.0 + shift * (1.0 / sigma - 1.0))  # undo the shift
            return (math.log(u / (1.0 - u)) - mean) / std

        cdf = lambda z: 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))  # noqa: E731
        a, b = cdf(z_of(lo)), cdf(z_of(hi))
        p = (a + (b - a) * torch.rand(batch, generator=generator, dtype=torch.float64)).clamp(1e-12, 1 - 1e-12)
        n = (math.sqrt(2.0) * torch.erfinv(2.0 * p - 1.0)).float()
    u = torch.sigmoid(n * std + mean)
    u = u.clamp(1e-5, 1 - 1e-5)
    if mu is not None:
        u = math.exp(mu) / (math.exp(mu) + (1.0 / u - 1.0))
    if (lo, hi) != (0.0, 1.0):
        u = u.clamp(lo, hi)
    return u


def noisy_latents_and_target(latents: torch.Tensor, noise: torch.Tensor,
                             sigmas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_t, velocity target) for latents (B, ...) and sigmas (B,)."""
    s = sigmas.view((-1,) + (1,) * (latents.dim() - 1)).to(latents.dtype)
    return (1.0 - s) * latents + s * noise, noise - latents



def weighted_mse(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The mean over every element of ``weights * (pred - target)^2`` (fp32); ``weights`` (B, h, w) is a latent-grid
    mask, the same for every channel, or (B, F_lat, h, w) a clip's, per latent frame. Without weights, plain MSE."""
    err = (pred.float() - target.float()).square()
    if weights is None:
        return err.mean()
    return (err * _broadcast(weights, err)).mean()


def _broadcast(weights: torch.Tensor, err: torch.Tensor) -> torch.Tensor:
    """Latent-grid weights (B, h, w) or (B, F_lat, h, w) with a channel axis: (B, 1, h, w) / (B, 1, F_lat, h, w)."""
    return weights.float().view(weights.shape[0], *([1] * (err.dim() - weights.dim())), *weights.shape[1:])


def mask_weights(masks: torch.Tensor, latent_grid, unmasked_weight: float) -> torch.Tensor:
    """(B, H, W) uint8 pixel masks -> (B, h, w) loss weights on the latent grid (``latent_grid``: the latents' shape
    after the channels), or a clip's (B, F, H, W) -> (B, F_lat, h, w): ``unmasked_weight`` outside the mask, 1 inside
    (area resize, ``data.masks.latent_mask``; in time the VAE's grouping, ``data.clip_masks.latent_clip_mask``)."""
    from ..data.clip_masks import latent_clip_mask
    from ..data.masks import latent_mask

    grid = tuple(latent_grid)
    m = latent_clip_mask(masks, grid) if masks.dim() == 4 else latent_mask(masks, grid[-2:])
    return unmasked_weight + (1.0 - unmasked_weight) * m


def draw_sigmas(sampler: str, batch: int, generator: torch.Generator, mean: float = 0.0, std: float = 1.0,
                scale: float = 1.0, mu: float | None = None, lo: float = 0.0, hi: float = 1.0) -> torch.Tensor:
    """(B,) noise levels from ``sampler`` (``TIMESTEP_SAMPLERS``), restricted to [lo, hi] (an expert of a mixture)
    with the same distribution inside it. ``mu`` is the family's shift, used by ``shift`` only."""
    if sampler == "shift":
        return sample_sigmas(batch, generator, mean, std, mu, lo, hi)
    if sampler == "logit_normal":
        return sample_sigmas(batch, generator, mean, std, None, lo, hi)
    if sampler == "sigmoid":
        return sample_sigmas(batch, generator, 0.0, scale, None, lo, hi)
    if sampler == "uniform":
        u = torch.rand(batch, generator=generator)
        return (lo + (hi - lo) * u).clamp(max(lo, 1e-5), min(hi, 1 - 1e-5))
    raise ValueError(f"timestep sampler {sampler!r} is not one of {', '.join(TIMESTEP_SAMPLERS)}")


def loss_weights(scheme: str, sigmas: torch.Tensor, gamma: float = 5.0) -> torch.Tensor | None:
    """(B,) weights of each sample's loss at its noise level, or None for ``none``. ``min_snr``: the
    velocity-target form of min-SNR-gamma, min(SNR, gamma) x sigma^2 with SNR = ((1 - sigma) / sigma)^2 (the x0
    error is sigma times the velocity error, as sd-scripts' v-prediction form min(SNR, gamma) / (SNR + 1))."""
    s = sigmas.double()
    if scheme == "none":
        return None
    if scheme == "min_snr":
        snr = ((1.0 - s) / s) ** 2
        return (torch.minimum(snr, torch.full_like(snr, gamma)) * s ** 2).float()
    if scheme == "sigma_sqrt":
        return (s ** -2.0).float()
    if scheme == "cosmap":
        return (2.0 / (math.pi * (1.0 - 2.0 * s + 2.0 * s ** 2))).float()
    raise ValueError(f"loss weighting {scheme!r} is not one of {', '.join(LOSS_WEIGHTINGS)}")


def per_sample_mse(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) each sample's (masked) mean squared error: ``weighted_mse`` per sample."""
    err = (pred.float() - target.float()).square()
    if weights is not None:
        err = err * _broadcast(weights, err)
    return err.flatten(1).mean(1)
