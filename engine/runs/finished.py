"""Finished runs and their keys: what identifies a training run (``training_key``), where a finished one is stored
and read back, where a run saves its resumable state (``resume_args``), and what its sample grid shows. Used by
result_reuse.py (one run) and experts.py (a two-expert run, whose experts are stored as one-expert runs)."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import LoraSettings, TrainConfig
from ..hashing import stable_hash
from ..lora_io.trained import TrainedLora, read_trained, write_trained
from ..models.inspect import ModelInfo
from ..version import VERSION

if TYPE_CHECKING:
    from ..caching import DatasetCache
    from ..sampling import SamplingConfig

REUSE_FORMAT = 1  # bump when the stored entry's layout changes

_KEEP_OUT = ("device", "save_every")  # settings that do not change the trained weights
SNAPSHOT_FIELDS = ("snapshot_every", "snapshot_keep", "snapshot_dir")  # the same, of AdapterConfig


def model_key(model: ModelInfo) -> str:
    """The base model as a run's key sees it: its weights' identity and the variant it trains as. The variant
    counts: a Wan 2.2 A14B expert trains only on its own noise levels, and which expert a file is comes from its
    name, so two byte-identical files named as the two experts are two different runs."""
    return f"{model.identity}:{model.variant}"


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
    if lora.adapter.continue_from:  # the file's content, not only its name, is what the run starts from
        from ..hashing import path_identity
        from ..train.continue_from import continue_file

        settings["continue_from_identity"] = path_identity(continue_file(lora))
    shape = asdict(lora)
    for name in SNAPSHOT_FIELDS:  # where and how often loadable copies are written does not change the result
        shape["adapter"].pop(name)
    return stable_hash([VERSION, REUSE_FORMAT, model_identity, dataset_hash, shape, settings])


def load_finished(cache_dir: Path, key: str) -> TrainedLora | None:
    return read_trained(Path(cache_dir) / "trained", key)


def store_finished(cache_dir: Path, key: str, lora: TrainedLora) -> None:
    if lora.interrupted or not lora.state_dict:
        return
    write_trained(Path(cache_dir) / "trained", key, lora, "the finished-run cache")


def resume_args(model: ModelInfo, dataset, lora: LoraSettings, train: TrainConfig, cache_dir: Path, key: str) -> dict:
    """Where and how often the run under ``key`` saves its resumable state (engine/train/resume.py), as the plain
    dict a worker process gets in its spec."""
    from ..train.resume import auto_save_every

    every = auto_save_every(train.steps) if train.save_every == 0 else train.save_every
    settings = {"lora": asdict(lora), "train": {k: v for k, v in asdict(train).items() if k not in _KEEP_OUT}}
    # enabled for adamw8bit too: its 8-bit moments are stored by their plain parts (resume.py)
    return {"root": str(Path(cache_dir) / "resume"), "key": key, "settings": settings, "save_every": every,
            "family_key": stable_hash([model.identity, dataset.dataset_hash]), "enabled": True}


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


def check_reused_samples(found: TrainedLora, dataset, sampling, callback, partner_identity=None) -> TrainedLora:
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
