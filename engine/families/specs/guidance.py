"""``Guidance``: how a variant samples previews (``ModelFamily.guidance``): an embedded guidance scale,
classifier-free guidance and its formula, or none."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .streams import JointStream


@dataclass(frozen=True)
class Guidance:
    """How a variant samples: ``embedded`` (a guidance embedding: Flux.1-dev, Flux.2-dev; one forward),
    ``cfg`` (classifier-free guidance: a second forward on the empty prompt), or ``none`` (distilled
    models without either: Flux.1-schnell, Z-Image Turbo).
    ``formula`` for cfg: ``standard`` = neg + g (pos - neg); ``z_image`` = pos + g (pos - neg) (its
    pipeline's form: g = 0 is no guidance). ``renormalize``: rescale the guided prediction to the
    conditional one's norm, over ``last_axis`` of (B, C, H, W) as Lumina 2's ``cfg_normalization`` does, or
    per ``patch_tokens`` (each 2x2 patch's channels: a packed token, as QwenImagePipeline's true CFG does).
    ``sample_mu``: a variant that samples under one exponential shift at every resolution where the family's schedule
    moves with it (Krea 2 Turbo: mu 1.15, the pipeline's ``is_distilled``); None: the family's ``sample_sigmas``.
    ``target_sigma``: a flow map (FLUX.3's step-distilled model) is told, in every forward, the sigma its step jumps to:
    the sampler passes it as ``embeds["target_sigmas"]`` (B,)."""

    mode: str = "none"  # "none" | "embedded" | "cfg"
    scale: float = 0.0  # the pipeline's default (the family's templates set Train LoRA's sample_guidance to it)
    steps: int = 20  # preview steps that suffice for this variant (the templates' sample_steps)
    formula: str = "standard"
    renormalize: str = ""  # "" | "last_axis" | "patch_tokens"
    sample_mu: float | None = None
    target_sigma: bool = False
    #: A joint model's other stream, stepped beside the main latents (LTX-2's audio; ``streams.py``); None: none.
    joint: JointStream | None = None

    def combine(self, pos: torch.Tensor, neg: torch.Tensor, scale: float) -> torch.Tensor:
        if self.formula == "z_image":
            out = pos + scale * (pos - neg)
        else:
            out = neg + scale * (pos - neg)
        if self.renormalize == "last_axis":  # Lumina2Pipeline: torch.norm over the last axis of (B, C, H, W)
            out = out * (torch.norm(pos, dim=-1, keepdim=True) / torch.norm(out, dim=-1, keepdim=True))
        elif self.renormalize == "patch_tokens":
            out = out * (_patch_token_norm(pos) / _patch_token_norm(out))
        elif self.renormalize:
            raise ValueError(f"unknown guidance renormalisation {self.renormalize!r}")
        return out


def _patch_token_norm(x: torch.Tensor) -> torch.Tensor:
    """The L2 norm of each 2x2 patch over all channels of (B, C, H, W), broadcast back to every element: the
    norm of each packed token (``torch.norm(tokens, dim=-1)`` in the pipelines that pack 2x2)."""
    b, c, h, w = x.shape
    sq = x.reshape(b, c, h // 2, 2, w // 2, 2).pow(2).sum(dim=(1, 3, 5), keepdim=True).sqrt()
    return sq.expand(b, c, h // 2, 2, w // 2, 2).reshape(b, c, h, w)
