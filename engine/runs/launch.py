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
from ..offload.hostmem import usable_cpus
from ..parallel.data_parallel import NCCL_SAFE_ENV

#: Lines rank 0 prints for the launcher start with this; anything else is passed on as a log line.
EVENT_PREFIX = "@lowvram-event "
#: The wall-clock time (``time.time()``) a worker process was started at, in its environment.
STARTED_AT = "LOWVRAM_STARTED_AT"
STOP_GRACE_S = 300.0  # after a stop request: time for the ranks to finish the step and save


def check_devices(devices: tuple[str, ...], matching: bool = True) -> None:
    """Data parallel needs the GPUs it names, and matching ones (the slowest sets the pace, the smallest
    the memory plan); a split's processes (``matching`` False) only GPUs that exist."""
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
    if not matching:
        return
    props = [torch.cuda.get_device_properties(int(d.split(":")[1])) for d in cuda]
    names = {p.name for p in props}
    mems = [p.total_memory for p in props]
    if len(names) > 1 or max(mems) > 1.1 * min(mems):
        raise ConfigError(
            f"data parallel needs matching GPUs, found {', '.join(f'{d}: {p.name} {p.total_memory / 1e9:.0f} GB' for d, p in zip(cuda, props))}. "
            f"Every rank runs the same plan in lockstep, so the smaller or slower card decides for all; use "
            f"mode='split', which sizes each side by its own budget")


def per_process_offload(offload, processes: int, cb: TrainingCallback | None = None):
    """``offload`` for each of ``processes`` worker processes on this host. They share its RAM, so each plans within
    its share of the run's RAM budget, resolved once here: with ``ram_budget_gb`` 0 each process would take the whole
    auto budget for itself (and a set budget is the run's, not each process's)."""
    if offload is None or processes <= 1:
        return offload
    from dataclasses import replace

    from ..offload.hostmem import resolve_ram_budget

    ram = resolve_ram_budget(offload.ram_budget_gb)
    share = ram.bytes / processes / 1e9
    if cb is not None:
        cb.log(f"RAM: {processes} worker processes share the run's {ram.describe()}: {share:.1f} GB each")
    return replace(offload, ram_budget_gb=share)


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
        # one process per part of a pipelined split (engine/parallel/process_split.py); None: data parallel
        "split": asdict(parallel) if parallel.one_process_per_gpu else None,
    }


def train_data_parallel(model: ModelInfo, dataset, lora, train, callback, parallel, store_args: dict,
                        cache_dir: Path, offload=None, preloaded=None, sampling=None, sample_dir=None,
                        preview_partner: ModelInfo | None = None):
    """Train with one process per device in ``parallel.devices`` (data parallel, or each part of a split with
    ``one_process_per_gpu``); returns rank 0's TrainedLora. ``model`` (and ``preview_partner``): the Load node's,
    whose checkpoint identity each worker uses as it is."""
    what = "the split's processes" if parallel.one_process_per_gpu else "data parallel"
    if preloaded is not None:
        raise ConfigError(f"{what}: each worker process loads the model; a preloaded model cannot be "
                          f"shared (run the worker under torchrun with your own model instead)")
    cb = callback or TrainingCallback()
    check_devices(parallel.devices, matching=not parallel.one_process_per_gpu)
    world = len(parallel.devices)
    run_root = Path(cache_dir) / "parallel"
    run_root.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=run_root))
    spec = run_spec(model, dataset, lora, train, parallel, store_args, run_dir, per_process_offload(offload, world, cb),
                    sampling, sample_dir, preview_partner)
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    # Kept after the run: the same training under torchrun on several hosts (README, Multi-GPU).
    write_json_atomic(run_root / "spec-latest.json", spec, "the data-parallel run description")
    env = worker_env(world)
    env["PYTHONPATH"] = os.pathsep.join([_importable_root(run_dir)] + [p for p in [env.get("PYTHONPATH")] if p])
    cb.log(f"{what}: starting {world} worker processes on {', '.join(parallel.devices)} "
           f"(run description for torchrun: {run_root / 'spec-latest.json'})")
    workers = []
    try:
        for rank in range(world):
            workers.append(Worker.start(spec_path, {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, run_dir,
                                        f"rank{rank}", f"{what} worker rank {rank}", main=rank == 0))
        try:
            supervise(workers, cb)
        except WorkerError as exc:
            raise WorkerError(f"{exc}\n{_resume_note(store_args, train)}") from exc
        result = read_result(run_dir, workers[0])
        if result is None:
            raise WorkerError(f"the workers exited without a result; logs in {run_dir}")
        shutil.rmtree(run_dir, ignore_errors=True)
        return result
    finally:
        stop_workers(workers)


def read_result(run_dir: Path, worker: "Worker"):
    """The TrainedLora ``worker`` wrote in ``run_dir`` (None if none), with ``worker_exit_s``: how long the process
    took to end (freeing its pinned host memory and its GPU) after writing it, both times from this host's clock."""
    from ..lora_io.trained import read_trained

    result = read_trained(run_dir, "result")
    if result is None:
        return None
    done_at = result.settings.pop("worker_done_at", None)
    if done_at is not None and worker.exited_at is not None:
        result.settings["worker_exit_s"] = round(max(0.0, worker.exited_at - done_at), 2)
    return result


def worker_env(world: int, processes: int | None = None) -> dict:
    """The environment every worker process starts with (its RANK / LOCAL_RANK are added per process).
    ``processes``: how many workers run on this host at once (default ``world``). Each gets that share of the
    CPUs as its torch threads (``OMP_NUM_THREADS``, unless the user set it): by default every process would start
    one thread per CPU, and the workers' host work (pinning and filling buffers, the host optimizer) would then
    run with several threads per CPU."""
    env = {**os.environ, **NCCL_SAFE_ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(world), "PYTHONUNBUFFERED": "1", "LOWVRAM_PARENT_PID": str(os.getpid())}
    if not os.environ.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = str(max(1, usable_cpus() // (processes or world)))
    return env


class Worker:
    """One worker process: its log file, its stop file, and whether its events drive the caller's progress
    (``main``) or are relayed as log lines under ``label`` (a data-parallel rank other than 0 prints none)."""

    def __init__(self, proc: subprocess.Popen, log, log_path: Path, run_dir: Path, label: str, main: bool,
                 relay: bool):
        self.proc, self.log, self.log_path, self.run_dir = proc, log, log_path, run_dir
        self.label, self.main, self.relay = label, main, relay
        self.exited_at: float | None = None  # time.time() when supervise first saw it gone
        self.stop_file = run_dir / "STOP"

    @classmethod
    def start(cls, spec_path: Path, env: dict, run_dir: Path, name: str, label: str, main: bool,
              relay: bool | None = None):
        """``python -m <package>.engine.runs.worker SPEC``; stdout piped when its events are read (``relay``,
        default: the main worker's), stderr (and an unread stdout) into ``run_dir/<name>.log``. ``label`` names it
        in messages."""
        relay = main if relay is None else relay
        log_path = run_dir / f"{name}.log"
        log = open(log_path, "wb")
        env = {**env, STARTED_AT: f"{time.time():.3f}"}  # the worker reports how long it took to be ready
        try:
            proc = subprocess.Popen([sys.executable, "-m", "lowvram_lora.engine.runs.worker", str(spec_path)],
                                    env=env, stdout=subprocess.PIPE if relay else log, stderr=log,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            log.close()
            raise
        return cls(proc, log, log_path, run_dir, label, main, relay)


def stop_workers(workers: list[Worker]) -> None:
    _kill([w.proc for w in workers])
    for w in workers:
        w.log.close()


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


def supervise(workers: list[Worker], cb: TrainingCallback) -> None:
    """Relay the workers' events until every one has exited; a stop (Cancel, Ctrl-C, ``cb.should_stop``) touches
    each stop file and waits up to ``STOP_GRACE_S`` for them to save and exit; one that dies stops the others."""
    events: queue.Queue = queue.Queue()
    readers = [threading.Thread(target=_read_events, args=(w.proc.stdout, events, i), daemon=True)
               for i, w in enumerate(workers) if w.relay]
    for r in readers:
        r.start()
    pending: BaseException | None = None
    stop_deadline = None

    def stop_all():
        for w in workers:
            w.stop_file.touch()
        return time.monotonic() + STOP_GRACE_S

    while True:
        try:
            _dispatch(events, cb, workers)
            if pending is None and stop_deadline is None and cb.should_stop():
                stop_deadline = stop_all()
        except BaseException as exc:  # ComfyUI's Cancel raises in on_step / should_stop; Ctrl-C
            if pending is None:
                pending = exc
                stop_deadline = stop_all()
        codes = [w.proc.poll() for w in workers]
        for w, code in zip(workers, codes):
            if code is not None and w.exited_at is None:
                w.exited_at = time.time()
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            _kill([w.proc for w in workers])
            for r in readers:
                r.join(timeout=5)
            _dispatch(events, cb, workers, raise_errors=False)
            if pending is not None:
                raise pending
            raise _worker_failure(workers[failed[0]], failed[0], codes[failed[0]], events)
        if all(c == 0 for c in codes):
            for r in readers:
                r.join(timeout=10)
            _dispatch(events, cb, workers, raise_errors=False)
            if pending is not None:
                raise pending
            return
        if stop_deadline is not None and time.monotonic() > stop_deadline:
            _kill([w.proc for w in workers])
            raise pending or WorkerError(f"the workers did not stop within {STOP_GRACE_S:.0f} s; killed them")
        time.sleep(0.05)


def _read_events(stream, events: queue.Queue, worker: int) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        if line.startswith(EVENT_PREFIX):
            try:
                events.put({**json.loads(line[len(EVENT_PREFIX):]), "worker": worker})
                continue
            except json.JSONDecodeError:
                pass
        if line.strip():
            events.put({"type": "log", "message": line, "worker": worker})


#: A relayed (not main) worker's training steps are logged every this many steps, and its last.
RELAY_STEP_EVERY = 25


def _dispatch(events: queue.Queue, cb: TrainingCallback, workers: list[Worker], raise_errors: bool = True) -> None:
    while True:
        try:
            ev = events.get_nowait()
        except queue.Empty:
            return
        kind = ev.get("type")
        w = workers[ev.get("worker", 0)]
        if kind == "error":
            events.put(ev)  # kept for _worker_failure
            return
        if not w.main:
            _relay_as_log(ev, w, cb)
        elif kind == "step":
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


def _relay_as_log(ev: dict, w: Worker, cb: TrainingCallback) -> None:
    """A worker beside the main one (the other expert): its news as log lines under its label."""
    kind = ev.get("type")
    if kind == "step":
        info = ev["info"]
        if info["step"] % RELAY_STEP_EVERY == 0 or info["step"] == info["total_steps"]:
            cb.log(f"[{w.label}] step {info['step']}/{info['total_steps']} loss {info['loss']:.4f}")
    elif kind == "log":
        cb.log(f"[{w.label}] {ev['message']}")
    elif kind == "resume":
        cb.log(f"[{w.label}] resumed at step {ev['step']}/{ev['total']}")
    elif kind == "sample" and ev.get("path"):
        cb.log(f"[{w.label}] samples at step {ev['step']}: {ev['path']}")


def _worker_failure(w: Worker, index: int, code: int, events: queue.Queue) -> BaseException:
    """The error to raise for a dead worker: its own (same class when it is one of ours), else the tail of
    its log."""
    from .. import errors

    reported = []  # error events; a data-parallel rank other than 0 prints none, and rank 0 has the same error
    while True:
        try:
            ev = events.get_nowait()
        except queue.Empty:
            break
        if ev.get("type") == "error":
            reported.append(ev)
    reported.sort(key=lambda ev: ev.get("worker", 0) != index)  # the dead worker's own first
    for ev in reported[:1]:
        cls = getattr(errors, ev.get("kind", ""), None)
        if isinstance(cls, type) and issubclass(cls, LowVRAMError):
            return cls(ev["message"])
        return WorkerError(f"{w.label} failed: {ev.get('kind')}: {ev['message']}")
    tail = ""
    log = w.log_path
    if log.exists():
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-15:])
    how = f"signal {-code}" if code < 0 else f"exit code {code}"
    return WorkerError(f"{w.label} died ({how}); the other workers were stopped. "
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
