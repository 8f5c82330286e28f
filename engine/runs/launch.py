"""Data parallel from one process (a ComfyUI node, ``lowvram-lora run``): start one worker
process per device, relay their progress, stop them cleanly, return rank 0's LoRA.

ComfyUI is one process, and CUDA + NCCL want one process per GPU, so the workers are
fresh Python processes (``python -m <package>.engine.runs.worker SPEC.json``, the same
entry point ``torchrun`` runs on several hosts). Nothing crosses a process boundary as a
pickle: the run is described by a JSON spec, progress comes back as JSON lines on rank 0's
stdout, a stop request is a file, and the trained LoRA is a safetensors file + JSON.

Shutdown rules: a stop (ComfyUI's Cancel, Ctrl-C) touches the stop file; the ranks agree on
it at the next step, rank 0 saves the resumable state, and all exit. A worker that dies
takes the others down at once (they are killed as a process group) and its last stderr
lines are shown. No worker outlives the launcher: each one also exits when its parent goes.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

from ..callbacks import StepInfo, TrainingCallback
from ..errors import ConfigError, LowVRAMError, WorkerError
from ..fileio import write_json_atomic
from ..models.inspect import ModelInfo
from ..parallel.data_parallel import NCCL_SAFE_ENV

#: Lines rank 0 prints for the launcher start with this; anything else is passed on as a log line.
EVENT_PREFIX = "@lowvram-event "
STOP_GRACE_S = 300.0  # after a stop request: time for the ranks to finish the step and save


def check_devices(devices: tuple[str, ...]) -> None:
    """Data parallel needs the GPUs it names, and matching ones (the slowest sets the pace, the smallest
    the memory plan)."""
    import torch

    cuda = [d for d in devices if d.startswith("cuda")]
    if not cuda:
        return  # CPU ranks (gloo): tests and machines without a GPU
    if len(cuda) != len(devices):
        raise ConfigError(f"devices={devices}: mix of CUDA and CPU devices; data parallel uses one kind")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [d for d in cuda if int(d.split(":")[1]) >= count]
    if missing:
        raise ConfigError(
            f"data parallel asks for {len(devices)} GPUs ({', '.join(devices)}) but this machine has {count}"
            + (f" ({', '.join(f'cuda:{i}' for i in range(count))})" if count else "")
            + f"; {', '.join(missing)} {'does' if len(missing) == 1 else 'do'} not exist. Name only GPUs that "
            f"exist, or train on one GPU without Dual-GPU Split")
    props = [torch.cuda.get_device_properties(int(d.split(":")[1])) for d in cuda]
    names = {p.name for p in props}
    mems = [p.total_memory for p in props]
    if len(names) > 1 or max(mems) > 1.1 * min(mems):
        raise ConfigError(
            f"data parallel needs matching GPUs, found {', '.join(f'{d}: {p.name} {p.total_memory / 1e9:.0f} GB' for d, p in zip(cuda, props))}. "
            f"Every rank runs the same plan in lockstep, so the smaller or slower card decides for all; use "
            f"mode='split', which sizes each side by its own budget")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _importable_root(run_dir: Path) -> str:
    """A folder on which ``import lowvram_lora`` finds this very package: ComfyUI imports custom nodes
    by path (the module is named after the folder, e.g. '.../custom_nodes/lowvram-lora'), and an
    installed copy elsewhere could be another version. So: a symlink next to the spec, first on the path."""
    link_dir = run_dir / "import"
    link_dir.mkdir(exist_ok=True)
    os.symlink(Path(__file__).resolve().parents[2], link_dir / "lowvram_lora")
    return str(link_dir)


def run_spec(model: ModelInfo, dataset, lora, train, parallel, store_args: dict, run_dir: Path, offload=None,
             sampling=None, sample_dir=None, preview_partner: ModelInfo | None = None) -> dict:
    """The run as JSON, for the workers (and for torchrun on several hosts). ``model_info`` is the Load node's
    identity of the checkpoint, which each worker uses instead of identifying it again; ``model`` is its
    ``ModelConfig``, which is all an older spec has (the worker identifies the checkpoint then)."""
    return {
        "model": asdict(model.config), "model_info": model.to_json(), "dataset_manifest": str(dataset.manifest_path),
        "lora": asdict(lora), "train": asdict(train), "offload": asdict(offload) if offload is not None else None,
        "devices": list(parallel.devices), "budgets_gb": list(parallel.vram_budget_gb),
        "resume": store_args, "run_dir": str(run_dir), "stop_file": str(run_dir / "STOP"),
        "sampling": asdict(sampling) if sampling is not None else None,
        "sample_dir": str(sample_dir) if sample_dir is not None else None,
        "preview_partner": asdict(preview_partner.config) if preview_partner is not None else None,
        "preview_partner_info": preview_partner.to_json() if preview_partner is not None else None,
    }


def train_data_parallel(model: ModelInfo, dataset, lora, train, callback, parallel, store_args: dict,
                        cache_dir: Path, offload=None, preloaded=None, sampling=None, sample_dir=None,
                        preview_partner: ModelInfo | None = None):
    """Train with one process per device in ``parallel.devices``; returns rank 0's TrainedLora. ``model`` (and
    ``preview_partner``): the Load node's, whose checkpoint identity each worker uses as it is."""
    from ..lora_io.trained import read_trained

    if preloaded is not None:
        raise ConfigError("data parallel loads the model in each worker process; a preloaded model cannot be "
                          "shared (run the worker under torchrun with your own model instead)")
    cb = callback or TrainingCallback()
    check_devices(parallel.devices)
    world = len(parallel.devices)
    run_root = Path(cache_dir) / "parallel"
    run_root.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=run_root))
    spec = run_spec(model, dataset, lora, train, parallel, store_args, run_dir, offload, sampling, sample_dir,
                    preview_partner)
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    # Kept after the run: the same training under torchrun on several hosts (README, Multi-GPU).
    write_json_atomic(run_root / "spec-latest.json", spec, "the data-parallel run description")
    env = {**os.environ, **NCCL_SAFE_ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(world), "PYTHONUNBUFFERED": "1", "LOWVRAM_PARENT_PID": str(os.getpid())}
    env["PYTHONPATH"] = os.pathsep.join([_importable_root(run_dir)] + [p for p in [env.get("PYTHONPATH")] if p])
    cb.log(f"data parallel: starting {world} worker processes on {', '.join(parallel.devices)} "
           f"(run description for torchrun: {run_root / 'spec-latest.json'})")
    procs, logs = [], []
    try:
        for rank in range(world):
            log = open(run_dir / f"rank{rank}.log", "wb")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "lowvram_lora.engine.runs.worker", str(spec_path)],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=subprocess.PIPE if rank == 0 else log, stderr=log, stdin=subprocess.DEVNULL,
                start_new_session=True))
        try:
            _supervise(procs, run_dir, cb)
        except WorkerError as exc:
            raise WorkerError(f"{exc}\n{_resume_note(store_args, train)}") from exc
        result = read_trained(run_dir, "result")
        if result is None:
            raise WorkerError(f"the workers exited without a result; logs in {run_dir}")
        shutil.rmtree(run_dir, ignore_errors=True)
        return result
    finally:
        _kill(procs)
        for log in logs:
            log.close()


def _resume_note(store_args: dict, train) -> str:
    """What a rerun of the same run does after the workers failed: resume from the state saved last, or
    start over."""
    from ..train.resume import ResumeStore

    store = ResumeStore.from_args(store_args)
    step = store.saved_step()
    if step is not None:
        return (f"Nothing is lost up to step {step}: run the same training again and it resumes from step "
                f"{step}/{train.steps} (the state saved in '{store.folder}').")
    if not store.enabled:
        return "No training state is saved with these settings: a rerun starts over."
    first = f" (the first is saved at step {store.save_every})" if store.save_every > 0 else ""
    return f"No training state was saved yet{first}: a rerun starts over."


def _supervise(procs, run_dir: Path, cb: TrainingCallback) -> None:
    events: queue.Queue = queue.Queue()
    reader = threading.Thread(target=_read_events, args=(procs[0].stdout, events), daemon=True)
    reader.start()
    stop_file = run_dir / "STOP"
    pending: BaseException | None = None
    stop_deadline = None
    while True:
        try:
            _dispatch(events, cb)
            if pending is None and stop_deadline is None and cb.should_stop():
                stop_file.touch()
                stop_deadline = time.monotonic() + STOP_GRACE_S
        except BaseException as exc:  # ComfyUI's Cancel raises in on_step / should_stop; Ctrl-C
            if pending is None:
                pending = exc
                stop_file.touch()
                stop_deadline = time.monotonic() + STOP_GRACE_S
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            _kill(procs)
            reader.join(timeout=5)
            _dispatch(events, cb, raise_errors=False)
            if pending is not None:
                raise pending
            raise _worker_failure(failed[0], codes[failed[0]], run_dir, events)
        if all(c == 0 for c in codes):
            reader.join(timeout=10)
            _dispatch(events, cb, raise_errors=False)
            if pending is not None:
                raise pending
            return
        if stop_deadline is not None and time.monotonic() > stop_deadline:
            _kill(procs)
            raise pending or WorkerError(f"the workers did not stop within {STOP_GRACE_S:.0f} s; killed them")
        time.sleep(0.05)


def _read_events(stream, events: queue.Queue) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        if line.startswith(EVENT_PREFIX):
            try:
                events.put(json.loads(line[len(EVENT_PREFIX):]))
                continue
            except json.JSONDecodeError:
                pass
        if line.strip():
            events.put({"type": "log", "message": line})


def _dispatch(events: queue.Queue, cb: TrainingCallback, raise_errors: bool = True) -> None:
    while True:
        try:
            ev = events.get_nowait()
        except queue.Empty:
            return
        kind = ev.get("type")
        if kind == "step":
            cb.on_step(StepInfo(**ev["info"]))
        elif kind == "progress":
            cb.on_progress(ev["stage"], ev["done"], ev["total"])
        elif kind == "log":
            cb.log(ev["message"])
        elif kind == "resume":
            cb.on_resume(ev["step"], ev["total"], ev["loss"], ev["lr"])
        elif kind == "sample" and ev.get("path"):
            from PIL import Image

            with Image.open(ev["path"]) as grid:
                cb.on_sample(ev["step"], grid.convert("RGB"), ev["path"])
        elif kind == "error":
            events.put(ev)  # kept for _worker_failure
            return


def _worker_failure(rank: int, code: int, run_dir: Path, events: queue.Queue) -> BaseException:
    """The error to raise for a dead worker: rank 0's own (same class when it is one of ours), else the
    tail of the worker's log."""
    from .. import errors

    while True:
        try:
            ev = events.get_nowait()
        except queue.Empty:
            break
        if ev.get("type") == "error":
            cls = getattr(errors, ev.get("kind", ""), None)
            if isinstance(cls, type) and issubclass(cls, LowVRAMError):
                return cls(ev["message"])
            return WorkerError(f"data-parallel rank {rank} failed: {ev.get('kind')}: {ev['message']}")
    tail = ""
    log = run_dir / f"rank{rank}.log"
    if log.exists():
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-15:])
    how = f"signal {-code}" if code < 0 else f"exit code {code}"
    return WorkerError(f"data-parallel worker rank {rank} died ({how}); the other workers were stopped. "
                       f"Last lines of its log ({log}):\n{tail}")


def _kill(procs) -> None:
    """Terminate every worker still running (its whole process group), then kill what is left."""
    import signal

    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 10
    for p in alive:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
