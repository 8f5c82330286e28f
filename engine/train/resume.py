"""Resumable training state: saved every N steps and on a stop, loaded when the same run starts again.

    store = ResumeStore(cache_dir / "resume", key, settings, save_every=100, log=cb.log)
    state = store.load_latest()          # None, or the newest complete state of this exact run
    ...
    store.save(step, named_params, optimizer, scheduler, snapshot, loss_history, lr_history)

One state is two files in ``<cache>/resume/<key>/``, written atomically (engine/fileio):

    state-0000120.safetensors   LoRA weights ("lora/<param name>"), optimizer tensors
                                ("optim/<index>/<name>"), RNG states ("rng/...", uint8)
    state-0000120.json          step, data-order position, LR-scheduler state, optimizer
                                scalars and param groups, loss/lr history, settings, config hash

The JSON is written last and is the completion mark: a process killed between the two
leaves the previous state as the latest complete one. Older states are removed after a
newer one is complete. Nothing is pickled: tensors go to safetensors, scalars to JSON.
``key`` hashes every setting that changes the trained weights (the finished-run key), so
a state is only ever resumed by the same run; a state of the same model and dataset with
other settings is reported (what changed) and left alone.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from ..fileio import atomic_write, write_json_atomic

STATE_FORMAT = 2  # 2: noise/timestep/flip draws are keyed by the micro-batch count, no loop generator
_NAME = re.compile(r"^state-(\d{7})\.json$")


def auto_save_every(steps: int) -> int:
    """Default interval: ~10 saves per run, at least every 250 steps (minutes of work on a
    big model), never more often than every 25 steps (a state is ~12 bytes per LoRA weight)."""
    return max(1, min(250, max(25, steps // 10)))


@dataclass
class RngSnapshot:
    """RNG states and the data-order position at the end of a completed step."""

    step: int
    batches_drawn: int
    cpu: torch.Tensor  # torch's global CPU RNG (dropout)
    cuda: list[torch.Tensor]  # one per visible CUDA device

    @classmethod
    def take(cls, step: int, batches_drawn: int) -> "RngSnapshot":
        """The loop's own draws (noise, timesteps, flips) are a pure function of the seed and the
        micro-batch count (engine/parallel/data_parallel.micro_generator): only the global RNGs
        (dropout) need saving."""
        cuda = [s.clone() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []
        return cls(step, batches_drawn, torch.get_rng_state().clone(), cuda)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda and torch.cuda.is_available() and len(self.cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(self.cuda)


@dataclass
class LoadedState:
    step: int
    batches_drawn: int
    tensors: dict[str, torch.Tensor]
    info: dict
    path: Path

    def apply(self, named_params: list[tuple[str, torch.nn.Parameter]], optimizer, scheduler) -> None:
        """Put weights, optimizer and scheduler state and RNGs back as they were at ``step``."""
        with torch.no_grad():
            for name, p in named_params:
                p.copy_(self.tensors[f"lora/{name}"].to(p.device, p.dtype))
        optimizer.load_state_dict(_optimizer_state(self.tensors, self.info["optimizer"], named_params))
        scheduler.load_state_dict(self.info["scheduler"])
        cuda = sorted((k for k in self.tensors if k.startswith("rng/cuda/")), key=lambda k: int(k.rsplit("/", 1)[1]))
        RngSnapshot(self.step, self.batches_drawn, self.tensors["rng/cpu"], [self.tensors[k] for k in cuda]).restore()


class ResumeStore:
    """The saved states of one training run (one ``key``)."""

    def __init__(self, root: Path, key: str, settings: dict, save_every: int,
                 log: Callable[[str], None] = lambda msg: None, family_key: str = "", enabled: bool = True):
        """``save_every``: periodic saves (<= 0: none; a stop still saves). ``enabled=False``:
        no state is read or written at all (an optimizer whose state has no safetensors form)."""
        self.root, self.key, self.settings, self.save_every = Path(root), key, settings, save_every
        self.enabled = enabled
        self.folder = self.root / key
        self.family_key = family_key  # model + dataset: finds states of the same data with other settings
        self.log = log
        self.last_saved_step = 0

    @classmethod
    def from_args(cls, args: dict, log: Callable[[str], None] | None = None) -> "ResumeStore":
        """From the plain dict train_or_reuse builds (data-parallel workers get it as JSON)."""
        return cls(Path(args["root"]), args["key"], args["settings"], args["save_every"],
                   log=log or (lambda msg: None), family_key=args["family_key"], enabled=args["enabled"])

    # --- reading -------------------------------------------------------------------
    def _states(self, folder: Path) -> list[tuple[int, Path]]:
        if not folder.is_dir():
            return []
        found = [(int(m[1]), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
        return sorted(found, reverse=True)

    def load_latest(self) -> LoadedState | None:
        """The newest complete, readable state of this run; None (and why, when it matters)."""
        if not self.enabled:
            return None
        for step, info_path in self._states(self.folder):
            try:
                info = json.loads(info_path.read_text())
                tensors = load_file(str(info_path.with_suffix(".safetensors")))
            except Exception as exc:  # truncated, or its tensors were never completed
                self.log(f"resume state '{info_path}' is unreadable ({type(exc).__name__}); trying an older one")
                continue
            if info.get("format") != STATE_FORMAT or info.get("key") != self.key:
                self.log(f"resume state '{info_path}' is from another version or run; not used")
                continue
            self.last_saved_step = step
            return LoadedState(step, info["batches_drawn"], tensors, info, info_path)
        self._report_other_runs()
        return None

    def _report_other_runs(self) -> None:
        """Say when a state exists for the same model and dataset but other settings."""
        if not self.family_key or not self.root.is_dir():
            return
        for folder in sorted(self.root.iterdir()):
            if folder == self.folder or not folder.is_dir():
                continue
            states = self._states(folder)
            if not states:
                continue
            try:
                info = json.loads(states[0][1].read_text())
            except Exception:
                continue
            if info.get("family_key") != self.family_key:
                continue
            changed = _changed(info.get("settings", {}), self.settings)
            self.log(f"a saved training state (step {info.get('step')}) of this model and dataset was made with "
                     f"other settings ({changed or 'engine version'}); it cannot be resumed with these, so "
                     f"training starts fresh. Set them back to resume it.")
            return

    # --- writing -------------------------------------------------------------------
    def due(self, step: int, total: int) -> bool:
        return self.save_every > 0 and step % self.save_every == 0 and step < total

    def save(self, named_params, optimizer, scheduler, snapshot: RngSnapshot,
             loss_history: list[float], lr_history: list[float]) -> Path | None:
        """Write the state after ``snapshot.step`` completed steps; drop older ones."""
        step = snapshot.step
        if not self.enabled or step <= 0 or step == self.last_saved_step:
            return None
        opt_tensors, opt_info = _split_optimizer_state(optimizer.state_dict())
        tensors = {f"lora/{name}": p.detach().float().cpu().contiguous() for name, p in named_params}
        tensors.update({f"optim/{k}": v for k, v in opt_tensors.items()})
        tensors["rng/cpu"] = snapshot.cpu
        tensors.update({f"rng/cuda/{i}": s for i, s in enumerate(snapshot.cuda)})
        base = self.folder / f"state-{step:07d}"
        with atomic_write(base.with_suffix(".safetensors"), "the resumable training state") as tmp:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        info = {
            "format": STATE_FORMAT, "key": self.key, "family_key": self.family_key, "step": step,
            "batches_drawn": snapshot.batches_drawn, "optimizer": opt_info,
            "scheduler": _jsonable(scheduler.state_dict()), "loss_history": loss_history[:step],
            "lr_history": lr_history[:step], "settings": self.settings,
        }
        write_json_atomic(base.with_suffix(".json"), info, "the resumable training state", indent=None)
        for old_step, old in self._states(self.folder):
            if old_step != step:
                old.unlink(missing_ok=True)
                old.with_suffix(".safetensors").unlink(missing_ok=True)
        self.last_saved_step = step
        return base.with_suffix(".json")

    def discard(self) -> None:
        """The run finished: its states are no longer needed."""
        for _, info in self._states(self.folder):
            info.unlink(missing_ok=True)
            info.with_suffix(".safetensors").unlink(missing_ok=True)
        for leftover in self.folder.glob("*") if self.folder.is_dir() else []:
            if leftover.name.startswith(".state-"):  # a temp file of a killed save
                leftover.unlink(missing_ok=True)
        try:
            self.folder.rmdir()
        except OSError:
            pass


def _split_optimizer_state(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """torch optimizer state_dict -> (tensors, JSON): tensors by "<param index>/<name>"."""
    tensors, scalars = {}, {}
    for index, state in sd["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
                    raise TypeError(f"optimizer state '{name}' is a {type(value).__name__}, not a plain tensor")
                tensors[f"{index}/{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[name] = value
    return tensors, {"param_groups": _jsonable(sd["param_groups"]), "scalars": _jsonable(scalars)}


def _optimizer_state(tensors: dict[str, torch.Tensor], info: dict, named_params) -> dict:
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optim/"):
            index, name = key[len("optim/"):].split("/", 1)
            state.setdefault(int(index), {})[name] = value
    for index, values in info.get("scalars", {}).items():
        state.setdefault(int(index), {}).update(values)
    groups = info["param_groups"]
    for g in groups:
        if "betas" in g and isinstance(g["betas"], list):
            g["betas"] = tuple(g["betas"])
    return {"state": state, "param_groups": groups}


def _jsonable(obj):
    """A state dict as JSON: tuples become lists, non-finite floats stay exact (strings)."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return obj  # json writes NaN/Infinity and reads them back
    if isinstance(obj, torch.Tensor):
        return obj.item() if obj.numel() == 1 else obj.tolist()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} in a training state without pickling it")


def _changed(old: dict, new: dict, prefix: str = "") -> str:
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            inner = _changed(a, b, f"{prefix}{k}.")
            if inner:
                out.append(inner)
        elif a != b:
            out.append(f"{prefix}{k}: {a} -> {b}")
    return ", ".join(out)
