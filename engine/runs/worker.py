"""One training worker process: ``python -m lowvram_lora.engine.runs.worker SPEC.json``: a data-parallel rank, or one
part of a split with one process per GPU (the spec's ``split``).

Started by engine/runs/launch.py (one per GPU, RANK/WORLD_SIZE/MASTER_* in the
environment), or by ``torchrun`` on several hosts with the spec the launcher wrote
(then each rank uses cuda:LOCAL_RANK). Rank 0 prints progress as JSON lines for the
launcher and writes the trained LoRA; every rank watches the stop file.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from ..callbacks import StepInfo, TrainingCallback
from .launch import EVENT_PREFIX, STARTED_AT


class _Events(TrainingCallback):
    """Rank 0: every event as one JSON line on stdout; the others stay quiet. All ranks poll the
    stop file (the loop then agrees on the stop with the other ranks)."""

    def __init__(self, stop_file: Path, main: bool):
        self.stop_file, self.main = stop_file, main

    def _emit(self, event: dict) -> None:
        if self.main:
            sys.stdout.write(EVENT_PREFIX + json.dumps(event) + "\n")
            sys.stdout.flush()

    def on_step(self, info: StepInfo) -> None:
        self._emit({"type": "step", "info": vars(info)})

    def on_progress(self, stage: str, done: int, total: int) -> None:
        self._emit({"type": "progress", "stage": stage, "done": done, "total": total})

    def log(self, message: str) -> None:
        self._emit({"type": "log", "message": message})

    def on_sample(self, step: int, grid, path) -> None:
        self._emit({"type": "sample", "step": step, "path": path})

    def on_resume(self, step: int, total: int, loss_history, lr_history) -> None:
        self._emit({"type": "resume", "step": step, "total": total, "loss": loss_history, "lr": lr_history})

    def should_stop(self) -> bool:
        return self.stop_file.exists()


def _exit_with_parent() -> None:
    """No orphans: when the launcher is gone (killed, crashed), this process goes too."""
    parent = os.environ.get("LOWVRAM_PARENT_PID")
    if not parent:
        return  # under torchrun: its own agent watches the ranks

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != int(parent):
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lowvram_lora.engine.runs.worker",
                                     description="One data-parallel training rank (under our launcher or torchrun).")
    parser.add_argument("spec", help="the run description the launcher wrote (spec.json / spec-latest.json)")
    parser.add_argument("--save", default="", help="rank 0 also writes the LoRA here (ComfyUI format, bf16; "
                                                    "an existing file is kept)")
    args = parser.parse_args(argv)
    _exit_with_parent()
    spec = json.loads(Path(args.spec).read_text())
    spec["save"] = args.save
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    events = _Events(Path(spec["stop_file"]), main=rank == 0)
    try:
        return _train(spec, local_rank, events)
    except BaseException as exc:
        events._emit({"type": "error", "kind": type(exc).__name__, "message": str(exc)})
        raise


def _ready_seconds() -> float | None:
    """Seconds from the launcher starting this process to now (None under torchrun, which does not say)."""
    started = os.environ.get(STARTED_AT)
    try:
        return round(time.time() - float(started), 2) if started else None
    except ValueError:
        return None


def _train(spec: dict, local_rank: int, events: _Events) -> int:
    import torch

    from ..caching.cache import open_dataset_cache
    from ..config import LoraSettings, TrainConfig
    from ..models.inspect import ModelInfo, model_config_from_json
    from ..offload import OffloadConfig
    from ..train.loop import train_lora
    from ..lora_io.trained import write_trained
    from ..train.resume import ResumeStore
    from ..parallel.data_parallel import init_from_env, shutdown

    devices = spec["devices"]
    device = torch.device(devices[local_rank] if local_rank < len(devices) else f"cuda:{local_rank}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ready_s = _ready_seconds()  # before the process group, which waits for the other ranks
    if ready_s is not None:
        events.log(f"worker ready on {device} {ready_s:.1f} s after it was started (Python, imports, CUDA), with "
                   f"{torch.get_num_threads()} CPU threads")
    split = None
    if spec.get("split"):  # one process per part of a pipelined split (engine/parallel/process_split.py)
        from ..parallel.config import ParallelConfig
        from ..parallel.process_split import init_process_split

        split = ParallelConfig(**spec["split"])
        ranks = init_process_split(split.devices)
    else:
        ranks = init_from_env(device)
    try:
        # The Load node's identity of the checkpoint, used as it is (a spec written before it was passed: the
        # ModelConfig alone, identified in train_lora).
        info = spec.get("model_info")
        model = ModelInfo.from_json(info) if info else model_config_from_json(spec["model"])
        offload = spec["offload"]
        offload = OffloadConfig(**offload) if offload is not None else None
        budgets = spec.get("budgets_gb") or []
        if split is None and offload is not None and offload.mode == "auto" and local_rank < len(budgets) \
                and budgets[local_rank]:
            offload = replace(offload, vram_budget_gb=budgets[local_rank])  # (a split's come from its own settings)
        store = ResumeStore.from_args(spec["resume"], log=events.log)
        if split is not None:
            events.log("one process per GPU: no resumable states yet; a stopped run starts over")
            store = None
        sampling = None
        if spec.get("sampling"):
            from ..sampling import SamplingConfig

            sampling = SamplingConfig(**spec["sampling"])
        partner = spec.get("preview_partner")  # a mixture expert's partner, for rank 0's previews
        if spec.get("preview_partner_info"):
            partner = ModelInfo.from_json(spec["preview_partner_info"])
        elif partner is not None:
            partner = model_config_from_json(partner)
        result = train_lora(model, open_dataset_cache(spec["dataset_manifest"]), LoraSettings(**spec["lora"]),
                            TrainConfig(**{**spec["train"], "device": str(device)}), events, offload=offload,
                            resume=store, ranks=ranks, sampling=sampling, sample_dir=spec.get("sample_dir"),
                            preview_partner=partner, split=split)
        if ranks.is_main:
            if not result.interrupted and result.state_dict and store is not None:
                store.discard()
            Path(spec["run_dir"]).mkdir(parents=True, exist_ok=True)  # torchrun on another host: made here
            result.settings["worker_ready_s"] = ready_s
            result.settings["worker_done_at"] = time.time()  # the launcher times the process's exit from here
            write_trained(Path(spec["run_dir"]), "result", result, "the data-parallel result")
            if spec.get("save"):
                from ..lora_io import save_lora

                events.log(f"LoRA saved to {save_lora(result, spec['save'])}")
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
