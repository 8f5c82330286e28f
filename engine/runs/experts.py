"""Both experts of a two-expert model in one run, one per GPU (Dual-GPU Split mode 'experts'; issue 42).

Wan 2.2 A14B is two transformers: the high-noise expert denoises sigma >= the boundary, the low-noise one below
(``NoiseSchedule.train_sigma_range`` / ``preview_partner``). A LoRA for it is two LoRAs, one per expert. With one GPU
they train one after the other; with two, this trains them at the same time: the expert connected to Train LoRA's
``model`` on the first device, the one connected to its ``preview_partner`` on the second.

How the work is shared: **each GPU draws within its own expert's noise range** (the same draws as a one-expert run),
from the one cached dataset (text embeddings and latents are cached once and read by both). The alternative, one
shared stream of batches whose drawn sigma picks the expert, would leave each GPU idle whenever a batch belongs to
the other (half the time on average, and unevenly: the high-noise range is 12.5% of sigmas but the shifted draw puts
more there); and the result would differ from a one-expert run, so neither LoRA could be checked against one.
So each expert's run *is* its one-expert run: same key (a finished one-expert run is reused, and vice versa), same
resume folder, same LoRA, with the other expert as its preview partner. Two worker processes (the data-parallel
worker entry point, one rank each, not a process group) run them; the connected expert's progress drives the
caller's (the node's bar and chart), the other's is relayed as log lines.

Wall time: the two runs overlap completely, so one two-expert run takes about as long as the slower expert's run
alone, on two GPUs; the target is <= 0.55x two one-expert runs back to back (bench/bench_parallel.py).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from ..callbacks import TrainingCallback
from ..errors import ConfigError, WorkerError
from ..fileio import FileLock
from ..lora_io.trained import TrainedLora
from ..models.inspect import ModelInfo
from .launch import (Worker, _importable_root, per_process_offload, read_result, run_spec, stop_workers,
                     supervise, worker_env)
from .finished import (check_reused_samples, load_finished, model_key, resume_args, samples_made_with,
                       store_finished, training_key)


class _OneDevice:
    """The part of a ParallelConfig one expert's worker reads: its device and its budget."""

    one_process_per_gpu = False  # each expert's worker trains its whole model

    def __init__(self, device: str, budget_gb: float):
        self.devices, self.vram_budget_gb = (device,), (budget_gb,)


def expert_pair(model: ModelInfo, partner: ModelInfo | None, family) -> str:
    """Checks that ``model`` and ``partner`` are the two experts of one model; returns ``model``'s role label.
    Named errors before anything loads."""
    if partner is None:
        raise ConfigError("Dual-GPU Split mode 'experts' trains the model and its preview_partner at once: connect "
                          "the other expert's Load Quantized Slab to Train LoRA's preview_partner (for Wan 2.2 "
                          "A14B: the low-noise expert when model is the high-noise one)")
    pairing = family.schedule.preview_partner(model.variant)
    if pairing is None:
        raise ConfigError(f"Dual-GPU Split mode 'experts' is for two-expert models (Wan 2.2 A14B); "
                          f"{family.display_name} {model.variant} is one model: use split or data_parallel")
    wanted, _ = pairing
    if partner.family != model.family or partner.variant != wanted:
        raise ConfigError(f"preview_partner is {partner.family} {partner.variant}, but the other expert of "
                          f"{model.variant} is {wanted}: connect that checkpoint's Load Quantized Slab")
    return _role(family, model.variant)


def _role(family, variant: str) -> str:
    low, high = family.schedule.train_sigma_range(variant)
    return "high-noise expert" if high >= 1.0 and low > 0 else "low-noise expert"


def train_experts(model: ModelInfo, dataset, lora, train, cache_dir: Path, callback, parallel,
                  preview_partner: ModelInfo | None = None, offload=None, sampling=None, sample_dir=None,
                  preloaded=None, loss=None, log_dir=None) -> TrainedLora:
    """Train ``model`` on ``parallel.devices[0]`` and ``preview_partner`` on ``devices[1]`` at once; returns
    ``model``'s TrainedLora with the partner's as ``companion`` (Save LoRA writes both). Each expert's finished run
    is reused when it exists (a one-expert run of the same settings counts), and stored when it finishes."""
    from ..families import get_family

    if preloaded is not None:
        raise ConfigError("mode 'experts' loads each expert in its own worker process; a preloaded model cannot "
                          "be shared")
    if loss is not None or log_dir:
        raise ConfigError("Loss & Validation Options (masked loss weight, validation, logs) are not built for Dual-GPU "
                          "Split mode 'experts' yet; unplug them, or train each expert on its own")
    cb = callback or TrainingCallback()
    family = get_family(model.family)
    roles = (expert_pair(model, preview_partner, family), _role(family, preview_partner.variant))
    experts = ((model, preview_partner), (preview_partner, model))
    keys = [training_key(model_key(m), dataset.dataset_hash, lora, train) for m, _ in experts]
    found = [load_finished(Path(cache_dir), k) for k in keys]
    for f, role, (m, other) in zip(found, roles, experts):
        if f is not None:
            cb.log(f"{role}: reusing the finished run (same model, dataset and settings)")
    todo = [i for i, f in enumerate(found) if f is None]
    if todo:
        locks = [FileLock(Path(cache_dir) / "locks" / f"training-{keys[i]}.lock", "the training run's lock")
                 for i in todo]
        held = []
        try:
            for i, lock in zip(todo, locks):
                if not lock.acquire():
                    raise ConfigError(f"the {roles[i]}'s run with these settings is running now ({lock.holder()}); "
                                      f"wait for it to finish and run again (this run then reuses its LoRA)")
                held.append(lock)
            trained = _run_workers(todo, experts, roles, keys, dataset, lora, train, cache_dir, cb, parallel,
                                   offload, sampling, sample_dir)
        finally:
            for lock in held:
                lock.release()
        for i, result in trained.items():
            if not result.interrupted and result.state_dict:
                result.settings["samples"] = (samples_made_with(dataset, sampling, experts[i][1].identity)
                                              if result.sample_grids else None)
                store_finished(Path(cache_dir), keys[i], result)
            found[i] = result
    for i, (_, other) in enumerate(experts):
        if i not in todo:
            found[i] = check_reused_samples(found[i], dataset, sampling, cb, other.identity)
    for result, role in zip(found, roles):
        result.settings["expert_role"] = role  # Save LoRA names each file by it
    main, companion = found
    main.companion = companion
    return main


def _run_workers(todo, experts, roles, keys, dataset, lora, train, cache_dir, cb, parallel, offload, sampling,
                 sample_dir) -> dict[int, TrainedLora]:
    """One worker process per expert still to train, each a one-rank run on its own device; their results."""
    run_root = Path(cache_dir) / "experts"
    run_root.mkdir(parents=True, exist_ok=True)
    env = worker_env(1, processes=len(todo))
    offload = per_process_offload(offload, len(todo), cb)
    workers, run_dirs = [], {}
    try:
        for i in todo:
            expert, other = experts[i]
            run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=run_root))
            run_dirs[i] = run_dir
            device = parallel.devices[i]
            spec = run_spec(expert, dataset, lora, replace(train, device=device), _OneDevice(device,
                            parallel.vram_budget_gb[i]), resume_args(expert, dataset, lora, train, cache_dir, keys[i]),
                            run_dir, offload, sampling, Path(sample_dir) / f"expert{i}" if sample_dir else None, other)
            spec_path = run_dir / "spec.json"
            spec_path.write_text(json.dumps(spec, indent=1))
            worker_vars = {**env, "RANK": "0", "LOCAL_RANK": "0",
                           "PYTHONPATH": os.pathsep.join([_importable_root(run_dir)]
                                                         + [p for p in [env.get("PYTHONPATH")] if p])}
            # The first expert still to train drives the progress; with the connected one reused, the other does.
            workers.append(Worker.start(spec_path, worker_vars, run_dir, "expert", f"{roles[i]} ({device})",
                                        main=i == todo[0], relay=True))
        cb.log("experts: training " + " and ".join(f"the {roles[i]} on {parallel.devices[i]}" for i in todo)
               + " at the same time" + ("" if len(todo) == 2 else " (the other expert's run was reused)"))
        supervise(workers, cb)
        out = {}
        for i in todo:
            result = read_result(run_dirs[i], workers[todo.index(i)])
            if result is None:
                raise WorkerError(f"the {roles[i]}'s worker exited without a result; logs in {run_dirs[i]}")
            out[i] = result
        exits = [f"the {roles[i]}'s {out[i].settings['worker_exit_s']:.1f} s" for i in todo
                 if "worker_exit_s" in out[i].settings]
        if exits:
            cb.log(f"experts: worker exit after writing the result: {', '.join(exits)}")
        for d in run_dirs.values():
            shutil.rmtree(d, ignore_errors=True)
        return out
    finally:
        stop_workers(workers)
