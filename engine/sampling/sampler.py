"""``Sampler``: what the training loop calls at checkpoints (sample, keep every checkpoint's images, write the
grid)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch

from ..errors import ConfigError
from .clips import _dataset_fps, clip_paths, load_clip, save_clip
from .decode import decode_latents
from .denoise import sample_prompts
from .grid import grid_image


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
        # An image-to-video model draws each prompt from a dataset first frame (first_frame.py), encoded at the
        # first checkpoint with the VAE the samples decode with.
        self.first_frame = family.first_frame(dataset.variant)
        self._conditioned = False
        if self.first_frame is not None:
            from .first_frame import check_first_frames

            check_first_frames(dataset, len(self.prompts))
        # A video family samples clips (cfg.frames; checked against the family's frame rule here, not at the first
        # checkpoint), an image family one image.
        self.frames = cfg.frames if family.video else 1
        if family.video:
            family.latent_shape(model, 64, 64, self.frames)
        # Each prompt's settings: its line's options (--w --h ...), else these (prompt_lines.py).
        self.settings = [self._resolve(i, s) for i, s in enumerate(self._line_settings())]
        if self.first_frame is not None:  # its first-frame conditions are encoded once, at the configured size
            odd = [self.prompts[i] for i, (w, h, f, *_) in enumerate(self.settings)
                   if (w, h, f) != (cfg.resolution, cfg.resolution, self.frames)]
            if odd:
                raise ConfigError(f"sample prompt {odd[0][:60]!r} sets its own size or frames (--w/--h/--f), which an "
                                  f"image-to-video model's previews do not support yet (their first-frame conditions "
                                  f"are encoded at sample_resolution and sample_frames); remove those options")
        self.fps = _dataset_fps(dataset)
        self.columns: list[tuple[str, list]] = []
        self.seconds = 0.0
        self.images = 0
        self.peak_vram_gb = 0.0  # the highest allocation while sampling (CUDA)
        self._vae = None
        self.keep_dir: Optional[Path] = None

    def _line_settings(self) -> list[dict]:
        given = list(self.dataset.sample_settings)
        return given + [{}] * (len(self.prompts) - len(given))

    def _resolve(self, i: int, line: dict) -> tuple:
        """(width, height, frames, seed, steps, guidance) of prompt ``i``: its line's options over the config's.
        ``--g`` guides a guidance-distilled model, ``--l`` one sampled with classifier-free guidance; the other is
        ignored, and said, as the tools that defined them do."""
        cfg, family = self.cfg, self.family
        frames = line.get("frames", self.frames if family.video else 1)
        if not family.video and frames != 1:
            raise ConfigError(f"sample prompt {i + 1} ('{self.prompts[i][:40]}') asks for --f {frames} frames, but "
                              f"{family.display_name} is an image model; remove --f")
        if family.video:
            family.latent_shape(self.model, 64, 64, frames)  # the family's frame rule, checked before training
        cfg_mode = self.rule.mode == "cfg"
        used, unused = ("cfg_scale", "guidance") if cfg_mode else ("guidance", "cfg_scale")
        if unused in line:
            self.cb.log(f"sample prompt {i + 1}: --{'g' if unused == 'guidance' else 'l'} is ignored: "
                        f"{family.display_name} takes {'a CFG scale (--l)' if cfg_mode else 'embedded guidance (--g)'}")
        return (line.get("width", cfg.resolution), line.get("height", cfg.resolution), frames,
                line.get("seed", cfg.seed), line.get("steps", cfg.steps), line.get(used, cfg.guidance))

    def _what(self) -> dict:
        """What a kept column was drawn with: columns of other prompts or settings are never mixed in."""
        from dataclasses import asdict

        what = {"prompts": self.prompts, "config": asdict(self.cfg)}
        if any(self.dataset.sample_settings):
            what["lines"] = list(self.dataset.sample_settings)
        return what

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
        from ..fileio import write_json_atomic

        steps = [int(title.split()[1]) for title, _ in self.columns]
        write_json_atomic(self.keep_dir / "columns.json", {"what": self._what(), "steps": steps},
                          "the kept sample columns", indent=None)

    def _kept_path(self, step: int, r: int) -> Path:
        return self.keep_dir / f"step-{step:07d}-p{r:02d}.{'webp' if self.family.video else 'png'}"

    def _keep(self, step: int, images: list) -> None:
        """One checkpoint's images (lossless PNGs) or clips (lossless animated WebPs) beside the run's state, then
        the manifest naming them."""
        from ..fileio import atomic_write

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

            self._condition_on_first_frames()
            with self.partner.placed() if self.partner is not None else contextlib.nullcontext() as partner:
                latents = self._sample_groups(autocast, partner)
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
            from ..fileio import atomic_write

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

    def _sample_groups(self, autocast, partner) -> list:
        """Every prompt's latents, in order: prompts of one size, frame count, step count and guidance are sampled
        together (each with its own seed's noise, as alone); a group larger than the configured sample size runs
        one row per forward (``max_rows`` was planned for that size)."""
        groups: dict[tuple, list[int]] = {}
        for i, (w, h, f, _, steps, scale) in enumerate(self.settings):
            groups.setdefault((w, h, f, steps, scale), []).append(i)
        planned = self.cfg.resolution ** 2 * self.frames
        out: list = [None] * len(self.settings)
        for (w, h, f, steps, scale), idx in groups.items():
            shape = (1, *self.family.latent_shape(self.model, w, h, f))
            noise = [torch.randn(shape, generator=torch.Generator().manual_seed(self.settings[i][3]),
                                 dtype=torch.float32) for i in idx]
            rows = self.max_rows if w * h * f <= planned else 1
            got = sample_prompts(self.model, self.family, [self.embeds[i] for i in idx], w, h, steps,
                                 self.settings[idx[0]][3], scale, self.device, self.dtype, autocast, self.rule,
                                 [self.negatives[i] for i in idx], noise=noise, frames=f, poll=self._poll,
                                 max_rows=rows, partner=partner)
            for i, lat in zip(idx, got):
                out[i] = lat
        return out

    def _condition_on_first_frames(self) -> None:
        """Once: each prompt's (and its negative's) first-frame conditioning, for an image-to-video model."""
        if self.first_frame is None or self._conditioned:
            return
        from .first_frame import preview_conditions

        conds = preview_conditions(self.dataset, self.family, self.vae(), self.cfg.resolution, self.cfg.resolution,
                                   self.frames, self.device, self.dtype, len(self.prompts))
        self.embeds = [e | c for e, c in zip(self.embeds, conds)]
        self.negatives = [n | c if n is not None else None for n, c in zip(self.negatives, conds)]
        self._conditioned = True

    def vae(self):
        if self._vae is None:
            self._vae = self.dataset.load_vae(self.family, self.dtype)
        return self._vae
