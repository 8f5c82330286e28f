"""Reuse a finished training run when a graph is rerun with identical inputs.

ComfyUI caches node outputs only within one server session, and the headless
runner is a new process each time; retraining for an unchanged graph would waste
hours. A completed (not interrupted) run is stored under a key that hashes the
base weights' identity, the dataset cache hash and every training setting.
Memory/offload settings are not in the key: they change speed, not the result.
"""
from __future__ import annotations

from pathlib import Path

from ..config import LoraSettings, TrainConfig
from ..errors import ConfigError
from ..fileio import FileLock
from ..lora_io.trained import TrainedLora
from ..models.inspect import ModelInfo
from .finished import (check_reused_samples, load_finished, model_key, resume_args, samples_made_with,
                       store_finished, training_key)

__all__ = ["load_finished", "model_key", "train_or_reuse", "training_key"]  # tests and callers import them from here


def train_or_reuse(model: ModelInfo, dataset, lora: LoraSettings, train: TrainConfig, cache_dir: Path, callback=None,
                   parallel=None, **train_kwargs) -> TrainedLora:
    """Return the stored result of an identical finished run, else train (and store it).

    Training resumes from the run's latest saved state (``<cache_dir>/resume/<key>/``), saves
    one every ``train.save_every`` steps and when stopped, and drops it once finished. Only a
    completed run is stored as finished: an interrupted or failed one never is.
    ``model`` is a ModelInfo (engine.models.inspect), ``dataset`` a DatasetCache. ``parallel``
    (engine/parallel ParallelConfig): split mode trains in this process across two GPUs; data
    parallel starts one worker process per GPU (engine/runs/launch.py). A second run of the same key
    while one runs (another process) is refused with a message: they would share one resume folder.
    """
    if parallel is not None and parallel.mode == "experts":
        from .experts import train_experts

        return train_experts(model, dataset, lora, train, cache_dir, callback, parallel, **train_kwargs)
    world = parallel.world_size if parallel is not None else 1
    # A mixture expert's preview partner (a ModelInfo from its Load node) changes the samples only: its identity
    # goes into what the samples were made with, not into the run's key; the loop takes it as it is.
    partner: ModelInfo | None = train_kwargs.get("preview_partner")
    partner_identity = partner.identity if partner is not None else None
    workers = world > 1 or (parallel is not None and parallel.one_process_per_gpu)  # training in worker processes
    if workers and (train_kwargs.get("loss") is not None or train_kwargs.get("log_dir")):
        raise ConfigError("Loss & Validation Options (masked loss weight, validation, logs) are not built for "
                          "training in worker processes (data parallel, one_process_per_gpu) yet; unplug them, or "
                          "train in one process (split mode without one_process_per_gpu)")
    if parallel is not None and parallel.one_process_per_gpu:
        from ..parallel.process_split import check_stage_run

        check_stage_run(train_kwargs.get("sampling"), dataset.validation_items, None, None)
    key = training_key(model_key(model), dataset.dataset_hash, lora, train, world, train_kwargs.get("loss"))
    found = load_finished(Path(cache_dir), key)
    if found is not None:
        if callback is not None:
            callback.log(f"reusing the finished run {key} (same model, dataset and settings); "
                         f"change a setting or the seed to train again")
        return check_reused_samples(found, dataset, train_kwargs.get("sampling"), callback, partner_identity)
    # One run per key at a time: two would share one resume folder and remove each other's states.
    lock = FileLock(Path(cache_dir) / "locks" / f"training-{key}.lock", "the training run's lock")
    if not lock.acquire():
        raise ConfigError(
            f"a training run with the same model, dataset and settings is running now ({lock.holder()}); it "
            f"saves its progress in '{Path(cache_dir) / 'resume' / key}', which two runs cannot share. Wait for "
            f"it to finish and run again (this run then reuses its LoRA), or change a setting or the seed to "
            f"train another one")
    with lock:
        found = load_finished(Path(cache_dir), key)  # it may have finished while we looked
        if found is not None:
            if callback is not None:
                callback.log(f"reusing the finished run {key}, which another process just finished")
            return check_reused_samples(found, dataset, train_kwargs.get("sampling"), callback, partner_identity)
        return _train_and_store(model, dataset, lora, train, cache_dir, callback, parallel, key, partner_identity,
                                **train_kwargs)


def _train_and_store(model, dataset, lora: LoraSettings, train: TrainConfig, cache_dir: Path, callback, parallel,
                     key: str, partner_identity: str | None = None, **train_kwargs) -> TrainedLora:
    from ..train.loop import train_lora
    from ..train.resume import ResumeStore

    store_args = resume_args(model, dataset, lora, train, cache_dir, key)
    if parallel is not None and (parallel.mode == "data_parallel" or parallel.one_process_per_gpu):
        from .launch import train_data_parallel

        result = train_data_parallel(model, dataset, lora, train, callback, parallel, store_args,
                                     Path(cache_dir), **train_kwargs)
    else:
        store = ResumeStore.from_args(store_args, log=callback.log if callback is not None else None)
        result = train_lora(model, dataset, lora, train, callback, resume=store, split=parallel,
                            **train_kwargs)
        if not result.interrupted and result.state_dict:
            store.discard()
    if not result.interrupted and result.state_dict:
        result.settings["samples"] = samples_made_with(dataset, train_kwargs.get("sampling"), partner_identity) \
            if result.sample_grids else None
        store_finished(Path(cache_dir), key, result)
    return result
