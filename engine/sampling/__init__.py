"""Sample images during training: flow-matching Euler steps through the training model with its current
LoRA, then a tiled VAE decode, laid out as a grid of prompts x checkpoints.

The model is sampled where it trains: under ``torch.no_grad`` the same forward pre-hooks stream
the blocks through the same GPU slots (the scheduler resyncs to a forward-only visit order), so
sampling needs no memory beyond what training holds at a smaller or equal resolution. The VAE
is put on the GPU only for its decode, with tiling, and taken off again.

The sampler follows the families' diffusers pipelines (FluxPipeline, Flux2Pipeline, ZImagePipeline,
Lumina2Pipeline, all with FlowMatchEulerDiscreteScheduler): sigmas ``linspace(1, 1/steps, steps)``
shifted by the family's ``mu`` (``exp(mu) / (exp(mu) + 1/sigma - 1)``), then 0; one Euler step per
sigma, ``x += (sigma_next - sigma) * v`` in fp32, with ``v`` the model's velocity under the family's
convention (``families.predict_velocity``). Guidance is the family's (``family.guidance``): a
guidance embedding (Flux.1-dev, Flux.2-dev), classifier-free guidance against the empty prompt with the
pipeline's own formula (Z-Image Base, Lumina 2), or none. The first noise is drawn on the CPU from
``seed`` in the latent shape, as the pipelines do, so a fixed seed gives comparable images at every
checkpoint. Prompts are the dataset cache's sample prompts, encoded when the cache was built (like
captions); the empty prompt too when the family samples with classifier-free guidance.

Every prompt (and, with classifier-free guidance, every prompt's negative) is a row of one batch: each denoising
step runs the rows as one forward where they fit (``sample_prompts``), so a streamed block is copied in once per
step instead of once per prompt and branch. How many rows one forward carries is bounded from the training plan
(``rows_per_forward``), so sampling stays at or below the training peak.

The concerns, one module each:

- ``config``: ``SamplingConfig`` (what a user sets) and its help text;
- ``denoise``: the Euler loop over the family's sigmas, guidance applied per step (``sample_prompts``);
- ``rows``: which rows share a forward and their embeddings merged into one batch;
- ``budget``: how many rows one forward may carry under the training peak (``rows_per_forward``);
- ``partner``: a mixture's other expert for previews of one expert, and when an expert is not previewed;
- ``decode``: latents -> PIL images through the VAE;
- ``grid``: the prompts x checkpoints grid; ``clips``: sample clips as animated WebPs;
- ``sampler``: ``Sampler``, what the training loop calls at checkpoints.
"""
from __future__ import annotations

from .budget import SAMPLE_FORWARD_UNITS, rows_per_forward
from .clips import clip_paths, load_clip, save_clip, saved_clips
from .config import SamplingConfig, help_text
from .decode import decode_latents
from .denoise import sample_latents, sample_prompts
from .grid import PROMPT_BAND, STRIP, _fit_text, grid_image, strip_frames  # noqa: F401  (_fit_text: tests)
from .partner import PREVIEW_PARTNER_HELP, PartnerExpert, preview_blocker
from .rows import batch_rows, merge_embeds
from .sampler import Sampler

__all__ = [
    "PREVIEW_PARTNER_HELP", "PROMPT_BAND", "PartnerExpert", "SAMPLE_FORWARD_UNITS", "STRIP", "Sampler",
    "SamplingConfig", "batch_rows", "clip_paths", "decode_latents", "grid_image", "help_text", "load_clip",
    "merge_embeds", "preview_blocker", "rows_per_forward", "sample_latents", "sample_prompts", "save_clip",
    "saved_clips", "strip_frames",
]
