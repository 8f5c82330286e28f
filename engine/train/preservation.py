"""Differential output preservation (ai-toolkit's ``diff_output_preservation``): keep what the base model does on a
class prompt while the adapter learns the subject.

Each micro-batch's noisy latents are also run on the class prompt (Dataset Options' ``preservation_prompt``, encoded
into the dataset cache with the captions): once with the adapter off and no gradients (the target: the base model's
prediction), once with the adapter on; the mean squared difference, times Loss & Validation Options'
``preservation_weight``, is added to the step's loss. The cost per micro-step: one forward without gradients and one
forward + backward more, both on the same rows as the training forward (the planner's step-time model counts them:
``Workload.preservation``; the peak is a training forward's, so the memory plan is unchanged). The loss is over the
whole image (masks shape the subject's loss, not the class's).
"""
from __future__ import annotations

import contextlib

import torch

from ..families import predict_velocity


@contextlib.contextmanager
def adapter_off(model):
    """The base model: every adapter layer passes its input through the frozen layer only (diffusers'
    ``disable_adapters``, undone on exit whatever happens)."""
    model.disable_adapters()
    try:
        yield model
    finally:
        model.enable_adapters()


def class_embeds(text: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch's model inputs with the class prompt's embeddings (``text``: ``DatasetCache.load_text``, a batch of
    one, on the batch's device and dtype) in place of its captions', repeated for every row; what the latent entry
    adds beside the text (an image-to-video window's first-frame conditioning) stays the batch's."""
    rows = next(iter(batch.values())).shape[0]
    return batch | {k: v.expand(rows, *v.shape[1:]) for k, v in text.items()}


@torch.no_grad()
def preservation_target(family, model, noisy: torch.Tensor, embeds: dict, sigmas: torch.Tensor, guidance: float,
                        autocast=contextlib.nullcontext()) -> torch.Tensor:
    """The base model's velocity on the class prompt (the adapter off, no gradients): the target."""
    with adapter_off(model), autocast:
        return predict_velocity(family, model, noisy, embeds, sigmas, guidance).float()


def preservation_loss(family, model, noisy: torch.Tensor, embeds: dict, sigmas: torch.Tensor, guidance: float,
                      autocast=contextlib.nullcontext()) -> torch.Tensor:
    """MSE of the adapter's velocity on the class prompt against the base model's (the target carries no gradient)."""
    target = preservation_target(family, model, noisy, embeds, sigmas, guidance, autocast)
    with autocast:
        pred = predict_velocity(family, model, noisy, embeds, sigmas, guidance)
    return torch.nn.functional.mse_loss(pred.float(), target)
