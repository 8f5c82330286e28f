"""``JointStream``: a second latent stream a joint model denoises beside the one that trains (LTX-2's audio beside its
video), as previews must step it to sample what the family's pipeline samples (``Guidance.joint``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class JointStream:
    """The other stream of a joint model, for previews (training feeds it the family's own way: ``model_inputs``).

    ``key``: the name ``model_inputs`` reads the stream's current latents under (a batch axis first), at the step's
    noise level; without it the family feeds its training default. ``output``: which output of the forward is the
    stream's velocity (same sign convention as the main one). ``shape(model, latent_shape)``: one sample's stream
    latents for a main latent of ``latent_shape`` (without batch). ``scale``: the stream's own guidance scale under a
    ``cfg`` rule (LTX2Pipeline's ``audio_guidance_scale``). The stream's first noise is drawn from the preview seed
    (``engine/sampling/denoise.py``); it is stepped with the same sigmas and Euler steps as the main latents and
    never decoded."""

    key: str
    output: int
    shape: Callable[..., tuple]
    scale: float = 0.0
