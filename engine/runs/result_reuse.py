"""Reuse a finished training run when a graph is rerun with identical inputs.

ComfyUI caches node outputs only within one server session, and the headless
runner is a new process each time; retraining for an unchanged graph would waste
hours. A completed (not interrupted) run is stored under a key that hashes the
base weights' identity, the dataset cache hash and every training setting.
Memory/offload settings are not in the key: they change speed, not the result.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from ..hashing import stable_hash
from ..config import LoraSettings, TrainConfig
from ..errors import ConfigError
from ..fileio import FileLock
from ..version import VERSION
from ..lora_io.trained import TrainedLora, read_trained, write_trained
from ..models.inspect import ModelInfo

if TYPE_CHECKING:
    from ..caching import DatasetCache
    from ..sampling import SamplingConfig

REUSE_FORMAT = 1  # bump when the stored entry's layout changes

_KEEP_OUT = ("device", "save_every")  # settings that do not change the trained weights


def training_key(model_identity: str, dataset_hash: str, lora: LoraSettings, train: TrainConfig,
                 world_size: int = 1, loss=None) -> str:
    """The engine version is in the key: a fixed loop or new defaults must train again. Data parallel
    over W processes trains on W batches per micro-step, so W is part of the run; a split is not
    (it places the same computation on two devices)."""
    settings = {k: v for k, v in asdict(train).items() if k not in _KEEP_OUT}
    if world_size > 1:
        settings["data_parallel_world_size"] = world_size
    if loss is not None and loss.result_key_settings():  # Loss & Validation Options that change the weights
        settings["loss"] = loss.result_key_settings()
    return stable_hash([VERSION, REUSE_FORMAT, model_identity, dataset_hash, asdict(lora), settings])


def load_finished(cache_dir: Path, key: str) -> TrainedLora | None:
    return read_trained(Path(cache_dir) / "trained", key)


def store_finished(cache_dir: Path, key: str, lora: TrainedLora) -> None:
    if lora.interrupted or not lora.state_dict:
        return
    write_trained(Path(cache_dir) / "trained", key, lora, "the finished-run cache")


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
    world = parallel.world_size if parallel is not None else 1
    # A mixture expert's preview partner (a ModelInfo from its Load node) changes the samples only: its identity
    # goes into what the samples were made with, not into the run's key; the loop takes it as it is.
    partner: ModelInfo | None = train_kwargs.get("preview_partner")
    partner_identity = partner.identity if partner is not None else None
    if world > 1 and (train_kwargs.get("loss") is not None or train_kwargs.get("log_dir")):
        raise ConfigError("Loss & Validation Options (masked loss weight, validation, logs) are not built for data "
                          "parallel training yet; unplug them or train on one GPU (or split mode)")
    key = training_key(model.identity, dataset.dataset_hash, lora, train, world, train_kwargs.get("loss"))
    found = load_finished(Path(cache_dir), key)
    if found is not None:
        if callback is not None:
            callback.log(f"reusing the finished run {key} (same model, dataset and settings); "
                         f"change a setting or the seed to train again")
        return _check_reused_samples(found, dataset, train_kwargs.get("sampling"), callback, partner_identity)
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
            return _check_reused_samples(found, dataset, train_kwargs.get("sampling"), callback, partner_identity)
        return _train_and_store(model, dataset, lora, train, cache_dir, callback, parallel, key, partner_identity,
                                **train_kwargs)


def _train_and_store(model, dataset, lora: LoraSettings, train: TrainConfig, cache_dir: Path, callback, parallel,
                     key: str, partner_identity: str | None = None, **train_kwargs) -> TrainedLora:
    from ..train.loop import train_lora
    from ..train.resume import ResumeStore, auto_save_every

    every = auto_save_every(train.steps) if train.save_every == 0 else train.save_every
    enabled = True  # adamw8bit too: its 8-bit moments are stored by their plain parts (resume.py)
    settings = {"lora": asdict(lora), "train": {k: v for k, v in asdict(train).items() if k not in _KEEP_OUT}}
    store_args = {"root": str(Path(cache_dir) / "resume"), "key": key, "settings": settings, "save_every": every,
                  "family_key": stable_hash([model.identity, dataset.dataset_hash]), "enabled": enabled}
    if parallel is not None and parallel.mode == "data_parallel":
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


def samples_made_with(dataset: DatasetCache, sampling: SamplingConfig | None,
                      partner_identity: str | None = None) -> dict | None:
    """What a run's sample grid shows (the prompts and the sampling settings, and a mixture expert's preview
    partner: its weights' identity), or None without sampling. Not part of the run's key: samples do not change the
    trained weights."""
    if sampling is None or not sampling.enabled:
        return None
    out = {"prompts": [p for p, _ in dataset.sample_prompts], "config": asdict(sampling)}
    if any(dataset.sample_settings):  # per-prompt options (--w --h ...): other lines, other samples
        out["lines"] = list(dataset.sample_settings)
    if partner_identity is not None:
        out["preview_partner"] = partner_identity
    return out


def _check_reused_samples(found: TrainedLora, dataset, sampling, callback, partner_identity=None) -> TrainedLora:
    """A reused run keeps the sample grid made while it trained. When the sampling asked for now differs (other
    prompts or settings; sampling was off then), that grid is left out of the result, so the node and Save
    LoRA never pass it off as samples of the new prompts, and the log says so; samples are made only while
    training. A grid from before this was recorded is kept, and the log says it is the earlier run's."""
    now = samples_made_with(dataset, sampling, partner_identity)
    then = found.settings.get("samples", "unrecorded")
    grids = [g for g in found.sample_grids if Path(g).exists()]
    say = callback.log if callback is not None else (lambda msg: None)
    if now is None:
        return found
    if then == "unrecorded":
        if grids:
            say(f"the sample grid shown is the one made when this LoRA was trained ({grids[-1]}); its prompts may "
                f"differ from today's sample_prompts. Samples are made while training: change training_seed to "
                f"train again and sample the current prompts")
        return found
    if then == now:
        return found
    if then is None:
        why = "it was trained with sampling off"
    elif then["prompts"] != now["prompts"]:
        why = (f"its samples show {len(then['prompts'])} other prompt(s) "
               f"({'; '.join(p[:40] for p in then['prompts'][:3])}), not today's {len(now['prompts'])}")
    elif then.get("preview_partner") != now.get("preview_partner"):
        why = "its samples were drawn with another preview_partner (or none)"
    else:
        changed = ", ".join(f"sample_{k} {then['config'].get(k)} -> {v}" for k, v in now["config"].items()
                            if then["config"].get(k) != v)
        why = f"its samples were made with other sampling settings ({changed})"
    say(f"no sample grid for this run: the reused LoRA is the same training, but {why}"
        + (f" (the earlier grid is still at {grids[-1]})" if grids else "")
        + ". Samples are made while training: change training_seed to train again with the new sampling")
    found.sample_grids = []
    return found
