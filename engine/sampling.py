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
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

import torch

from .attention import forward_attention
from .errors import ConfigError
from .families import Guidance, predict_velocity


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
    frames: int = field(default=17, metadata={"help": (
        "Frames of each sample clip for video models (Wan: 4k + 1; 17 is about a second at 16 fps). Every "
        "checkpoint's clip is saved as an animated WebP; the grid shows its first frame and a strip of frames. "
        "Image models draw one image."
    )})
    guidance: float = field(default=3.5, metadata={"help": (
        "Guidance of the samples: the guidance embedding's value for guidance-distilled models (Flux.1-dev 3.5, "
        "Flux.2-dev 4); the classifier-free guidance scale for models sampled with it (Z-Image Base, Lumina 2: 4; "
        "a second forward per step on the empty prompt); ignored by models with neither (schnell, klein, "
        "Z-Image Turbo)."
    )})

    def __post_init__(self) -> None:
        for name in ("every", "steps", "resolution", "seed", "frames"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"sample {name}={v!r} must be a whole number >= 0")
        if not isinstance(self.guidance, (int, float)) or not math.isfinite(self.guidance) or self.guidance < 0:
            raise ConfigError(f"sample guidance={self.guidance!r} must be a finite number >= 0")
        if self.every and self.frames < 1:
            raise ConfigError(f"sample frames={self.frames} must be at least 1")
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


@dataclass
class PartnerExpert:
    """The other expert of a mixture, for previews of one expert (``NoiseSchedule.preview_partner``): ``model`` (frozen
    base weights, no LoRA) denoises the steps on its side of ``boundary`` (sigma >= boundary when ``high``, below
    when not) with its own guidance scale ``guidance``; the trained model denoises the rest."""

    model: object
    boundary: float
    high: bool
    guidance: float

    def takes(self, sigma: float) -> bool:
        """Whether this step is the partner's. WanPipeline compares the scheduler's timestep (1000 sigma) with
        ``boundary_ratio * 1000``; the same comparison on sigma."""
        return (sigma >= self.boundary) == self.high


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
    sigmas = family.schedule.sample_sigmas(x, steps)
    for i in range(steps):
        if poll is not None:
            poll()
        mine = partner is None or not partner.takes(sigmas[i])
        net, scale = (model, guidance) if mine else (partner.model, partner.guidance)
        guided = cfg and bool(scale)
        xs = torch.cat([x, x]) if guided else x  # row r's latents: prompt r % n's
        v = torch.empty(xs.shape, dtype=torch.float32, device=device)
        with autocast or contextlib.nullcontext(), forward_attention(x.device):
            for idx, emb in forwards[guided]:
                s = torch.full((len(idx),), sigmas[i], dtype=torch.float32, device=device)
                v[idx] = predict_velocity(family, net, xs[idx].to(dtype), emb, s, scale).float()
            if guided:
                v = rule.combine(v[:n], v[n:], scale)
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    return list(x.split(1))


def batch_rows(rows: list[dict[str, torch.Tensor]], max_rows: int | None) -> list[tuple[list[int], dict]]:
    """Rows (each a batch of embeddings as ``DatasetCache.load_text`` gives them) -> the forwards of one denoising
    step: ``(row indexes, their embeddings as one batch)``. Rows go together when every fixed-shape tensor has one
    shape (``_row_kind``), at most ``max_rows`` (None: no limit) per forward, in order. The forwards of a kind are
    as even as they can be (5 rows at most 3: 3 + 2; 4 rows: 2 + 2, not 3 + 1): a streamed forward copies every
    block whatever its rows, so a forward of one row leaves the copies nothing to hide behind."""
    kinds: dict[tuple, list[int]] = {}
    for r, row in enumerate(rows):
        kinds.setdefault(_row_kind(row), []).append(r)
    limit = max(1, max_rows) if max_rows else len(rows)
    out = []
    for idx in kinds.values():
        forwards = -(-len(idx) // limit)
        start = 0
        for f in range(forwards):
            size = len(idx) // forwards + (1 if f < len(idx) % forwards else 0)
            part = idx[start:start + size]
            start += size
            out.append((part, merge_embeds([rows[r] for r in part])))
    return out


def _mask_of(key: str) -> str:
    """The mask of a variable-length encoder's states (``TextEncoderSpec.mask_key``: 1 = a real token)."""
    return f"{key}_mask"


def _row_kind(row: dict[str, torch.Tensor]) -> tuple:
    """What must be equal for rows to share a forward: the keys, and the shape and dtype of every tensor but a
    variable-length encoder's token axis (padded by ``merge_embeds``) and its mask."""
    out = []
    for key in sorted(row):
        t = row[key]
        if key.endswith("_mask") and key[: -len("_mask")] in row:
            continue
        tail = tuple(t.shape[2:]) if _mask_of(key) in row else tuple(t.shape[1:])
        out.append((key, tail, t.dtype))
    return tuple(out)


def merge_embeds(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Batches of embeddings of one ``_row_kind`` -> one batch. A variable-length encoder's states (those with a
    mask) keep each row's real tokens, zero-padded at the end to the longest with a new mask, as
    ``DatasetCache.collate_text`` pads a training batch and the families' pipelines pad batched prompts (the models
    attend to the real tokens only: Z-Image and Lumina 2 by their masks, Qwen-Image by its joint attention mask);
    every other tensor is concatenated as it is (T5 and umT5 states are padded to one length already)."""
    if len(rows) == 1:
        return dict(rows[0])
    out = {}
    for key in rows[0]:
        if key.endswith("_mask") and key[: -len("_mask")] in rows[0]:
            continue
        if _mask_of(key) not in rows[0]:
            out[key] = torch.cat([r[key] for r in rows])
            continue
        real = [t[m.bool()] for r in rows for t, m in zip(r[key], r[_mask_of(key)])]
        longest = max(t.shape[0] for t in real)
        padded = real[0].new_zeros((len(real), longest, *real[0].shape[1:]))
        mask = torch.zeros(len(real), longest, dtype=rows[0][_mask_of(key)].dtype)
        for i, t in enumerate(real):
            padded[i, : t.shape[0]] = t
            mask[i, : t.shape[0]] = 1
        out[key], out[_mask_of(key)] = padded, mask
    return out


#: A no-grad forward's working set through one block, in B*T*D activation units (the planner's unit, scaled by the
#: family's ``working_set_scale`` as the training one is). Measured on the H100 (bench/results.jsonl, bench_sampling
#: row of 2026-11-24T04:11, Flux.1-dev 1024², one prompt, auto at 8 GB): the sampling peak 4.78 GB was 1.92 GB under
#: the training peak 6.70, whose predicted activations were 2.47 GB (91.2 units of 28.3 MB - 0.11 GB), so everything
#: sampling adds, the tiled VAE decode included, was at most 0.55 GB = 19.5 units. Rounded up; the plan's training
#: working set (recompute + backward) is 34.2 units.
SAMPLE_FORWARD_UNITS = 20.0


def rows_per_forward(plans, workload, family, variant: str, width: int, height: int, frames: int = 1,
                     micro_batch: int = 0, extra_bytes: int = 0) -> int:
    """The most rows (prompts and guidance branches) one sampling forward may carry so that sampling stays at or
    below the training peak the plan predicts.

    Sampling holds what training holds apart from its activations: the same weights (resident blocks, the ring of
    streamed ones) and the LoRA with its optimizer state. Training's peak keeps ``max(activations, optimizer
    temporaries)`` above those (``plan.breakdown``); a forward of R rows of T_s tokens needs
    ``R * SAMPLE_FORWARD_UNITS * scale`` units of T_s*D activations plus the fitted intercept, and the ring may be
    fuller during a forward than at the training peak (without activation offload that peak comes at the turn to
    the backward), so the difference is taken off. R is the largest count that fits, at least 1 (one row per forward
    is today's path: never more than training needs, as the sampler's docstring says). Without a plan (resident
    weights) the activations are not predicted: R rows may carry at most the tokens of one training micro-batch
    (a no-grad forward holds less than the recompute and backward of as many tokens; ``micro_batch``: samples per
    training forward, 0 = the whole batch). Several plans (a split):
    each part's bound, the smallest. ``extra_bytes``: what else sampling holds on the GPU (a mixture's partner
    expert while it streams: ``PreviewPartner.rows_bytes``), taken off the room of every plan."""
    from .offload.plan import MOMENT_BYTES_PER_PARAM, OPTIMIZER_BYTES_PER_PARAM, TRANSIENT_BYTES

    tokens = family.memory.image_tokens(width, height, variant) * family.memory.latent_frames(frames) + workload.text_tokens
    if family.control_images(variant) is not None:
        # An edit prompt's control images join its image tokens; the training item's (the largest) stand in for
        # the sample prompt's, which are encoded at the same reference area.
        tokens += workload.image_tokens
    if not plans:
        micro = min(workload.batch, micro_batch or workload.batch)
        return max(1, (micro * workload.tokens) // tokens)
    rows = []
    for plan in plans:
        fp = plan.footprint
        moments = MOMENT_BYTES_PER_PARAM if plan.optimizer_on_host else 0  # as build_plan counts them
        room = max(plan.breakdown["activations"], fp.trainable_params * (OPTIMIZER_BYTES_PER_PARAM + moments))
        ring_at_peak = plan.breakdown["weights"] - fp.other_bytes - sum(fp.block_bytes[i] for i in plan.resident)
        room -= max(0, plan.ring_bytes - ring_at_peak) + TRANSIENT_BYTES + extra_bytes
        per_row = SAMPLE_FORWARD_UNITS * fp.working_set_scale(plan.activation_offload) * tokens * fp.hidden_size \
            * fp.act_bytes_per_elem
        rows.append(max(1, int(room // per_row)))
    return min(rows)


@torch.no_grad()
def decode_latents(vae, family, latents: list[torch.Tensor], device: torch.device, variant: str | None = None):
    """Latents -> PIL images: the VAE of ``variant`` (``family.vae_for``) on ``device`` for the decode only, tiled.
    An image family's latents give one PIL image each; a video family's clip (its decode is (B, 3, F, H, W)) gives
    the list of its F frames (one frame for a one-frame clip)."""
    spec = family.vae_for(variant)
    from PIL import Image

    from .models.dtypes import release_device_memory

    def pil(frame: torch.Tensor):  # (3, H, W) in [-1, 1]
        arr = ((frame.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
        return Image.fromarray(arr)

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
            img = spec.decode(vae, lat.to(device, dtype))
            images.append([pil(img[0, :, f]) for f in range(img.shape[2])] if img.dim() == 5 else pil(img[0]))
    finally:
        vae.to(home)
        release_device_memory(device)
    return images


def save_clip(frames: list, path, fps: float) -> None:
    """A clip's frames as an animated WebP (lossless: the frames come back pixel for pixel; ComfyUI's own
    SaveAnimatedWEBP defaults to lossless too), looping, ``fps`` frames per second."""
    frames[0].save(path, format="WEBP", save_all=True, append_images=frames[1:], lossless=True, quality=80,
                   method=4, duration=max(1, round(1000 / fps)), loop=0)


def load_clip(path) -> list:
    """The frames of an animated WebP written by ``save_clip``, as RGB PIL images."""
    from PIL import Image, ImageSequence

    with Image.open(path) as img:
        return [f.convert("RGB") for f in ImageSequence.Iterator(img)]


#: Frames of a clip the grid shows in the strip under its first frame (evenly spaced, the last included).
STRIP = 4


def strip_frames(frames: list, count: int = STRIP) -> list:
    """``count`` frames evenly spaced over the clip, from the second to the last (the first is shown large)."""
    rest = frames[1:] or frames
    if len(rest) <= count:
        return rest
    return [rest[round(i * (len(rest) - 1) / (count - 1))] for i in range(count)]


def grid_image(columns: list[tuple[str, list]], prompts: list[str], cell: int = 256):
    """Prompts (rows) x checkpoints (columns, labelled) as one PIL image. A clip (a list of frames) shows its first
    frame in the cell and a strip of a few later frames below it: frontends that show a PNG cannot animate. Each
    cell carries its prompt on a dark band along its bottom edge (cut to the cell's width), so a row says what
    it was asked for."""
    from PIL import Image, ImageDraw

    clips = any(isinstance(x, list) for _, images in columns for x in images)
    strip_h = cell // STRIP if clips else 0
    label_h, label_w, row_h = 18, 0, cell + strip_h
    grid = Image.new("RGB", (label_w + cell * len(columns), label_h + row_h * len(prompts)), (24, 24, 24))
    draw = ImageDraw.Draw(grid)
    for c, (title, images) in enumerate(columns):
        draw.text((label_w + c * cell + 4, 3), title, fill=(230, 230, 230))
        for r, img in enumerate(images):
            x, y = label_w + c * cell, label_h + r * row_h
            frames = img if isinstance(img, list) else [img]
            grid.paste(frames[0].resize((cell, cell)), (x, y))
            if r < len(prompts) and prompts[r]:
                text = _fit_text(draw, prompts[r], cell - 8)
                draw.rectangle((x, y + cell - PROMPT_BAND, x + cell - 1, y + cell - 1), fill=(16, 16, 16))
                draw.text((x + 4, y + cell - PROMPT_BAND + 2), text, fill=(235, 235, 235))
            if isinstance(img, list):
                for i, frame in enumerate(strip_frames(frames)):
                    grid.paste(frame.resize((cell // STRIP, strip_h)), (x + i * (cell // STRIP), y + cell))
    return grid


#: Height of the band that carries a cell's prompt (PIL's default bitmap font is 11 px high).
PROMPT_BAND = 14


def _fit_text(draw, text: str, width: int) -> str:
    """``text`` cut (with an ellipsis) to at most ``width`` pixels in the draw's font."""
    if draw.textlength(text) <= width:
        return text
    while text and draw.textlength(text + "...") > width:
        text = text[:-1]
    return text + "..."


#: The tooltip of Train LoRA's ``preview_partner`` input.
PREVIEW_PARTNER_HELP = (
    "Wan 2.2 T2V-A14B: the other expert's Load Quantized Slab, so samples of this expert's LoRA can be drawn. A "
    "preview needs both experts: the high-noise one denoises sigma >= 0.875, the low-noise one below (as "
    "WanPipeline and ComfyUI's own Wan 2.2 workflow switch). The partner runs with its base weights (no LoRA) and "
    "its own CFG scale (high 4, low 3); it streams only while sampling and never stays in VRAM. Unconnected: no "
    "samples for an A14B expert. Other models ignore it."
)


def preview_blocker(variant: str, sigma_range: tuple[float, float], partner: tuple[str, float] | None = None
                    ) -> str | None:
    """Why a model cannot be previewed alone, or None. An expert of a mixture (Wan 2.2 A14B: the high-noise expert
    denoises sigma >= 0.875, the low-noise one below) only takes part of the path from noise to a clip: sampled alone
    it gives noise or mush that says nothing about the LoRA, so without its partner (``partner``: the family's
    ``preview_partner``, the other expert and the boundary) no samples are drawn (never silently wrong ones)."""
    lo, hi = sigma_range
    if (lo, hi) == (0.0, 1.0):
        return None
    other = f"the {partner[0]} file" if partner else "the other expert"
    return (f"sampling is off for this run: {variant} is one expert of a mixture and denoises only sigma in "
            f"[{lo}, {hi}]; a preview needs both experts (the other one switches in at the boundary), and previews "
            f"of an expert alone are not images or clips a user can judge. To draw samples, connect the Load "
            f"Quantized Slab of {other} to Train LoRA's preview_partner input (the Wan 2.2 T2V template wires it); "
            f"or judge the LoRA by loading both experts' LoRAs in ComfyUI's own Wan 2.2 workflow")


class Sampler:
    """What the training loop calls at checkpoints: samples every prompt, keeps every checkpoint's images,
    writes the grid (prompts x checkpoints so far) and hands it to the callback."""

    def __init__(self, cfg: SamplingConfig, dataset, family, model, device, dtype, out_dir: Optional[Path], cb,
                 max_rows: Optional[int] = None, partner=None):
        if not dataset.sample_prompts:
            raise ConfigError("sampling is on (sample_every > 0) but the dataset cache has no sample prompts: put "
                              "one prompt per line in Cache Text Embeds' sample_prompts")
        self.cfg, self.dataset, self.family, self.model = cfg, dataset, family, model
        self.device, self.dtype, self.out_dir, self.cb = device, dtype, out_dir, cb
        self.max_rows = max_rows  # rows per sampling forward (rows_per_forward); None: every row in one
        # A mixture's other expert (engine/train/preview_partner.py: ``placed()`` gives a PartnerExpert for the
        # time of one preview), or None.
        self.partner = partner
        self.embeds = [dataset.load_text(key) for _, key in dataset.sample_prompts]
        self.rule = family.guidance(dataset.variant)
        # One negative per prompt: an edit model's carries that prompt's control images (DatasetCache.negative_keys).
        self.negatives = [dataset.load_text(k) if self.rule.mode == "cfg" and k else None
                          for k in dataset.negative_keys()]
        self.prompts = [p for p, _ in dataset.sample_prompts]
        # A video family samples clips (cfg.frames; checked against the family's frame rule here, not at the first
        # checkpoint), an image family one image.
        self.frames = cfg.frames if family.video else 1
        if family.video:
            family.latent_shape(model, 64, 64, self.frames)
        self.fps = _dataset_fps(dataset)
        self.columns: list[tuple[str, list]] = []
        self.seconds = 0.0
        self.images = 0
        self.peak_vram_gb = 0.0  # the highest allocation while sampling (CUDA)
        self._vae = None
        self.keep_dir: Optional[Path] = None

    def _what(self) -> dict:
        """What a kept column was drawn with: columns of other prompts or settings are never mixed in."""
        from dataclasses import asdict

        return {"prompts": self.prompts, "config": asdict(self.cfg)}

    def keep_columns(self, folder: Path, upto: int) -> None:
        """Keep every checkpoint's images in ``folder`` (beside a resumable run's state) and take back those
        kept there by the run before a stop, up to step ``upto`` (where it resumes): a resumed run's grid holds
        every checkpoint. Columns of later steps (drawn after the state that is resumed) are dropped."""
        import json
        import shutil

        from PIL import Image

        self.keep_dir = Path(folder)
        manifest = self.keep_dir / "columns.json"
        try:
            kept = json.loads(manifest.read_text())
        except (OSError, ValueError):
            kept = None
        if not isinstance(kept, dict) or kept.get("what") != json.loads(json.dumps(self._what())):
            shutil.rmtree(self.keep_dir, ignore_errors=True)  # none, or of other prompts/settings
            return
        for step in sorted(int(s) for s in kept.get("steps", [])):
            paths = [self._kept_path(step, r) for r in range(len(self.prompts))]
            if step > upto or not all(p.is_file() for p in paths):
                continue
            images = []
            for path in paths:
                if self.family.video:
                    images.append(load_clip(path))
                    continue
                with Image.open(path) as img:
                    images.append(img.convert("RGB"))
            self.columns.append((f"step {step}", images))
        self._write_manifest()
        if self.columns:
            self.cb.log(f"the sample grid goes on from the {len(self.columns)} checkpoint(s) drawn before the "
                        f"resume (steps {', '.join(t.split()[1] for t, _ in self.columns)})")

    def has(self, step: int) -> bool:
        return any(title == f"step {step}" for title, _ in self.columns)

    def _write_manifest(self) -> None:
        from .fileio import write_json_atomic

        steps = [int(title.split()[1]) for title, _ in self.columns]
        write_json_atomic(self.keep_dir / "columns.json", {"what": self._what(), "steps": steps},
                          "the kept sample columns", indent=None)

    def _kept_path(self, step: int, r: int) -> Path:
        return self.keep_dir / f"step-{step:07d}-p{r:02d}.{'webp' if self.family.video else 'png'}"

    def _keep(self, step: int, images: list) -> None:
        """One checkpoint's images (lossless PNGs) or clips (lossless animated WebPs) beside the run's state, then
        the manifest naming them."""
        from .fileio import atomic_write

        for r, img in enumerate(images):
            with atomic_write(self._kept_path(step, r), "a kept sample") as tmp:
                if isinstance(img, list):
                    save_clip(img, tmp, self.fps)
                else:
                    img.save(tmp, format="PNG")
        self._write_manifest()

    def _poll(self) -> None:
        """Between Euler steps: a Cancel (ComfyUI's, the editor's under serve, Ctrl-C) raised by the callback
        ends sampling at once instead of after every prompt. A stop flag (returned True) waits for the loop."""
        self.cb.should_stop()

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
            import contextlib

            with self.partner.placed() if self.partner is not None else contextlib.nullcontext() as partner:
                latents = sample_prompts(self.model, self.family, self.embeds, self.cfg.resolution,
                                         self.cfg.resolution, self.cfg.steps, self.cfg.seed, self.cfg.guidance,
                                         self.device, self.dtype, autocast, self.rule, self.negatives,
                                         frames=self.frames, poll=self._poll, max_rows=self.max_rows,
                                         partner=partner)
            images = decode_latents(self.vae(), self.family, latents, self.device, self.dataset.variant)
        finally:
            self.model.train(was_training)
        if cuda:
            self.peak_vram_gb = max(self.peak_vram_gb, torch.cuda.max_memory_allocated(self.device) / 1e9)
        self.images += len(images)
        self.columns = [c for c in self.columns if c[0] != f"step {step}"] + [(f"step {step}", images)]
        if self.keep_dir is not None:
            self._keep(step, images)
        grid = grid_image(self.columns, self.prompts)
        path = None
        if self.out_dir is not None:
            from .fileio import atomic_write

            path = Path(self.out_dir) / f"samples_step{step:07d}.png"
            with atomic_write(path, "the sample grid") as tmp:
                grid.save(tmp, format="PNG")
            for r, img in enumerate(images):  # each prompt's clip, animated, beside the grid (clip_paths)
                if isinstance(img, list):
                    with atomic_write(clip_paths(path, len(images))[r], "a sample clip") as tmp:
                        save_clip(img, tmp, self.fps)
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


def clip_paths(grid: str | Path, prompts: int) -> list[Path]:
    """The animated WebPs of a checkpoint's clips, one per prompt, beside its grid: ``<grid stem>_pNN.webp``."""
    grid = Path(grid)
    return [grid.with_name(f"{grid.stem}_p{r:02d}.webp") for r in range(prompts)]


def saved_clips(grid: str | Path) -> list[Path]:
    """The clips saved beside a grid (``clip_paths``), in prompt order; none for an image family's grid."""
    grid = Path(grid)
    return sorted(grid.parent.glob(f"{grid.stem}_p[0-9][0-9].webp"))


def _dataset_fps(dataset) -> float:
    """The frame rate the dataset's clips were sampled at (its cache manifest's video settings), for playing the
    sample clips at the speed the model learned; 16 (Wan 2.1 / 2.2 A14B's) when the manifest does not say."""
    import json

    try:
        video = json.loads(Path(dataset.manifest_path).read_text()).get("video") or {}
        fps = float(video.get("fps") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        fps = 0.0
    return fps if fps > 0 else 16.0
