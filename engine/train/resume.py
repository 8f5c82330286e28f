"""Resumable training state: saved every N steps and on a stop, loaded when the same run starts again.

    store = ResumeStore(cache_dir / "resume", key, settings, save_every=100, log=cb.log)
    state = store.load_latest()          # None, or the newest complete state of this exact run
    ...
    store.save_in_background(named_params, optimizer, scheduler, snapshot, loss_history, lr_history)
    for outcome in store.finished():     # at each step boundary: the background saves that ended
        ...
    store.save(named_params, optimizer, scheduler, snapshot, loss_history, lr_history)  # a stop: here, now

One state is two files in ``<cache>/resume/<key>/``, written atomically (engine/fileio):

    state-0000120.safetensors   LoRA weights ("lora/<param name>"), optimizer tensors
                                ("optim/<index>/<name>"), RNG states ("rng/...", uint8)
    state-0000120.json          step, data-order position, LR-scheduler state, optimizer
                                scalars and param groups, loss/lr history, settings, config hash

The JSON is written last and is the completion mark: a process killed between the two
leaves the previous state as the latest complete one. Older states are removed after a
newer one is complete. Nothing is pickled: tensors go to safetensors, scalars to JSON.

Each state carries checksums (SHA-256 of the safetensors file, and of the JSON's own
content), checked before anything is loaded: a state damaged on disk is set aside
(renamed ``damaged-state-...``, never trained from) with a message, and training resumes
from an older good state if there is one, else starts fresh. A save that fails (a full
disk) leaves no part of itself behind and keeps the previous state; the error names the
folder, its free space and the bytes the state needed.
Periodic saves are off the training thread (engine/train/state_writer.py): the state is
copied to host memory at the step boundary, then written on a worker thread while training
goes on; one is in flight at a time. The files are written the same way, so a kill during
a background write leaves the previous state as the latest complete one. ``save`` (a stop)
waits for a background save in flight, then writes on the caller's thread. A background
save's error is kept and handed to the training thread by ``finished``.
``key`` hashes every setting that changes the trained weights (the finished-run key), so
a state is only ever resumed by the same run; a state of the same model and dataset with
other settings is reported (what changed) and left alone.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from ..errors import StorageError
from ..fileio import atomic_write, write_json_atomic
from ..hashing import sha256_file
from .state_writer import HostStaging, SaveOutcome, StateWriter

# 2: noise/timestep/flip draws are keyed by the micro-batch count, no loop generator; 3: checksums
STATE_FORMAT = 3
_NAME = re.compile(r"^state-(\d{7})\.json$")
SET_ASIDE_PREFIX = "damaged-"  # a state that failed its check: kept for a look, never loaded




def info_sha256(info: dict) -> str:
    """The checksum of a state's JSON content (every field but this one), as it reads back from the file."""
    body = json.loads(json.dumps({k: v for k, v in info.items() if k != "info_sha256"}, default=str))
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


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
        self.last_saved_step = 0  # the newest complete state (set by the writer when it completes one)
        self._staging = HostStaging()  # the host copy of a state being saved, reused by the next save
        self._writer = StateWriter()

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
        """The newest complete, readable state of this run that passes its checksums; None (and why, when it
        matters). A state that fails its check is set aside with a message; an older one is tried next."""
        if not self.enabled:
            return None
        for step, info_path in self._states(self.folder):
            tensors_path = info_path.with_suffix(".safetensors")
            try:
                info = json.loads(info_path.read_text())
            except Exception as exc:  # truncated, or its tensors were never completed
                self.log(f"resume state '{info_path}' is unreadable ({type(exc).__name__}); trying an older one")
                continue
            if not isinstance(info, dict) or info.get("format") != STATE_FORMAT or info.get("key") != self.key:
                self.log(f"resume state '{info_path}' is from another version or run; not used")
                continue
            damage = self._check(info, tensors_path)
            if damage is None:
                try:
                    tensors = load_file(str(tensors_path))
                except Exception as exc:
                    damage = f"its tensors do not load ({type(exc).__name__}: {exc})"
            if damage is not None:
                self._set_aside(step, info_path, damage)
                continue
            self.last_saved_step = step
            return LoadedState(step, info["batches_drawn"], tensors, info, info_path)
        self._report_other_runs()
        return None

    @staticmethod
    def _check(info: dict, tensors_path: Path) -> str | None:
        """Why the state fails its checksums (damaged on disk), or None."""
        if info.get("info_sha256") != info_sha256(info):
            return "its JSON does not match its checksum"
        try:
            actual = sha256_file(tensors_path)
        except OSError as exc:
            return f"its tensor file cannot be read ({exc.strerror or exc})"
        if actual != info.get("tensors_sha256"):
            return "its tensor file does not match its checksum"
        return None

    def _set_aside(self, step: int, info_path: Path, why: str) -> None:
        """Rename a damaged state out of the way (never loaded again, kept for a look) and say so."""
        moved = []
        for path in (info_path.with_suffix(".safetensors"), info_path):
            with contextlib.suppress(OSError):  # another rank may have moved it already
                os.replace(path, path.with_name(SET_ASIDE_PREFIX + path.name))
                moved.append(path.with_name(SET_ASIDE_PREFIX + path.name).name)
        older = [s for s, _ in self._states(self.folder) if s < step]
        self.log(f"resume state of step {step} in '{self.folder}' failed its check ({why}: the file was damaged "
                 f"on disk); it is set aside{' as ' + ', '.join(moved) if moved else ''} and not used. "
                 + (f"Trying the state of step {older[0]}." if older else
                    "No earlier state is left: training starts fresh."))

    def saved_step(self) -> int | None:
        """The step of the newest complete state on disk (its JSON is there), without loading or checking it:
        what a rerun would resume from. None when there is none."""
        if not self.enabled:
            return None
        states = self._states(self.folder)
        return states[0][0] if states else None

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
        """Write the state after ``snapshot.step`` completed steps, on this thread, and drop older ones: complete
        and durable when this returns. A background save still in flight ends first (its outcome is kept for
        ``finished``)."""
        copy = self._capture(named_params, optimizer, scheduler, snapshot, loss_history, lr_history)
        return None if copy is None else self._write(*copy)

    def save_in_background(self, named_params, optimizer, scheduler, snapshot: RngSnapshot,
                           loss_history: list[float], lr_history: list[float]) -> bool:
        """Copy the state now (to host memory: training may change its tensors as soon as this returns) and
        write it on the writer thread. A save still in flight is waited for first: only one is ever in flight.
        Its outcome (the path, or the error) comes from ``finished``. False when there was nothing to save."""
        copy = self._capture(named_params, optimizer, scheduler, snapshot, loss_history, lr_history)
        if copy is None:
            return False
        self._writer.start(copy[0], lambda: self._write(*copy))
        return True

    def finished(self, wait: bool = False) -> list[SaveOutcome]:
        """The background saves that ended since the last call, oldest first: each its path or its error
        (a StorageError for want of storage). ``wait``: the one still in flight too (a stop, the end)."""
        return self._writer.finished(wait)

    @property
    def saving(self) -> bool:
        """A background save is still being written."""
        return self._writer.busy

    def close(self) -> None:
        """The run is over: wait for a save in flight (its outcome stays for ``finished``), free the host copy."""
        self._writer.close()
        self._staging.release()

    def _capture(self, named_params, optimizer, scheduler, snapshot: RngSnapshot, loss_history: list[float],
                 lr_history: list[float]) -> tuple[int, dict[str, torch.Tensor], dict] | None:
        """(step, host copies of the tensors, the JSON content but its checksums), taken now; None when this
        step needs no save. Waits for a save in flight first: its host copies are reused, and
        ``last_saved_step`` must be its."""
        self._writer.wait()
        step = snapshot.step
        if not self.enabled or step <= 0 or step == self.last_saved_step:
            return None
        opt_tensors, opt_info = _split_optimizer_state(optimizer.state_dict())
        tensors = {f"lora/{name}": p.detach().float() for name, p in named_params}
        tensors.update({f"optim/{k}": v for k, v in opt_tensors.items()})
        tensors["rng/cpu"] = snapshot.cpu
        tensors.update({f"rng/cuda/{i}": s for i, s in enumerate(snapshot.cuda)})
        info = {
            "format": STATE_FORMAT, "key": self.key, "family_key": self.family_key, "step": step,
            "batches_drawn": snapshot.batches_drawn, "optimizer": opt_info,
            "scheduler": _jsonable(scheduler.state_dict()), "loss_history": list(loss_history[:step]),
            "lr_history": list(lr_history[:step]), "settings": self.settings,
        }
        return step, self._staging.copy(tensors), info

    def _write(self, step: int, tensors: dict[str, torch.Tensor], info: dict) -> Path:
        """The files of a captured state, each complete or absent (temp name, fsync, rename); the JSON last, as
        the completion mark; then the older states removed. Runs on the writer thread or the caller's."""
        base = self.folder / f"state-{step:07d}"
        # What the file takes: the data plus a JSON header of ~100 bytes per tensor (for a full disk's message).
        size = sum(t.numel() * t.element_size() for t in tensors.values()) + 128 * len(tensors) + 8
        try:
            with atomic_write(base.with_suffix(".safetensors"), "the resumable training state", size=size) as tmp:
                save_file(tensors, str(tmp))
                digest = sha256_file(tmp)
            info = {**info, "tensors_sha256": digest}
            info["info_sha256"] = info_sha256(info)
            write_json_atomic(base.with_suffix(".json"), info, "the resumable training state", indent=None)
        except StorageError as exc:
            base.with_suffix(".safetensors").unlink(missing_ok=True)  # no half of this state stays behind
            kept = (f"the state of step {self.last_saved_step} saved before is kept" if self.last_saved_step
                    else "no earlier state of this run was saved")
            raise StorageError(f"{exc}; {kept}") from exc
        for old_step, old in self._states(self.folder):
            if old_step != step:
                old.unlink(missing_ok=True)
                old.with_suffix(".safetensors").unlink(missing_ok=True)
        self.last_saved_step = step
        return base.with_suffix(".json")

    def discard(self) -> None:
        """The run finished: its states are no longer needed (a save still in flight ends first)."""
        self._writer.wait()
        for _, info in self._states(self.folder):
            info.unlink(missing_ok=True)
            info.with_suffix(".safetensors").unlink(missing_ok=True)
        for leftover in self.folder.glob("*") if self.folder.is_dir() else []:
            if leftover.name.startswith(".state-"):  # a temp file of a killed save
                leftover.unlink(missing_ok=True)
            elif leftover.name == "samples" and leftover.is_dir():  # the sample columns kept for a resume
                import shutil

                shutil.rmtree(leftover, ignore_errors=True)
        try:
            self.folder.rmdir()
        except OSError:
            pass


#: Optimizer-state tensor subclasses stored by their plain parts (``__tensor_flatten__``: torchao's 8-bit, 4-bit
#: and fp8 AdamW moments) and rebuilt from them. Only these classes are ever rebuilt from a state file.
STATE_SUBCLASSES = {
    "OptimState8bit": ("torchao.optim.subclass_8bit", "OptimState8bit"),
    "OptimState4bit": ("torchao.optim.subclass_4bit", "OptimState4bit"),
    "OptimStateFp8": ("torchao.optim.subclass_fp8", "OptimStateFp8"),
}


def _attr_to_json(value):
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, (torch.Size, tuple, list)):
        return {"shape": [int(v) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot store a {type(value).__name__} attribute of an optimizer state without pickling it")


def _attr_from_json(value):
    if isinstance(value, dict) and "dtype" in value:
        dtype = getattr(torch, str(value["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {value['dtype']!r} in a saved optimizer state")
        return dtype
    if isinstance(value, dict) and "shape" in value:
        return torch.Size(int(v) for v in value["shape"])
    return value


def _split_optimizer_state(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """torch optimizer state_dict -> (tensors, JSON): tensors by "<param index>/<name>"; a torchao 8-bit
    moment (a tensor subclass) by its plain parts, "<param index>/<name>.<part>", its class and attributes
    in the JSON. Tensor-valued param-group entries (torchao keeps ``lr`` as a tensor) are noted to come back
    as tensors."""
    tensors, scalars, subclasses = {}, {}, {}
    for index, state in sd["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                if type(value) is torch.Tensor or isinstance(value, torch.nn.Parameter):
                    tensors[f"{index}/{name}"] = value.detach()
                    continue
                kind = type(value).__name__
                if kind not in STATE_SUBCLASSES or STATE_SUBCLASSES[kind][0] != type(value).__module__:
                    raise TypeError(f"optimizer state '{name}' is a {kind}, which a training state cannot store")
                parts, attrs = value.__tensor_flatten__()
                for part in parts:
                    tensors[f"{index}/{name}.{part}"] = getattr(value, part).detach()
                subclasses.setdefault(str(index), {})[name] = {
                    "class": kind, "parts": list(parts), "attrs": [_attr_to_json(a) for a in attrs]}
            else:
                scalars.setdefault(str(index), {})[name] = value
    group_tensors = [[i, k, str(v.dtype).removeprefix("torch.")] for i, g in enumerate(sd["param_groups"])
                     for k, v in g.items() if isinstance(v, torch.Tensor)]
    return tensors, {"param_groups": _jsonable(sd["param_groups"]), "scalars": _jsonable(scalars),
                     "subclasses": subclasses, "group_tensors": group_tensors}


def _rebuild_subclass(spec: dict, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    import importlib

    kind = spec.get("class")
    if kind not in STATE_SUBCLASSES:
        raise ValueError(f"a saved optimizer state names the class {kind!r}, which is not one of "
                         f"{sorted(STATE_SUBCLASSES)}")
    module, name = STATE_SUBCLASSES[kind]
    cls = getattr(importlib.import_module(module), name)
    return cls.__tensor_unflatten__({p: parts[p] for p in spec["parts"]},
                                    [_attr_from_json(a) for a in spec["attrs"]], None, None)


def _optimizer_state(tensors: dict[str, torch.Tensor], info: dict, named_params) -> dict:
    state: dict[int, dict] = {}
    subclasses = info.get("subclasses", {})
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optim/"):
            index, name = key[len("optim/"):].split("/", 1)
            base, _, part = name.rpartition(".")
            if base and base in subclasses.get(index, {}):
                parts.setdefault((int(index), base), {})[part] = value
            else:
                state.setdefault(int(index), {})[name] = value
    for (index, name), found in parts.items():
        state.setdefault(index, {})[name] = _rebuild_subclass(subclasses[str(index)][name], found)
    for index, values in info.get("scalars", {}).items():
        state.setdefault(int(index), {}).update(values)
    groups = info["param_groups"]
    for g in groups:
        if "betas" in g and isinstance(g["betas"], list):
            g["betas"] = tuple(g["betas"])
    for i, key, dtype in info.get("group_tensors", []):
        groups[i][key] = torch.tensor(groups[i][key], dtype=getattr(torch, dtype))
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
