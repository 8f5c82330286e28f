"""Kernel-level profile of training steps per offload mode, and where one mode's step time goes against another's
(issue 26 item 1: compiled resident against compiled int8 streaming at 1024²).

The random full-size model, synthetic cache and modes are bench/bench_memory.py's (``resident``,
``resident-compiled``, ``stream-k<K>[-act][-c<N>][-host][-m<M>][-b<B>]``, ``auto-<GB>[-compiled]``); list the
resident modes first (streamed modes move the blocks to the host, int8 with ``--precision int8``). Each mode trains
``warmup + timed + 2 + profiled`` steps through ``train_lora``: compiling happens in step 1, the ``timed`` steps give
the step time without the profiler, one profiler warm-up step follows, then 1 + ``profiled`` steps are recorded with
torch.profiler (CPU + CUDA, no shapes, no stacks) and the last ``profiled`` are analysed (the first recorded one pays
tracing's one-time costs). The engine's streaming functions are wrapped in ``lowvram::*``
record_function ranges by this script (no engine change), so their host time shows.

Writes to ``--out-dir``: ``profile_<mode>.json`` (bench/profile_analysis.py's summary, and the run's fields),
``summary.md`` (every mode, then each mode minus the first: the step cut on the compute stream, row by row, adding
up to the step-time difference), and with ``--trace`` ``trace_<mode>.json.gz`` (one profiled step, Chrome/Perfetto).

    source bench/gpu_env.sh
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/profile_step.py --variant flux1-dev --res 1024 \\
        --modes resident-compiled stream-k1-act-b1 --precision int8 --out-dir "$OUT/profile"

On a CPU, a check of the script on the tiny model (resident modes only; compiled with aot_eager)::

    python bench/profile_step.py --tiny --out-dir /tmp/profile
"""
from __future__ import annotations

import argparse
import functools
import gc
import gzip
import importlib
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import offload_for  # noqa: E402
from profile_analysis import analyze, diff_markdown, kineto_events, mode_markdown  # noqa: E402
from train_bench import StepRecorder, _gpu_name, _versions, build_random_model, write_synthetic_cache  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="flux1-dev")
    p.add_argument("--family", default="", help="the variant's family (default: the one that ships --variant)")
    p.add_argument("--res", default="1024", help="a side (1024) or WxH")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--modes", nargs="+", default=["resident-compiled", "stream-k1-act-b1"],
                   help="bench_memory.py's modes; resident ones first. Diffs are against the first")
    p.add_argument("--precision", default="int8", choices=["bf16", "int8"], help="the streamed modes' blocks")
    p.add_argument("--warmup", type=int, default=2, help="steps before anything is timed (step 1 compiles)")
    p.add_argument("--timed", type=int, default=2, help="steps timed without the profiler")
    p.add_argument("--profiled", type=int, default=2, help="steps analysed (one more is recorded before them)")
    p.add_argument("--out-dir", default=os.path.join(os.environ["OUT"], "profile") if os.environ.get("OUT")
                   else "bench/logs/profile")
    p.add_argument("--trace", action="store_true", help="also write the last profiled step per mode as a gzipped "
                                                        "Chrome trace (large: tens of MB)")
    p.add_argument("--tiny", action="store_true", help="the tiny Flux.1 on the CPU, fp32, resident modes, compiled "
                                                       "with aot_eager: a check of this script")
    p.add_argument("--device", default="", help="default: cuda, or cpu with --tiny")
    args = p.parse_args(argv)
    if args.tiny:
        args.variant = "flux1-tiny" if args.variant == "flux1-dev" else args.variant
        args.device = args.device or "cpu"
        if args.res == "1024":
            args.res = "64"
        if args.modes == p.get_default("modes"):
            args.modes = ["resident", "resident-compiled"]
    args.device = args.device or "cuda"
    if args.warmup < 1 or args.profiled < 1 or args.timed < 0:
        p.error("--warmup and --profiled must be at least 1, --timed at least 0")
    return args


# ------------------------------------------------------------------------------- lowvram:: ranges

#: (module, class or "", function, range name): the engine's streaming and step functions, wrapped at run time.
ANNOTATE = [
    ("offload.schedule", "BlockScheduler", "visit", "lowvram::visit"),
    ("offload.streamer", "CudaCopyEngine", "load", "lowvram::copy.load"),
    ("offload.streamer", "CudaCopyEngine", "wait_ready", "lowvram::copy.wait_ready"),
    ("offload.streamer", "CudaCopyEngine", "release", "lowvram::copy.release"),
    ("offload.streamer", "CudaCopyEngine", "harvest", "lowvram::copy.harvest"),
    ("offload.host", "HostBlock", "bind", "lowvram::host.bind"),
    ("offload.host", "HostBlock", "bind_host", "lowvram::host.bind_host"),
    ("offload.activations", "ActivationOffloader", "checkpoint", "lowvram::act.checkpoint"),
    ("offload.activations", "ActivationOffloader", "pack", "lowvram::act.pack"),
    ("offload.activations", "ActivationOffloader", "unpack", "lowvram::act.unpack"),
    ("offload.activations", "ActivationOffloader", "_fetch", "lowvram::act.fetch"),
    ("offload.block_checkpoint", "BlockCheckpoint", "forward", "lowvram::ckpt_forward"),
    ("offload.block_checkpoint", "BlockCheckpoint", "backward", "lowvram::ckpt_backward(recompute+bwd)"),
    ("train.loop", "", "_load_batch", "lowvram::load_batch"),
    ("train.loop", "", "_micro_step", "lowvram::micro_step(fwd+bwd)"),
    ("train.loop", "", "_optimizer_step", "lowvram::optimizer_step"),
]


def annotate_engine() -> list[str]:
    """Wrap each ANNOTATE function in a record_function range of its name (methods, static methods, module
    functions looked up at call time); missing ones are skipped with a note. Returns the ranges installed."""
    from torch.profiler import record_function

    installed = []
    for mod, cls, attr, label in ANNOTATE:
        try:
            module = importlib.import_module(f"lowvram_lora.engine.{mod}")
            owner = getattr(module, cls) if cls else module
            raw = inspect.getattr_static(owner, attr)
        except (ImportError, AttributeError) as exc:
            print(f"profile_step: not annotated {mod}.{cls}.{attr}: {exc}", flush=True)
            continue
        static = isinstance(raw, staticmethod)
        fn = raw.__func__ if static else raw
        if getattr(fn, "_profile_range", None):
            installed.append(label)
            continue

        def wrap(fn=fn, label=label):
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                with record_function(label):
                    return fn(*args, **kwargs)
            wrapper._profile_range = label
            return wrapper

        setattr(owner, attr, staticmethod(wrap()) if static else wrap())
        _ANNOTATED.append((owner, attr, raw))
        installed.append(label)
    return installed


_ANNOTATED: list[tuple[object, str, object]] = []  # (owner, name, what it was) of every wrapped function


def remove_annotations() -> None:
    """Put every function annotate_engine wrapped back (tests: the engine is shared by the process)."""
    while _ANNOTATED:
        owner, attr, raw = _ANNOTATED.pop()
        setattr(owner, attr, raw)


# ------------------------------------------------------------------------------------------ a mode

def place_for(mode: str, offload, state: dict, model, family, precision: str, device: torch.device) -> None:
    """Streamed modes want the blocks on the host (int8: quantized on the GPU block by block, then moved, as
    bench_flux2.to_streamed_form does); resident modes want them on the device, so they must come first."""
    streams = offload is not None and offload.mode != "resident"
    if streams and state["on_device"]:
        if device.type != "cuda":
            raise SystemExit(f"{mode}: streaming needs CUDA; on the CPU (--tiny) profile resident modes only")
        from bench_flux2 import to_streamed_form

        to_streamed_form(model, family, precision, device)
        state["on_device"], state["precision"] = False, precision
    if not streams and not state["on_device"]:
        raise SystemExit("list the resident modes before the streamed ones (the blocks have left the device)")


def profile_mode(args, mode: str, model, family, dataset, state: dict, device: torch.device, out_dir: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile, schedule

    from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.train import train_lora

    offload = offload_for(mode)
    place_for(mode, offload, state, model, family, args.precision, device)
    cuda = device.type == "cuda"
    wait = args.warmup + args.timed
    # Recorded: one step more than analysed. The first recorded step pays one-time costs of tracing (CUPTI's first
    # launch of each kernel function; on the CPU check, several hundred ms); it is kept out of the summary.
    steps = wait + 1 + 1 + args.profiled
    results = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities, schedule=schedule(wait=wait, warmup=1, active=1 + args.profiled, repeat=1),
                   on_trace_ready=lambda p: results.append(p.profiler.kineto_results),
                   record_shapes=False, with_stack=False, profile_memory=False)
    rec = StepRecorder(mode, lambda info: prof.step())
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    dtype = "fp32" if args.tiny else "bf16"
    row = {"mode": mode, "precision": state["precision"] if offload is not None and offload.mode != "resident"
           else dtype, "error": None}
    t0 = time.perf_counter()
    prof.start()
    result = None
    try:
        result = train_lora(ModelConfig(dtype=dtype, family=family.id), dataset,
                            LoraSettings(rank=args.rank, alpha=float(args.rank)),
                            TrainConfig(steps=steps, device=device.type, learning_rate=1e-4, batch_size=args.batch),
                            rec.callback, preloaded=(model, family, args.variant), offload=offload)
    except Exception as exc:  # noqa: BLE001 - the next mode still runs; the error is in the summary
        row["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        print("ERROR", row["error"], flush=True)
        traceback.print_exc()
    finally:
        prof.stop()
    times = [s.seconds_per_step for s in rec.steps]
    row.update(train_s=round(time.perf_counter() - t0, 1), step_times=[round(t, 4) for t in times],
               step_s_unprofiled=round(statistics.median(times[args.warmup:wait]), 4)
               if len(times) >= wait and args.timed else None,
               step_s_recorded_dropped=round(times[wait + 1], 4) if len(times) > wait + 1 else None,
               step_s_profiled=[round(t, 4) for t in times[wait + 2:]],
               breakdown_profiled=[s.breakdown for s in rec.steps[wait + 2:]],
               peak_alloc_gb=round(torch.cuda.max_memory_allocated(device) / 1e9, 3) if cuda else None)
    if result is not None:
        row["plan"] = result.settings.get("offload_plan")
        row["compile"] = result.settings.get("compile")
        row["offload_stats"] = result.settings.get("offload_stats")  # per step: copy busy and copy stall s
    if not results:
        row["error"] = row["error"] or f"the profiler recorded nothing ({len(times)} of {steps} steps ran)"
        return row
    t1 = time.perf_counter()
    try:
        events = kineto_events(results[-1])
        row["events"] = len(events)
        row["summary"] = analyze(events, steps=args.profiled)
        if args.trace:
            write_trace(events, out_dir / f"trace_{mode}.json.gz")
    except Exception as exc:  # noqa: BLE001 - keep the run's other fields and the next mode
        row["error"] = (row["error"] + "; " if row["error"] else "") + f"analysis: {type(exc).__name__}: {exc}"
        traceback.print_exc()
    row["analysis_s"] = round(time.perf_counter() - t1, 1)
    print(f"[{mode}] {row.get('events')} events analysed in {row['analysis_s']} s", flush=True)
    return row


def write_trace(events, path: Path) -> None:
    """The last profiled step as a Chrome trace (device streams and host threads), gzipped."""
    from profile_analysis import step_windows

    ws, we = step_windows(events)[-1]
    out = []
    for e in events:
        if ws <= e.start < we:
            dev = e.kind in ("kernel", "memcpy", "memset")
            out.append({"name": e.name, "ph": "X", "ts": e.start, "dur": max(e.end - e.start, 0.001),
                        "pid": "GPU" if dev else "CPU", "tid": e.lane, "cat": e.kind})
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": out}, f)
    print(f"trace: {path} ({len(out)} events)", flush=True)


# ------------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.tiny:  # no C++ / Triton code generation on a CPU check: the same capture and autograd split
        from lowvram_lora.engine.train import compile as compile_mod

        compile_mod.DEFAULT_BACKEND = "aot_eager"
    ranges = annotate_engine()
    from lowvram_lora.engine.families import families

    family_id = args.family or next(f.id for f in families().values() if args.variant in f.variants)
    t0 = time.perf_counter()
    dtype = torch.float32 if args.tiny else torch.bfloat16
    model, family, cfg = build_random_model(args.variant, device, dtype, 0.02, 0, family_id)
    print(f"built {args.variant} on {device} in {time.perf_counter() - t0:.1f} s", flush=True)
    res = int(args.res) if str(args.res).isdigit() else args.res
    tmp = tempfile.TemporaryDirectory(prefix="profile-step-")
    dataset = write_synthetic_cache(Path(tmp.name), family, args.variant, cfg, res, 2 * args.batch, 0)
    run = {"variant": args.variant, "res": res, "batch": args.batch, "rank": args.rank, "device": _gpu_name(device),
           **_versions(), "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "ranges": ranges,
           "command": " ".join([Path(sys.executable).name] + sys.argv)}
    state = {"on_device": True, "precision": "bf16"}
    rows = []
    for mode in args.modes:
        row = {**run, **profile_mode(args, mode, model, family, dataset, state, device, out_dir)}
        rows.append(row)
        (out_dir / f"profile_{mode}.json").write_text(json.dumps(row, indent=1, default=str))
        (out_dir / "summary.md").write_text(summary_markdown(rows))  # after every mode: a timeout keeps the rest
        print(f"[{mode}] written to {out_dir}", flush=True)
    tmp.cleanup()
    # The head of the summary (modes, then the diff tables) for the log; the whole file is in out_dir.
    print("\n".join((out_dir / "summary.md").read_text().splitlines()[:90]))
    return 0 if all(r.get("summary") for r in rows) else 1


def summary_markdown(rows: list[dict]) -> str:
    r0 = rows[0]
    head = [f"# Kernel profile: {r0['variant']} {r0['res']}, batch {r0['batch']}, LoRA r{r0['rank']}, "
            f"on {r0['device']} (torch {r0['torch']})", "",
            f"`{r0['command']}`", "",
            "| mode | precision | step s (no profiler) | profiled step ms | GPU busy ms (all / compute stream) | "
            "kernels/step | peak GB | error |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r.get("summary")
        head.append(f"| {r['mode']} | {r['precision']} | {r.get('step_s_unprofiled')} | "
                    + (f"{s['wall_ms']:.1f} | {s['busy_all_ms']:.1f} / {s['busy_compute_ms']:.1f} | "
                       f"{s['kernels_per_step']:.0f}" if s else "- | - | -")
                    + f" | {r.get('peak_alloc_gb')} | {r.get('error') or ''} |")
    parts = ["\n".join(head), ""]
    done = [r for r in rows if r.get("summary")]
    for r in done[1:]:
        parts.append(diff_markdown(done[0]["mode"], done[0]["summary"], r["mode"], r["summary"]))
    for r in done:
        parts.append(mode_markdown(r["mode"], r["summary"], r))
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
