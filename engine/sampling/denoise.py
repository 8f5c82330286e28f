"""The denoising loop: flow-matching Euler steps through the training model, every prompt (and guidance branch)
a row of the step's forwards.

The sampler follows the families' diffusers pipelines (FluxPipeline, Flux2Pipeline, ZImagePipeline,
Lumina2Pipeline, all with FlowMatchEulerDiscreteScheduler): the family's sigmas (``sample_sigmas``), one Euler
step per sigma, ``x += (sigma_next - sigma) * v`` in fp32, with ``v`` the model's velocity under the family's
convention (``families.predict_velocity``) and the family's guidance rule (``family.guidance``). The first noise
is drawn on the CPU from ``seed`` in the latent shape, as the pipelines do, so a fixed seed gives comparable images
at every checkpoint.
"""
from __future__ import annotations

import torch

from ..attention import forward_attention
from ..errors import ConfigError
from ..families import Guidance, predict_velocity, sigma_schedule
from ..families.specs import HELD_KEY, hold_frames
from .partner import PartnerExpert
from .rows import batch_rows


@torch.no_grad()
def sample_latents(model, family, embeds: dict[str, torch.Tensor], width: int, height: int, steps: int, seed: int,
                   guidance: float, device: torch.device, dtype: torch.dtype, autocast=None,
                   rule: Guidance | None = None, negative: dict[str, torch.Tensor] | None = None,
                   noise: torch.Tensor | None = None, frames: int = 1, poll=None,
                   partner: PartnerExpert | None = None) -> torch.Tensor:
    """One image's (or, for a video family, a ``frames``-frame clip's) latents (1, C, ...), fp32, from noise drawn
    with ``seed`` (or ``noise``). ``rule``: how the model is guided (default: an embedding fed ``guidance``, which
    models without one ignore); with a ``cfg`` rule, ``negative`` holds the empty prompt's embeddings and
    ``guidance`` is the scale. ``poll`` is called before every Euler step (a stop raised there ends sampling at
    once). ``sample_prompts`` with one prompt: both guidance branches in one forward per step."""
    return sample_prompts(model, family, [embeds], width, height, steps, seed, guidance, device, dtype, autocast,
                          rule, [negative], None if noise is None else [noise], frames, poll,
                          partner=partner)[0]


@torch.no_grad()
def sample_prompts(model, family, embeds: list[dict[str, torch.Tensor]], width: int, height: int, steps: int,
                   seed: int, guidance: float, device: torch.device, dtype: torch.dtype, autocast=None,
                   rule: Guidance | None = None, negatives: list | None = None, noise: list | None = None,
                   frames: int = 1, poll=None, max_rows: int | None = None,
                   partner: PartnerExpert | None = None) -> list[torch.Tensor]:
    """Every prompt's latents (each (1, C, ...), fp32), sampled together: each denoising step runs the rows (every
    prompt, and with classifier-free guidance every prompt's negative) as few forwards as possible, so a streamed
    block is copied in once per step rather than once per prompt and branch. ``max_rows``: the most rows one forward
    may carry (``rows_per_forward``: the sampling peak stays at or below the training peak); rows whose cached
    tensors differ in shape (an edit prompt's control images of another size) go in separate forwards; a family
    that cannot batch (``MemoryProfile.batched_sampling`` false) runs one row per forward. Each prompt's first noise
    is drawn on the CPU from ``seed`` (or taken from ``noise``), as ``sample_latents`` draws it alone, so batching
    changes no preview beyond float rounding. ``negatives``: one per prompt (with a ``cfg`` rule). ``partner``: the
    other expert of a mixture, which takes the steps on its side of the boundary with its own guidance scale
    (WanPipeline's ``transformer`` / ``transformer_2`` with ``guidance_scale`` / ``guidance_scale_2``)."""
    import contextlib

    rule = rule or Guidance("embedded")
    negatives = list(negatives) if negatives is not None else [None] * len(embeds)
    if rule.mode == "cfg" and any(n is None for n in negatives):
        raise ConfigError(f"{family.display_name} samples with classifier-free guidance, which needs the empty "
                          f"prompt's embeddings; rebuild the dataset cache with sample prompts")
    shape = (1, *family.latent_shape(model, width, height, frames))
    if noise is None:
        first = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
        noise = [first] * len(embeds)  # every prompt starts from the seed's noise, as it does sampled alone
    x = torch.cat([z.to(device, torch.float32) for z in noise])
    n = len(embeds)
    # An image-to-video model's held first frames (FirstFrameCondition.held): set, and kept while the rest is stepped.
    held = _held(embeds, device)
    x = hold_frames(x, held)
    # A joint model's other stream (LTX-2's audio) is stepped beside x, from its own noise of the seed.
    joint = rule.joint
    xj = None if joint is None else torch.randn((1, *joint.shape(model, shape[1:])), dtype=torch.float32,
                                                generator=torch.Generator().manual_seed(seed)).repeat(n, 1, 1).to(device)

    def batched(rows):
        out = batch_rows(rows, max_rows if family.memory.batched_sampling else 1)
        return [(idx, {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in emb.items()})
                for idx, emb in out]

    cfg = rule.mode == "cfg"
    # With guidance, the negatives are rows n.. of the same forwards; a model sampled at scale 0 (no guidance)
    # runs the prompts alone.
    forwards = {False: batched(list(embeds)),
                True: batched(list(embeds) + negatives) if cfg and (guidance or (partner and partner.guidance))
                else None}
    # A variant distilled for one shift samples under it (Guidance.sample_mu); otherwise the family's schedule.
    sigmas = family.schedule.sample_sigmas(x, steps) if rule.sample_mu is None else sigma_schedule(steps, rule.sample_mu)
    for i in range(steps):
        if poll is not None:
            poll()
        mine = partner is None or not partner.takes(sigmas[i])
        net, scale = (model, guidance) if mine else (partner.model, partner.guidance)
        guided = cfg and bool(scale)
        xs = torch.cat([x, x]) if guided else x  # row r's latents: prompt r % n's
        v = torch.empty(xs.shape, dtype=torch.float32, device=device)
        xjs = None if xj is None else (torch.cat([xj, xj]) if guided else xj)
        vj = None if xj is None else torch.empty(xjs.shape, dtype=torch.float32, device=device)
        with autocast or contextlib.nullcontext(), forward_attention(x.device):
            for idx, emb in forwards[guided]:
                s = torch.full((len(idx),), sigmas[i], dtype=torch.float32, device=device)
                if rule.target_sigma:  # a flow map jumps to the next sigma (Guidance.target_sigma)
                    emb = {**emb, "target_sigmas": torch.full_like(s, sigmas[i + 1])}
                if xj is None:
                    v[idx] = predict_velocity(family, net, xs[idx].to(dtype), emb, s, scale).float()
                    continue
                v[idx], vj[idx] = (t.float() for t in predict_velocity(
                    family, net, xs[idx].to(dtype), {**emb, joint.key: xjs[idx].to(dtype)}, s, scale, joint.output))
            if guided:
                v = rule.combine(v[:n], v[n:], scale)
                vj = None if xj is None else rule.combine(vj[:n], vj[n:], joint.scale)
        x = hold_frames(x + (sigmas[i + 1] - sigmas[i]) * v, held)
        if xj is not None:
            xj = xj + (sigmas[i + 1] - sigmas[i]) * vj
    return list(x.split(1))


def _held(embeds: list[dict[str, torch.Tensor]], device) -> torch.Tensor | None:
    """The prompts' held first frames stacked (n, C, k, ...), or None; every prompt has them or none does."""
    have = [HELD_KEY in e for e in embeds]
    if not any(have):
        return None
    if not all(have):
        raise ValueError("held first frames are given for some sample prompts only; an image-to-video preview "
                         "conditions every prompt on a first frame")
    return torch.cat([e[HELD_KEY].to(device, torch.float32) for e in embeds])
