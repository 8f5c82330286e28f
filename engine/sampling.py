"""Sample images during training: flow-matching Euler steps through the training model with its current
LoRA, then a tiled VAE decode, laid out as a grid of prompts x checkpoints.

The model is sampled where it trains: under ``torch.no_grad`` the same forward pre-hooks stream
the blocks through the same GPU slots (the scheduler resyncs to a forward-only visit order), so
sampling needs no memory beyond what training holds at a smaller or equal resolution. The VAE
is put on the GPU only for its decode, with tiling, and taken off again.

The sampler follows diffusers' Flux pipelines (FluxPipeline / Flux2Pipeline with
FlowMatchEulerDiscreteScheduler): sigmas ``linspace(1, 1/steps, steps)`` shifted by the family's
``mu`` (``exp(mu) / (exp(mu) + 1/sigma - 1)``), then 0; one Euler step per sigma,
``x += (sigma_next - sigma) * v`` in fp32. The first noise is drawn on the CPU from ``seed`` in the
unpacked latent shape, as the pipelines do, so a fixed seed gives comparable images at every checkpoint.
Prompts are the dataset cache's sample prompts, encoded when the cache was built (like captions).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

import torch

from .errors import ConfigError


@dataclass
class SamplingConfig:
    every: int = field(default=0, metadata={"help": (
        "Sample the prompts every N optimizer steps (and after the last step); 0 = no sampling. The prompts "
        "come from Cache Text Embeds' sample_prompts."
    )})
    steps: int = field(default=20, metadata={"help": "Euler steps per sample image (20 is enough to judge a LoRA)."})
    resolution: int = field(default=512, metadata={"help": (
        "Side of the square sample images, a multiple of 16. At or below the training resolution sampling "
        "needs no more VRAM than training."
    )})
    seed: int = field(default=42, metadata={"help": (
        "Noise seed of the samples: fixed, so every checkpoint's images are comparable."
    )})
    at_start: bool = field(default=True, metadata={"help": (
        "Also sample before the first step (the base model), so the LoRA's effect is visible."
    )})
    guidance: float = field(default=3.5, metadata={"help": (
        "Guidance value for guidance-distilled models (Flux.1-dev 3.5, Flux.2-dev 4); ignored by models without "
        "a guidance embedding."
    )})

    def __post_init__(self) -> None:
        for name in ("every", "steps", "resolution", "seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"sample {name}={v!r} must be a whole number >= 0")
        if not isinstance(self.guidance, (int, float)) or not math.isfinite(self.guidance) or self.guidance < 0:
            raise ConfigError(f"sample guidance={self.guidance!r} must be a finite number >= 0")
        if self.every and (self.steps < 1 or self.resolution < 64 or self.resolution % 16):
            raise ConfigError(f"sampling needs steps >= 1 (got {self.steps}) and a resolution >= 64 that is a "
                              f"multiple of 16 (got {self.resolution})")

    @property
    def enabled(self) -> bool:
        return self.every > 0


def help_text(name: str) -> str:
    for f in fields(SamplingConfig):
        if f.name == name:
            return f.metadata["help"]
    raise KeyError(name)


def sigma_schedule(steps: int, mu: float) -> list[float]:
    """The shifted sigmas of ``steps`` Euler steps, then 0."""
    base = [1.0 - i * (1.0 - 1.0 / steps) / max(steps - 1, 1) for i in range(steps)] if steps > 1 else [1.0]
    return [math.exp(mu) / (math.exp(mu) + (1.0 / s - 1.0)) for s in base] + [0.0]


@torch.no_grad()
def sample_latents(model, family, embeds: dict[str, torch.Tensor], width: int, height: int, steps: int, seed: int,
                   guidance: float, device: torch.device, dtype: torch.dtype, autocast=None) -> torch.Tensor:
    """One image's latents (1, C, h, w), fp32, from noise drawn with ``seed``."""
    import contextlib

    shape = (1, *family.latent_shape(model, width, height))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).to(device)
    embeds = {k: v.to(device, dtype) for k, v in embeds.items()}
    sigmas = sigma_schedule(steps, family.sample_shift_mu(x, steps))
    for i in range(steps):
        with autocast or contextlib.nullcontext():
            pred = model(**family.model_inputs(model, x.to(dtype), embeds, torch.tensor([sigmas[i]], device=device),
                                               guidance))[0]
        v = family.unpack_prediction(pred, x).float()
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x


@torch.no_grad()
def decode_latents(vae, family, latents: list[torch.Tensor], device: torch.device):
    """Latents -> PIL images: the VAE on ``device`` for the decode only, tiled."""
    from PIL import Image

    from .models.dtypes import release_device_memory

    home = next(vae.parameters()).device
    vae.to(device)
    vae.enable_tiling()
    if hasattr(vae, "tile_sample_min_size"):
        # Flux's VAE config says sample_size 1024, so diffusers would decode a 1024² image as one tile (measured:
        # the sampling peak went 0.2 GB above the training peak at 1024²); 256-pixel tiles bound it.
        factor = 2 ** (len(vae.config.block_out_channels) - 1)
        vae.tile_sample_min_size, vae.tile_latent_min_size = 256, 256 // factor
    images = []
    try:
        for lat in latents:
            dtype = next(vae.parameters()).dtype
            img = vae.decode(family.latents_to_vae(vae, lat.to(device, dtype)), return_dict=False)[0]
            arr = ((img[0].float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
            images.append(Image.fromarray(arr))
    finally:
        vae.to(home)
        release_device_memory(device)
    return images


def grid_image(columns: list[tuple[str, list]], prompts: list[str], cell: int = 256):
    """Prompts (rows) x checkpoints (columns, labelled) as one PIL image."""
    from PIL import Image, ImageDraw

    label_h, label_w = 18, 0
    grid = Image.new("RGB", (label_w + cell * len(columns), label_h + cell * len(prompts)), (24, 24, 24))
    draw = ImageDraw.Draw(grid)
    for c, (title, images) in enumerate(columns):
        draw.text((label_w + c * cell + 4, 3), title, fill=(230, 230, 230))
        for r, img in enumerate(images):
            grid.paste(img.resize((cell, cell)), (label_w + c * cell, label_h + r * cell))
    return grid


class Sampler:
    """What the training loop calls at checkpoints: samples every prompt, keeps every checkpoint's images,
    writes the grid (prompts x checkpoints so far) and hands it to the callback."""

    def __init__(self, cfg: SamplingConfig, dataset, family, model, device, dtype, out_dir: Optional[Path], cb):
        if not dataset.sample_prompts:
            raise ConfigError("sampling is on (sample_every > 0) but the dataset cache has no sample prompts: put "
                              "one prompt per line in Cache Text Embeds' sample_prompts")
        self.cfg, self.dataset, self.family, self.model = cfg, dataset, family, model
        self.device, self.dtype, self.out_dir, self.cb = device, dtype, out_dir, cb
        self.embeds = [dataset.load_text(key) for _, key in dataset.sample_prompts]
        self.prompts = [p for p, _ in dataset.sample_prompts]
        self.columns: list[tuple[str, list]] = []
        self.seconds = 0.0
        self.images = 0
        self.peak_vram_gb = 0.0  # the highest allocation while sampling (CUDA)
        self._vae = None

    def due(self, step: int, total: int) -> bool:
        return self.cfg.enabled and (step % self.cfg.every == 0 or step == total or (step == 0 and self.cfg.at_start))

    def run(self, step: int, autocast=None):
        """Sample every prompt at this checkpoint; returns the grid (PIL) and its path (or None)."""
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        if cuda:  # training re-reaches its own peak every step, so its running maximum is not lost
            torch.cuda.reset_peak_memory_stats(self.device)
        was_training = self.model.training
        self.model.eval()
        try:
            latents = [sample_latents(self.model, self.family, emb, self.cfg.resolution, self.cfg.resolution,
                                      self.cfg.steps, self.cfg.seed, self.cfg.guidance, self.device, self.dtype,
                                      autocast) for emb in self.embeds]
            images = decode_latents(self.vae(), self.family, latents, self.device)
        finally:
            self.model.train(was_training)
        if cuda:
            self.peak_vram_gb = max(self.peak_vram_gb, torch.cuda.max_memory_allocated(self.device) / 1e9)
        self.images += len(images)
        self.columns.append((f"step {step}", images))
        grid = grid_image(self.columns, self.prompts)
        path = None
        if self.out_dir is not None:
            from .fileio import atomic_write

            path = Path(self.out_dir) / f"samples_step{step:07d}.png"
            with atomic_write(path, "the sample grid") as tmp:
                grid.save(tmp, format="PNG")
        seconds = time.perf_counter() - t0
        self.seconds += seconds
        self.cb.log(f"sampled {len(self.prompts)} prompt(s) at step {step} in {seconds:.1f} s"
                    + (f": {path}" if path else ""))
        self.cb.on_sample(step, grid, str(path) if path else None)
        return grid, path

    def vae(self):
        if self._vae is None:
            self._vae = self.dataset.load_vae(self.family, self.dtype)
        return self._vae
