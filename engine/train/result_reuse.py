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

_KEEP_OUT = ("device", "gradient_checkpointing")  # settings that do not change the trained weights


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

    ``model`` is a ModelInfo (engine.models.inspect), ``dataset`` a DatasetCache.
    """
    from .loop import train_lora

    key = training_key(model.identity, dataset.dataset_hash, lora, train)
    found = load_finished(Path(cache_dir), key)
    if found is not None:
        if callback is not None:
            callback.log(f"reusing the finished run {key} (same model, dataset and settings); "
                         f"change a setting or the seed to train again")
        return found
    result = train_lora(model.config, dataset, lora, train, callback, **train_kwargs)
    store_finished(Path(cache_dir), key, result)
    return result
