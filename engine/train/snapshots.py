"""Loadable snapshots: every ``snapshot_every`` steps, the adapter as a LoRA file (Save LoRA's comfyui format, bf16,
with the run's metadata and the step) in a folder of the run's own, keeping the latest ``snapshot_keep``. With EMA on,
each step's EMA is a file of its own beside it (``step_NNNNNNN_ema.safetensors``), as Save LoRA writes the final one.

Each file is written to a temporary name and renamed (``save_lora``), never over an existing file; only files this
run wrote are deleted when they fall out of the kept window. Rank 0 writes them (data parallel ranks hold the same
weights).
"""
from __future__ import annotations

import datetime as _dt
import uuid
from dataclasses import replace
from pathlib import Path

from ..config import LoraSettings
from ..errors import ConfigError
from ..lora_io import save_lora
from ..lora_io.trained import TrainedLora


class Snapshots:
    def __init__(self, settings: LoraSettings, family_id: str):
        cfg = settings.adapter
        if not cfg.snapshot_dir:
            raise ConfigError("snapshot_every is set but snapshot_dir is empty; give the folder for the snapshots")
        self.every, self.keep = cfg.snapshot_every, cfg.snapshot_keep
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.folder = Path(cfg.snapshot_dir).expanduser() / f"{family_id}_{stamp}_{uuid.uuid4().hex[:6]}"
        self.steps: list[list[Path]] = []  # the files of each step written and kept, oldest first

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def write(self, result: TrainedLora, state: dict, step: int, ema_state: dict | None = None) -> list[Path]:
        """``state`` (the adapter now) as a file named with ``step``, and ``ema_state`` (its EMA, when on) as its
        ``_ema`` file beside it; the oldest steps' files beyond ``keep`` removed. The paths written."""
        self.folder.mkdir(parents=True, exist_ok=True)
        snap = replace(result, state_dict=state, ema_state_dict={}, steps=step,
                       loss_history=result.loss_history[:step], lr_history=result.lr_history[:step], interrupted=False)
        stem = self.folder / f"step_{step:07d}"
        written = [save_lora(snap, stem.with_name(stem.name + ".safetensors"), fmt="comfyui", dtype="bf16")]
        if ema_state:
            written.append(save_lora(replace(snap, state_dict=ema_state, weights="ema"),
                                     stem.with_name(stem.name + "_ema.safetensors"), fmt="comfyui", dtype="bf16"))
        self.steps.append(written)
        while self.keep and len(self.steps) > self.keep:
            for path in self.steps.pop(0):
                path.unlink(missing_ok=True)
        return written

    @property
    def paths(self) -> list[Path]:
        """The files kept, oldest step first (each step's plain file, then its EMA's)."""
        return [p for written in self.steps for p in written]
