"""Reuse a finished training run when a graph is rerun with identical inputs.

ComfyUI caches node outputs only within one server session, and the headless
runner is a new process each time; retraining for an unchanged graph would waste
hours. A completed (not interrupted) run is stored under a key that hashes the
base weights' identity, the dataset cache hash and every training setting.
Memory/offload settings are not in the key: they change speed, not the result.
"""
from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path

from safetensors.torch import load_file, save_file

from ..caching.hashing import stable_hash
from ..config import LoraSettings, TrainConfig
from ..fileio import atomic_write, write_json_atomic
from ..version import VERSION
from .trained_lora import TrainedLora

REUSE_FORMAT = 1  # bump when the stored entry's layout changes

_KEEP_OUT = ("device", "save_every")  # settings that do not change the trained weights


def training_key(model_identity: str, dataset_hash: str, lora: LoraSettings, train: TrainConfig) -> str:
    """The engine version is in the key: a fixed loop or new defaults must train again."""
    settings = {k: v for k, v in asdict(train).items() if k not in _KEEP_OUT}
    return stable_hash([VERSION, REUSE_FORMAT, model_identity, dataset_hash, asdict(lora), settings])


def load_finished(cache_dir: Path, key: str) -> TrainedLora | None:
    weights, info = cache_dir / "trained" / f"{key}.safetensors", cache_dir / "trained" / f"{key}.json"
    if not (weights.exists() and info.exists()):
        return None
    try:
        meta = json.loads(info.read_text())
        return TrainedLora(state_dict=load_file(str(weights)), **meta)
    except Exception:  # unreadable or from another layout: a miss, train again
        return None


def store_finished(cache_dir: Path, key: str, lora: TrainedLora) -> None:
    if lora.interrupted or not lora.state_dict:
        return
    folder = cache_dir / "trained"
    meta = {f.name: getattr(lora, f.name) for f in fields(lora) if f.name != "state_dict"}
    with atomic_write(folder / f"{key}.safetensors", "the finished-run cache") as tmp:
        save_file({k: v.contiguous() for k, v in lora.state_dict.items()}, str(tmp))
    write_json_atomic(folder / f"{key}.json", meta, "the finished-run cache", indent=None)  # last: marks it complete


def train_or_reuse(model, dataset, lora: LoraSettings, train: TrainConfig, cache_dir: Path, callback=None,
                   **train_kwargs) -> TrainedLora:
    """Return the stored result of an identical finished run, else train (and store it).

    Training resumes from the run's latest saved state (``<cache_dir>/resume/<key>/``), saves
    one every ``train.save_every`` steps and when stopped, and drops it once finished. Only a
    completed run is stored as finished: an interrupted or failed one never is.
    ``model`` is a ModelInfo (engine.models.inspect), ``dataset`` a DatasetCache.
    """
    from .loop import train_lora
    from .resume import ResumeStore, auto_save_every

    key = training_key(model.identity, dataset.dataset_hash, lora, train)
    found = load_finished(Path(cache_dir), key)
    if found is not None:
        if callback is not None:
            callback.log(f"reusing the finished run {key} (same model, dataset and settings); "
                         f"change a setting or the seed to train again")
        return found
    every = auto_save_every(train.steps) if train.save_every == 0 else train.save_every
    enabled = train.optimizer != "adamw8bit"
    if not enabled:
        if callback is not None:
            callback.log("resumable training states are not saved with optimizer='adamw8bit' (its 8-bit state "
                         "has no safetensors form here yet); use adamw to be able to resume")
    settings = {"lora": asdict(lora), "train": {k: v for k, v in asdict(train).items() if k not in _KEEP_OUT}}
    store = ResumeStore(Path(cache_dir) / "resume", key, settings, every,
                        log=callback.log if callback is not None else (lambda msg: None),
                        family_key=stable_hash([model.identity, dataset.dataset_hash]), enabled=enabled)
    result = train_lora(model.config, dataset, lora, train, callback, resume=store, **train_kwargs)
    if not result.interrupted and result.state_dict:
        store_finished(Path(cache_dir), key, result)
        store.discard()
    return result
