"""Both Wan 2.2 A14B experts at once (Dual-GPU Split mode ``experts``, issue 42) against two one-expert runs back to back.

Issue 42's target: the two-expert run's wall time <= 0.55x the two one-expert runs one after the other, Wan 2.2
T2V-A14B, 832x480x81, 8 GB VRAM budget per GPU, int8. On a 2-GPU machine (no torchrun: experts mode starts its own
worker processes):

    source bench/gpu_env.sh
    PYTHONUNBUFFERED=1 python3 bench/bench_experts.py --res 832x480x81 --steps 3 --budget 8 \
        --ckpt-dir /dev/shm --out "$OUT/results.jsonl"

A run long enough for the target (16+ steps: about 18 s a step each) outlasts one machine call of 10 minutes, so it
can span calls on the same machine, the slabs and rows kept in /dev/shm between them (W=/dev/shm/experts-bench):

    bench_experts.py --modes --keep-slabs --workdir $W --ckpt-dir /dev/shm          # the slabs only
    bench_experts.py --modes experts --steps 16 --budget 8 --keep-slabs --no-build --workdir $W --out $W/rows.jsonl
    bench_experts.py --modes serial --roles high_noise ...the same...
    bench_experts.py --modes serial --roles low_noise ...the same...
    bench_experts.py --summarize --steps 16 --budget 8 --workdir $W --out $W/rows.jsonl

(the serial wall is then the two one-expert runs' walls added; each is timed from its own start, as in one call).
The machine is given back when it idles for about 30 s between calls, and /dev/shm with it: so make the calls
back to back, and copy $W/rows.jsonl to $OUT in each. ``--no-build`` makes a call on a fresh machine stop in
seconds instead of rebuilding the slabs and then running out of the call's time (2026-11-28, twice).

What runs, in order (``--modes``; experts first by default: a kernel or compile cache the first mode fills on disk
then favours the serial runs, not the mode under test):

- the two experts as int8 slabs in ``--workdir``, as a user's run reads them: random full-size weights (``--variant``
  and the other expert, ``family.schedule.preview_partner``), each written as an fp8 checkpoint into ``--ckpt-dir``
  and quantized by the engine's ``build_slab`` (bench_ram.ensure_slab, its fast random fill), the checkpoint then
  deleted; on CUDA both experts are built at once in two processes. The experts' weights differ (each its own fill);
- a synthetic cached dataset of ``--clips`` random clips at ``--res`` WxHxF (train_bench.write_synthetic_cache);
- ``experts``: the engine entry the Train LoRA node calls (``train_or_reuse``) with a ParallelConfig of mode experts on
  cuda:0 + cuda:1, ``--budget`` GB each: the high-noise expert on cuda:0, the low-noise one on cuda:1, in two worker
  processes; then Save LoRA's writer for both;
- ``serial``: the same entry for one expert (Offload Config auto, ``--budget`` GB, cuda:0), the high-noise expert,
  then the low-noise one, each LoRA saved after its run.

Both modes: the same steps, seed, learning rate, dataset; each in a finished-run cache folder of its own (so neither
reuses the other's LoRA). ``wall_s``: from the mode's start to both LoRA files written. Per step: the trained
expert's own step times (``StepInfo.seconds_per_step``); in experts mode the worker beside the connected one reports
its steps as relayed log lines (every step here), timed by their arrival. Peak VRAM per GPU: each run's
``peak_vram_gb`` (max allocated). Host RAM: the bench process and its worker processes sampled every 20 ms from
``/proc/<pid>/status`` (bench_ram.status_of): the highest sum of RssAnon + RssShmem (what cannot be reclaimed,
pinned buffers included; the slab's page cache not), of VmRSS, and of VmLck + VmPin; beside it the engine's own
count of pinned host memory per step.

Check: each expert's LoRA from experts mode equals its one-expert run's (the same draws): the summary row records,
per expert, the largest absolute difference, the largest relative (Frobenius) difference of a tensor, and whether
they are bit-equal; ``loras_match`` holds when the relative difference is within ``--match-rtol`` (1e-6 on the CPU,
where both are the same computation; 1e-2 on CUDA by default, where attention's backward may sum in another order).

A smoke test on the CPU (tiny experts, cpu + cpu; tests/test_bench_experts.py runs it):

    python3 bench/bench_experts.py --device cpu --variant wan-tiny-high-noise --res 64x48x5 --steps 2 --clips 2 \\
        --rank 2 --lr 1e-2 --workdir /tmp/experts-bench --out /tmp/experts.jsonl
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

GB = 1e9
TARGET = 0.55  # issue 42: the two-expert run's wall time over the two one-expert runs'
ROLES = ("high_noise", "low_noise")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="wan")
    p.add_argument("--variant", default="wan2.2-t2v-a14b-high-noise",
                   help="the expert Train LoRA's model is (the other is its preview partner)")
    p.add_argument("--res", default="832x480x81", help="WxHxF of the cached clips")
    p.add_argument("--clips", type=int, default=4, help="synthetic cached clips")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--budget", type=float, default=8.0, help="VRAM budget per GPU, GB")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--modes", nargs="*", default=["experts", "serial"], choices=["experts", "serial"],
                   help="which modes, in this order (none: only build the slabs, with --keep-slabs for the next "
                        "call)")
    p.add_argument("--roles", nargs="+", default=list(ROLES), choices=ROLES,
                   help="serial mode: which one-expert runs (one each lets a long serial pair span two machine "
                        "calls; --summarize then joins the rows)")
    p.add_argument("--summarize", action="store_true",
                   help="train nothing: the summary row from the newest experts row and serial rows of both roles "
                        "in --out with these settings, their LoRA files in --workdir compared")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a smoke test on a tiny variant (both experts on cpu)")
    p.add_argument("--workdir", default="/tmp/experts-bench", help="the slabs, the dataset cache, the LoRA files")
    p.add_argument("--ckpt-dir", default="", help="where each random checkpoint is written before its slab is built "
                   "from it (default --workdir); /dev/shm keeps 2 x 14 GB off the disk (deleted once the slab is built)")
    p.add_argument("--ckpt-dtype", default="fp8", choices=("bf16", "fp8"),
                   help="the random checkpoints' dtype: fp8 (as ComfyUI's Wan 2.2 files) halves their bytes")
    p.add_argument("--build-jobs", type=int, default=0, choices=(0, 1, 2),
                   help="slabs built at once, in processes of their own (0: 2 on CUDA, 1 on the CPU)")
    p.add_argument("--keep-slabs", action="store_true", help="leave the slabs in --workdir (a rerun reuses them)")
    p.add_argument("--no-build", action="store_true",
                   help="stop at once when the slabs are not in --workdir, instead of building them: for a call that "
                        "continues an earlier one, where the machine may have been given back meanwhile (rebuilding "
                        "takes about 250 s, which a one-expert run of 16 steps then no longer fits beside)")
    p.add_argument("--project-steps", type=int, default=1000,
                   help="the summary also projects both walls to a run of this many steps from the measured parts")
    p.add_argument("--match-rtol", type=float, default=None,
                   help="largest relative difference of a LoRA tensor for loras_match (default 1e-6 cpu, 1e-2 cuda)")
    p.add_argument("--out", default="bench/results.jsonl")
    p.add_argument("--note", default="")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------- the slabs


def build_expert_slab(workdir: str, ckpt_dir: str, ckpt_dtype: str, variant: str, family_id: str,
                      fast: bool = True) -> tuple[str, dict]:
    """One expert's slab through bench_ram.ensure_slab (a random checkpoint, build_slab, the checkpoint deleted).
    Its fill is salted with the variant, so the two experts' weights differ (the fast fill keys on the name only).
    ``fast``: bench_ram's tiled fill (full size); else every tensor drawn on its own (tiny: cheaper than the pool)."""
    import bench_ram
    from lowvram_lora.engine.slab import testing

    fill, drawn = bench_ram.fast_random_tensors, testing.random_tensor

    def salted_fill():
        if fast:
            fill()
        tiled = testing.random_tensor
        testing.random_tensor = lambda name, *a, **kw: tiled(f"{variant}/{name}", *a, **kw)

    bench_ram.fast_random_tensors = salted_fill
    try:
        slab, info = bench_ram.ensure_slab(SimpleNamespace(workdir=workdir, variant=variant, ckpt_dir=ckpt_dir,
                                                           ckpt_dtype=ckpt_dtype, bits=8), family_id)
    finally:
        bench_ram.fast_random_tensors, testing.random_tensor = fill, drawn
    return str(slab), info


def build_slabs(args, variants: list[str]) -> tuple[list[Path], dict]:
    """Both experts' slabs; on CUDA in two processes at once (each a checkpoint write and a quantization pass, CPU-
    and memory-bound: about 100 s each for a 14B expert). Returns the paths and what the builds took."""
    fast = args.device == "cuda"
    jobs = [(args.workdir, args.ckpt_dir, args.ckpt_dtype, v, args.family, fast) for v in variants]
    t = time.perf_counter()
    if (args.build_jobs or (2 if args.device == "cuda" else 1)) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(len(jobs), mp_context=mp.get_context("spawn")) as pool:
            done = list(pool.map(build_expert_slab, *zip(*jobs)))
    else:
        done = [build_expert_slab(*job) for job in jobs]
    info = {"slabs_s": round(time.perf_counter() - t, 1), "slab_builds": [i for _, i in done]}
    print(f"slabs: {info}", flush=True)
    return [Path(s) for s, _ in done], info


# --------------------------------------------------------------------------------------------- host RAM


class HostSampler:
    """The bench process and every process below it (experts mode's workers), sampled every 20 ms: the highest sums
    of RssAnon + RssShmem, VmRSS and VmLck + VmPin (bench_ram.status_of), and the workers' share of the first."""

    def __init__(self):
        self.peaks = {"host": 0, "rss": 0, "locked": 0, "workers": 0}
        self.start = self._sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _tree() -> list[int]:
        """This process and its descendants. Workers are started from the main thread, so each process's main
        thread's ``children`` file names them (a few small reads per sample: the sampler shares this process's
        GIL with the serial runs' training loop); where the kernel has no such file, every /proc entry's parent."""
        me = os.getpid()
        if not Path(f"/proc/{me}/task/{me}/children").exists():
            return HostSampler._scan()
        out, todo = [], [me]
        while todo:
            pid = todo.pop()
            out.append(pid)
            try:
                todo.extend(int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
            except OSError:  # it exited
                continue
        return out

    @staticmethod
    def _scan() -> list[int]:
        parents: dict[int, list[int]] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            parents.setdefault(int(stat.rpartition(")")[2].split()[1]), []).append(int(entry.name))
        out, todo = [], [os.getpid()]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(parents.get(pid, []))
        return out

    def _sample(self) -> dict:
        from bench_ram import status_of

        total = {"host": 0, "rss": 0, "locked": 0, "workers": 0}
        for pid in self._tree():
            s = status_of(pid)
            if not s:
                continue
            host = s["RssAnon"] + s["RssShmem"]
            total["host"] += host
            total["rss"] += s["VmRSS"]
            total["locked"] += s["VmLck"] + s["VmPin"]
            if pid != os.getpid():
                total["workers"] += host
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            now = self._sample()
            for k, v in now.items():
                self.peaks[k] = max(self.peaks[k], v)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"host_peak_gb": round(self.peaks["host"] / GB, 3), "host_rss_peak_gb": round(self.peaks["rss"] / GB, 3),
                "host_locked_peak_gb": round(self.peaks["locked"] / GB, 3),
                "host_workers_peak_gb": round(self.peaks["workers"] / GB, 3),
                "host_at_start_gb": round(self.start["host"] / GB, 3)}


# --------------------------------------------------------------------------------------------- the modes


class Recorder:
    """A StepRecorder (the trained expert's steps) whose log lines are also kept with their arrival time: experts
    mode relays the other worker's steps as log lines."""

    def __init__(self, label: str):
        from train_bench import StepRecorder

        self.rec = StepRecorder(label)
        self.lines: list[tuple[float, str]] = []
        self.t0 = time.perf_counter()
        log = self.rec.callback.log

        def logged(message):  # the arrival time shown: where the start-up goes, phase by phase
            now = time.perf_counter()
            self.lines.append((now, message))
            log(f"(+{now - self.t0:.1f} s) {message}")

        self.rec.callback.log = logged

    @property
    def callback(self):
        return self.rec.callback

    def relayed_steps(self) -> tuple[list[float], list[float]]:
        """(seconds between the relayed worker's step lines, its losses): steps 2.. (the first counts the load)."""
        pattern = re.compile(r"^\[[^\]]+\] step (\d+)/\d+ loss (\S+)$")
        seen = [(t, int(m[1]), float(m[2])) for t, line in self.lines if (m := pattern.match(line))]
        return ([round(b[0] - a[0], 3) for a, b in zip(seen, seen[1:])], [s[2] for s in seen])


def _step_fields(steps: list) -> dict:
    times = [round(s.seconds_per_step, 4) for s in steps]
    return {"step_times": times, "losses": [round(s.loss, 5) for s in steps],
            "step_s": round(statistics.median(times[1:]), 4) if len(times) > 1 else (times[0] if times else None),
            "pinned_host_gb": max((s.pinned_host_gb for s in steps), default=None),
            "engine_host_ram_gb": max((s.host_ram_gb for s in steps), default=None)}


def _fixed_parts(result) -> dict:
    """Where a run's time outside its steps went, from its result: the start-up's phases and the end (the training
    loop's), and in experts mode the worker process's start (Python, imports, CUDA) and its exit after its result."""
    keys = ("startup_s", "finish_s", "worker_ready_s", "worker_exit_s")
    return {k: result.settings[k] for k in keys if result.settings.get(k) is not None}


def run_serial(args, ctx) -> dict:
    """The high-noise expert, then the low-noise one, each a one-expert run through train_or_reuse on the first
    device, its LoRA saved when it ends."""
    from lowvram_lora.engine.lora_io import save_lora
    from lowvram_lora.engine.runs.result_reuse import train_or_reuse

    sampler = HostSampler()
    t0 = time.perf_counter()
    experts, peaks = [], []
    try:
        for model, partner, role in [o for o in ctx.order if o[2] in args.roles]:
            rec = Recorder(f"serial {role}")
            t = time.perf_counter()
            result = train_or_reuse(model, ctx.dataset, ctx.lora, ctx.train, ctx.tmp / "serial-runs", rec.callback,
                                    offload=ctx.offload(args.budget), preview_partner=partner)
            save_lora(result, ctx.loras / f"serial_{role}.safetensors", overwrite=True)
            peaks.append(round(result.peak_vram_gb, 3))
            experts.append({"role": role, "device": ctx.devices[0], "wall_s": round(time.perf_counter() - t, 2),
                            "peak_alloc_gb": round(result.peak_vram_gb, 3), **_step_fields(rec.rec.steps),
                            **_fixed_parts(result)})
        wall = time.perf_counter() - t0
    finally:
        host = sampler.stop()
    row = {"mode": "serial", "devices": [ctx.devices[0]], "wall_s": round(wall, 2), "experts": experts,
           "step_s": _mean([e["step_s"] for e in experts]), "peak_alloc_gb_per_gpu": [max(peaks)],
           "pinned_host_gb": max((e["pinned_host_gb"] or 0.0 for e in experts), default=None), **host}
    return row


def run_experts(args, ctx) -> dict:
    """Both at once: train_or_reuse with Dual-GPU Split mode experts (the high-noise expert connected, the low-noise
    one its preview partner), then both LoRAs saved."""
    from lowvram_lora.engine.lora_io import save_lora
    from lowvram_lora.engine.parallel import ParallelConfig
    from lowvram_lora.engine.runs import launch
    from lowvram_lora.engine.runs.result_reuse import train_or_reuse

    (high, low, high_role), (_, _, low_role) = ctx.order
    parallel = ParallelConfig(mode="experts", devices=ctx.devices, vram_budget_gb=(args.budget,))
    rec = Recorder("experts")
    every, launch.RELAY_STEP_EVERY = launch.RELAY_STEP_EVERY, 1  # the other worker's every step (timed by arrival)
    sampler = HostSampler()
    try:
        t0 = time.perf_counter()
        both = train_or_reuse(high, ctx.dataset, ctx.lora, ctx.train, ctx.tmp / "experts-runs", rec.callback,
                              parallel=parallel, offload=ctx.offload(0.0), preview_partner=low)
        for result, role in ((both, high_role), (both.companion, low_role)):
            save_lora(result, ctx.loras / f"experts_{role}.safetensors", overwrite=True)
        wall = time.perf_counter() - t0
    finally:
        host = sampler.stop()
        launch.RELAY_STEP_EVERY = every
    main = _step_fields(rec.rec.steps)
    relayed, losses = rec.relayed_steps()
    other = {"step_times": relayed, "losses": losses,
             "step_s": round(statistics.median(relayed), 4) if relayed else None, "pinned_host_gb": None}
    experts = [{"role": high_role, "device": ctx.devices[0], "peak_alloc_gb": round(both.peak_vram_gb, 3), **main,
                **_fixed_parts(both)},
               {"role": low_role, "device": ctx.devices[1], "peak_alloc_gb": round(both.companion.peak_vram_gb, 3),
                **other, "step_times_how": "arrival of the relayed step lines", **_fixed_parts(both.companion)}]
    row = {"mode": "experts", "devices": list(ctx.devices), "wall_s": round(wall, 2), "experts": experts,
           "step_s": _mean([e["step_s"] for e in experts]),
           "peak_alloc_gb_per_gpu": [e["peak_alloc_gb"] for e in experts], "pinned_host_gb": main["pinned_host_gb"],
           **host}
    return row


def project(serial: dict, experts: dict, steps: int, n: int) -> dict:
    """A few timed steps are mostly start-up (worker processes, loading each expert): what is not steps (``*_fixed_s``:
    wall less ``steps`` x the mode's per-step time) and the ratio for an ``n``-step run, each further step costing the
    measured medians: serial both experts' steps one after the other, experts mode the slower expert's (they run
    side by side). A projection from measured parts, labelled as one, beside the measured ``x_serial``."""
    per = {"serial": [e.get("step_s") for e in serial.get("experts", [])],
           "experts": [e.get("step_s") for e in experts.get("experts", [])]}
    if not serial.get("wall_s") or not experts.get("wall_s") or None in per["serial"] + per["experts"] \
            or len(per["serial"]) != 2 or len(per["experts"]) != 2:
        return {}
    step = {"serial": sum(per["serial"]), "experts": max(per["experts"])}
    walls = {m: r["wall_s"] for m, r in (("serial", serial), ("experts", experts))}
    out = {f"{m}_fixed_s": round(walls[m] - steps * step[m], 1) for m in walls}
    at_n = {m: walls[m] + (n - steps) * step[m] for m in walls}
    out.update({"projected_steps": n, "serial_wall_projected_s": round(at_n["serial"], 1),
                "experts_wall_projected_s": round(at_n["experts"], 1),
                "x_serial_projected": round(at_n["experts"] / at_n["serial"], 3)})
    return out


def _mean(values):
    values = [v for v in values if v is not None]
    return round(statistics.fmean(values), 4) if values else None


def compare(loras: Path, losses: dict, rtol: float) -> dict:
    """Each expert's LoRA file of experts mode (``experts_<role>``) against its one-expert run's (``serial_<role>``) in
    ``loras``: largest absolute and relative (Frobenius) difference of a tensor, bit-equal or not, and the largest
    difference of the two runs' losses (``losses[role]`` = (experts', serial's)); ``loras_match`` when every relative
    difference is within ``rtol``."""
    import torch
    from safetensors.torch import load_file

    out, ok = {}, True
    for role in ROLES:
        a = load_file(str(loras / f"experts_{role}.safetensors"))
        b = load_file(str(loras / f"serial_{role}.safetensors"))
        if set(a) != set(b):
            out[role] = {"same_names": False}
            ok = False
            continue
        abs_diff = rel_diff = 0.0
        equal = True
        for k, ref in b.items():
            got = a[k].float()
            ref = ref.float()
            d = (got - ref).abs()
            abs_diff = max(abs_diff, float(d.max()))
            rel_diff = max(rel_diff, float(d.norm() / ref.norm().clamp_min(1e-30)))
            equal = equal and torch.equal(got, ref)
        mine, theirs = losses[role]
        out[role] = {"same_names": True, "tensors": len(b), "max_abs_diff": abs_diff, "max_rel_diff": rel_diff,
                     "bit_equal": equal,
                     "loss_max_diff": round(max((abs(x - y) for x, y in zip(mine, theirs)), default=0.0), 6)}
        ok = ok and rel_diff <= rtol
    return {"loras_match": ok, "match_rtol": rtol, "lora_diff": out}


def summary_row(experts: dict, serials: list[dict], args, loras: Path, cuda: bool) -> dict:
    """The summary of one experts row against the serial rows that hold both roles' one-expert runs (one row with
    both, or one row each when the pair spanned two calls: their walls add, as back to back)."""
    runs = {e["role"]: e for row in serials for e in row.get("experts", [])}
    wall = (sum(r["wall_s"] for r in serials) if all(r.get("wall_s") for r in serials) else None)
    serial = {"wall_s": round(wall, 2) if wall else None, "experts": [runs[r] for r in ROLES if r in runs],
              "step_s": _mean([runs[r].get("step_s") for r in ROLES if r in runs]),
              "peak_alloc_gb_per_gpu": [max((p for r in serials for p in r.get("peak_alloc_gb_per_gpu") or []),
                                            default=None)],
              "host_peak_gb": max((r.get("host_peak_gb") or 0.0) for r in serials)}
    ratio = round(experts["wall_s"] / serial["wall_s"], 3) if experts.get("wall_s") and serial["wall_s"] else None
    out = {"mode": "summary", "serial_wall_s": serial["wall_s"], "experts_wall_s": experts.get("wall_s"),
           "x_serial": ratio, "target_x_serial": TARGET, "meets_target": ratio is not None and ratio <= TARGET,
           "serial_step_s": serial["step_s"], "experts_step_s": experts.get("step_s"),
           "serial_peak_alloc_gb_per_gpu": serial["peak_alloc_gb_per_gpu"],
           "experts_peak_alloc_gb_per_gpu": experts.get("peak_alloc_gb_per_gpu"),
           "serial_host_peak_gb": serial["host_peak_gb"], "experts_host_peak_gb": experts.get("host_peak_gb")}
    if len(serials) > 1:
        out["from_runs"] = [r["run_id"] for r in (experts, *serials)]
    out.update(project(serial, experts, args.steps, args.project_steps))
    if set(runs) == set(ROLES) and "error" not in experts:
        rtol = args.match_rtol if args.match_rtol is not None else (1e-2 if cuda else 1e-6)
        by_role = {e["role"]: e for e in experts["experts"]}
        out.update(compare(loras, {r: (by_role[r]["losses"], runs[r]["losses"]) for r in ROLES}, rtol))
    return out


def summarize_rows(args, emit, loras: Path, cuda: bool) -> dict:
    """``--summarize``: the newest experts row and the newest serial run of each role in ``--out`` whose settings
    are this command's (res, steps, budget, seed, rank, clips; the serial rows the experts row's model and
    machine), joined into one summary row (with the experts row's machine)."""
    import json

    rows = [json.loads(line) for line in Path(args.out).read_text().splitlines() if line.strip()]
    want = {"res": args.res, "steps": args.steps, "budget_gb_per_gpu": args.budget, "seed": args.seed,
            "lora_rank": args.rank, "clips": args.clips}
    rows = [r for r in rows if r.get("bench") == "experts" and all(r.get(k) == v for k, v in want.items())
            and "error" not in r]
    experts = [r for r in rows if r["mode"] == "experts"]
    if not experts:
        raise SystemExit(f"--summarize: no experts row with {want} in {args.out}")
    experts = experts[-1]
    serials, seen = [], set()
    # the one-expert runs of the same machine kind only (they run on one GPU, so a one-GPU machine can make them)
    for row in reversed([r for r in rows if r["mode"] == "serial" and r["model"] == experts["model"]
                         and r.get("gpu") == experts.get("gpu")]):
        roles = {e["role"] for e in row["experts"]}
        if roles & seen:
            continue
        serials.insert(0, row)
        seen |= roles
        if seen == set(ROLES):
            break
    if seen != set(ROLES):
        raise SystemExit(f"--summarize: serial rows of {sorted(set(ROLES) - seen)} missing in {args.out} (with {want})")
    return emit({**summary_row(experts, serials, args, loras, cuda), "gpu": experts.get("gpu")})


# --------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    from lowvram_lora.engine.families import get_family

    family = get_family(args.family)
    pairing = family.schedule.preview_partner(args.variant)
    if pairing is None:
        raise SystemExit(f"--variant {args.variant} is not an expert of a two-expert model (e.g. "
                         f"wan2.2-t2v-a14b-high-noise, or wan-tiny-high-noise on the CPU)")
    if args.device == "cuda" and "experts" in args.modes:  # slabs and the one-expert runs need one GPU
        import torch

        if torch.cuda.device_count() < 2:
            raise SystemExit(f"experts mode needs two GPUs; this machine has {torch.cuda.device_count()} "
                             f"(--device cpu for the smoke test)")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    if args.summarize:
        high_first = sorted([args.variant, pairing[0]], key=lambda v: not _is_high(family, v))
        summarize_rows(args, _emitter(args, " + ".join(high_first), cuda, {}), workdir / "loras", cuda)
        return 0
    if args.no_build:
        import bench_ram

        missing = [v for v in (args.variant, pairing[0])
                   if not bench_ram.slab_path(SimpleNamespace(workdir=args.workdir, variant=v, bits=8)).exists()]
        if missing:
            raise SystemExit(f"--no-build: no slab of {', '.join(missing)} in {args.workdir} (a fresh machine?): "
                             f"build them first with --modes and --keep-slabs, in a call of its own")
    slabs, slab_info = build_slabs(args, [args.variant, pairing[0]])  # before CUDA starts here (spawned builders)

    import torch

    from train_bench import write_synthetic_cache
    from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.models.inspect import inspect_transformer
    from lowvram_lora.engine.offload import OffloadConfig

    devices = ("cuda:0", "cuda:1") if cuda else ("cpu", "cpu")
    infos = [inspect_transformer(ModelConfig(transformer_path=str(s), family=args.family,
                                             dtype="bf16" if cuda else "fp32")) for s in slabs]
    # (model, its partner, role): the high-noise expert first in both modes (experts mode: on the first device,
    # driving the progress), as Save LoRA names them.
    order = sorted([(infos[0], infos[1]), (infos[1], infos[0])], key=lambda p: not _is_high(family, p[0].variant))
    order = [(m, other, "high_noise" if _is_high(family, m.variant) else "low_noise") for m, other in order]
    tmp = tempfile.TemporaryDirectory(prefix="experts-bench-", dir=workdir)
    root = Path(tmp.name)
    dataset = write_synthetic_cache(root / "cache", family, infos[0].variant, family.load_config(infos[0].variant),
                                    args.res, args.clips, args.seed)
    loras = workdir / "loras"
    loras.mkdir(exist_ok=True)
    ctx = SimpleNamespace(
        order=order, dataset=dataset, devices=devices, tmp=root, loras=loras,
        lora=LoraSettings(rank=args.rank, alpha=float(args.rank)),
        train=TrainConfig(steps=args.steps, learning_rate=args.lr, batch_size=1, seed=args.seed, device=devices[0]),
        offload=lambda budget: OffloadConfig(mode="auto", vram_budget_gb=budget))
    emit = _emitter(args, f"{order[0][0].variant} + {order[1][0].variant}", cuda, slab_info)
    rows = {}
    try:
        for mode in args.modes:
            try:
                row = (run_experts if mode == "experts" else run_serial)(args, ctx)
            except Exception as exc:  # noqa: BLE001 - a row per failure
                import traceback

                traceback.print_exc()
                row = {"mode": mode, "error": f"{type(exc).__name__}: {str(exc)[:800]}", "wall_s": None}
            rows[mode] = emit(_with_common_fields(row))
        if "serial" in rows and "experts" in rows and set(args.roles) == set(ROLES):
            summary = emit(summary_row(rows["experts"], [rows["serial"]], args, loras, cuda))
            print(f"\nserial {summary['serial_wall_s']} s, experts {summary['experts_wall_s']} s: "
                  f"x{summary['x_serial']} (target <= {TARGET}); LoRAs match: {summary.get('loras_match')}", flush=True)
    finally:
        tmp.cleanup()
        if not args.keep_slabs:
            from lowvram_lora.engine.slab.format import manifest_path_for

            for slab in slabs:
                manifest_path_for(slab).unlink(missing_ok=True)
                slab.unlink(missing_ok=True)
    return 0


def _with_common_fields(row: dict) -> dict:
    """The figures every bench's rows carry under one name: peak VRAM (the highest GPU's) and host RAM (RSS; pinned
    is ``pinned_host_gb``), from this bench's own per-GPU and sampled peaks."""
    peaks = row.get("peak_alloc_gb_per_gpu") or []
    return {**row, "peak_alloc_gb": max(peaks) if peaks else None, "host_rss_gb": row.get("host_rss_peak_gb")}


def _emitter(args, model: str, cuda: bool, extra: dict):
    """The row writer with this run's common fields (bench, GPU, versions, settings, command)."""
    import torch

    from train_bench import _command, _gpu_name, _versions, new_run_id, row_emitter

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return row_emitter(out, {
        "run_id": new_run_id(), "bench": "experts",
        "gpu": (f"{torch.cuda.device_count()}x {_gpu_name(torch.device('cuda:0'))}" if cuda
                else _gpu_name(torch.device("cpu"))),  # the machine's GPUs (serial rows use the first)
        **_versions(), "model": model, "res": args.res, "precision": "int8", "budget_gb_per_gpu": args.budget,
        "lora_rank": args.rank, "batch": 1, "grad_ckpt": True, "steps": args.steps, "clips": args.clips,
        "seed": args.seed, "command": _command(), "note": args.note, **extra})


def _is_high(family, variant: str) -> bool:
    low, high = family.schedule.train_sigma_range(variant)
    return high >= 1.0 and low > 0


if __name__ == "__main__":
    raise SystemExit(main())
