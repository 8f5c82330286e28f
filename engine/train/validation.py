"""Validation loss: the flow-matching loss on the held-out split, at fixed timesteps with fixed noise.

Every validation measures the same thing, so the curve moves only because the LoRA did: each held-out item is
noised at ``K = validation_timesteps`` noise levels, the mid-points ``(k + 0.5) / K`` of K equal intervals of the
model's range (an expert of a mixture: its own range), never shifted or drawn; the noise of item ``i`` at level
``k`` comes from ``torch.Generator().manual_seed(seed + i * K + k)`` (``seed``: the run's). No flip; a masked
dataset's masks apply as in training. One row per forward, without gradients, so it never needs more memory
than a training step.
"""
from __future__ import annotations

import time

import torch

from ..families import predict_velocity
from ..families.specs import held_weights
from .flow_matching import mask_weights, noisy_latents_and_target, weighted_mse


def fixed_sigmas(count: int, sigma_range: tuple[float, float] = (0.0, 1.0)) -> list[float]:
    lo, hi = sigma_range
    return [lo + (hi - lo) * (k + 0.5) / count for k in range(count)]


def fixed_noise(shape, seed: int, item: int, level: int, levels: int) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed + item * levels + level))


class Validator:
    """The validation loss of one run's held-out items (``dataset.validation_items``)."""

    def __init__(self, dataset, family, levels: int, seed: int, guidance: float, unmasked_weight: float = 0.0,
                 sigma_range: tuple[float, float] = (0.0, 1.0)):
        self.dataset, self.family, self.seed, self.guidance = dataset, family, seed, guidance
        self.items = list(dataset.validation_items)
        self.sigmas = fixed_sigmas(levels, sigma_range)
        self.unmasked_weight = unmasked_weight
        self.seconds = 0.0
        self.history: list[tuple[int, float]] = []  # (step, validation loss)

    @torch.no_grad()
    def run(self, model, device, dtype, autocast, step: int) -> float:
        """The mean loss over every held-out item and fixed noise level, recorded at ``step``."""
        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        total, count = 0.0, 0
        try:
            for i, item in enumerate(self.items):
                lat, emb = self.dataset.load_item(item)
                latents = lat[None].to(device, dtype)  # (1, C, ...)
                embeds = {k: v.to(device, dtype) if v.is_floating_point() else v.to(device)
                          for k, v in self.dataset.collate_text([emb]).items()}
                mask = self.dataset.load_mask(item)
                weights = (mask_weights(mask[None], latents.shape[2:], self.unmasked_weight).to(device)
                           if mask is not None else None)
                weights = held_weights(embeds, latents, weights)  # a held first frame is out of the loss
                for k, sigma in enumerate(self.sigmas):
                    noise = fixed_noise(latents.shape, self.seed, i, k, len(self.sigmas)).to(device, dtype)
                    s = torch.tensor([sigma], device=device)
                    noisy, target = noisy_latents_and_target(latents, noise, s)
                    with autocast:
                        pred = predict_velocity(self.family, model, noisy, embeds, s, self.guidance)
                    total += weighted_mse(pred, target, weights).item()
                    count += 1
        finally:
            model.train(was_training)
        loss = total / max(count, 1)
        self.seconds += time.perf_counter() - t0
        self.history.append((step, loss))
        return loss

    def record(self) -> dict:
        """What goes into the result's settings: the curve and its cost."""
        return {"items": len(self.items), "sigmas": [round(s, 6) for s in self.sigmas],
                "steps": [s for s, _ in self.history], "loss": [v for _, v in self.history],
                "seconds": round(self.seconds, 3)}
