"""Multi-GPU benchmark (issue 16): one-GPU streamed vs split vs data parallel, with the all-resident
baseline of the same run. Random full-size models built in GPU memory (no files), synthetic cache.

Run under torchrun on a 2-GPU machine (NVLink multicast stays off; the script sets the variables too):

    source bench/gpu_env.sh
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/bench_parallel.py \\
        --family flux1 --variant flux1-dev --precision bf16 --budget 12 --out "$OUT/results.jsonl"

Modes, in order (rank 0 runs the one-process modes alone; rank 1 waits without touching its GPU,
then builds its own model for data parallel):

- ``resident``: bf16, every weight on cuda:0 (the baseline of the run);
- ``one``: ``auto`` at ``--budget`` GB on cuda:0 (the one-GPU streamed baseline);
- ``split``: Dual-GPU Split, mode split, ``--budget`` GB on each of cuda:0 and cuda:1 (the parts one after
  the other);
- ``pipeline``: the same split with ``micro_batches=--micro-batches``: each batch in that many pieces through the
  two parts in the 1F1B order, both GPUs at once (issue 42; skipped when --micro-batches is 1);
- ``interleave``: the pipelined split with interleaved stages, ``virtual_stages=--virtual-stages`` (2 by default;
  0: the planner's choice): each GPU holds that many chunks of blocks, not next to each other (issue 42; skipped when
  --micro-batches is 1 or odd);
- ``dp``: data parallel, one process per GPU, ``auto`` at ``--budget`` GB each;
- ``procs``: the pipelined split with one process per part (engine/parallel/process_split.py), ``--micro-batches``
  pieces, ``--budget`` GB each: each GPU's host work in an interpreter of its own. Needs torchrun's two processes;
  ``--split-devices cuda:0,cuda:0`` puts both on one GPU (gloo between them: a measure of the host floor, with
  ``--narrow``).

Every mode trains batches of ``--micro-batches`` images (1 by default), so their images/s compare; issue 42's
targets (pipelined split >= 1.8x one GPU at the same per-GPU budget):

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/bench_parallel.py --family flux2 \
        --variant flux2-dev --precision int8 --budget 12 --micro-batches 4 --modes one split pipeline \
        --out "$OUT/results.jsonl"
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/bench_parallel.py --family flux1 \
        --variant flux1-dev --precision bf16 --budget 12 --micro-batches 4 --modes one split pipeline \
        --out "$OUT/results.jsonl"

Interleaved stages against the plain pipeline at the same M (issue 42's 1.8x at M = 4: bound 1.78x at v = 2):

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/bench_parallel.py --family flux2 \
        --variant flux2-dev --precision int8 --budget 12 --micro-batches 4 --modes one pipeline interleave \
        --virtual-stages 2 --out "$OUT/results.jsonl"

A smoke test of this script on the CPU (a tiny model, both parts resident, no torchrun):

    python3 bench/bench_parallel.py --variant flux1-tiny --device cpu --res 128 --micro-batches 2 \
        --modes one split pipeline interleave --warmup 1 --timed 1 --out /tmp/parallel.jsonl

images/s = batch x world size / step s; scaling = dp images/s / (one images/s x world size).

Host RAM beside peak VRAM (every row; rank 0's process, which holds both parts of a split): ``peak_host_gb``
(RssAnon + RssShmem: what cannot be reclaimed, the figure the RAM plan is held to), ``peak_rss_gb`` (VmRSS, the
slab's mapped file pages too) and ``peak_locked_gb``, sampled every 20 ms while the mode runs (bench_ram.py's
fields); ``pinned_host_gb``: the pinned buffers the run reports (blocks, activations: cudaHostAlloc's pages do not
show as locked); ``predicted_host_peak_gb``: the RAM plan's prediction. The process keeps the model's host copy from
mode to mode, so a later mode's figure includes what an earlier one left pinned for reuse. ``host_cpu_cores``: the
process's CPU seconds per second over the timed steps (a pipelined split near 1.0 waits on Python, not the GPUs).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_bench import (  # noqa: E402
    StepRecorder, _command, _gpu_name, _versions, build_random_model, row_emitter, training_row, new_run_id,
)
from bench_flux2 import to_streamed_form  # noqa: E402

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="flux1", choices=["flux1", "flux2"])
    p.add_argument("--variant", default="flux1-dev")
    p.add_argument("--precision", default="bf16", choices=["bf16", "int8"], help="of the streamed modes")
    p.add_argument("--res", type=int, default=1024)
    p.add_argument("--budget", type=float, default=12.0, help="GB per GPU for one / split / dp")
    p.add_argument("--modes", nargs="+", default=["resident", "one", "split", "pipeline", "dp"])
    p.add_argument("--micro-batches", type=int, default=1,
                   help="images per batch in every mode, and the pipelined split's micro-batches (issue 42)")
    p.add_argument("--batch", type=int, default=0,
                   help="images per batch in every mode, a multiple of --micro-batches (0: --micro-batches, one image "
                        "a micro-batch); more puts several images in each micro-batch, so the split's threads make "
                        "fewer host calls per image")
    p.add_argument("--virtual-stages", type=int, nargs="+", default=[2],
                   help="the interleave mode's chunks per GPU (Dual-GPU Split virtual_stages; 0: the planner's choice); "
                        "several: a row each, in one run")
    p.add_argument("--compile", default="auto", choices=["auto", "blocks", "off"],
                   help="Offload Config compile for every streamed mode (auto: eager on the split and for runs this "
                        "short; blocks: the blocks compiled in every mode, the split too: --warmup 2)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a smoke test of the script on a tiny model (no dp)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timed", type=int, default=3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--out", default="bench/results.jsonl")
    p.add_argument("--note", default="")
    p.add_argument("--plan-only", action="store_true",
                   help="no GPU: print the split's plan for each --virtual-stages at --micro-batches (the planner on "
                        "the full-size variant built on the meta device, at --budget per GPU, on --link-gbps): check a "
                        "GPU command with it first")
    p.add_argument("--link-gbps", type=float, default=55.0, help="--plan-only: the host->GPU link it plans for "
                   "(55: 2x H200 measured, 2026-11-28)")
    p.add_argument("--narrow", action="store_true",
                   help="the variant's blocks at a tiny width (train_bench.narrow_config): every operator of a step, "
                        "next to no GPU time, so each mode's step is its host's; with --split-devices cuda:0,cuda:0 "
                        "one GPU shows what the split's two threads cost each other")
    p.add_argument("--split-devices", default="",
                   help="the split modes' two devices (default cuda:0,cuda:1; cpu,cpu with --device cpu); "
                        "cuda:0,cuda:0 puts both parts on one GPU")
    p.add_argument("--switch-interval", type=float, default=0.0, metavar="S",
                   help="sys.setswitchinterval(S) for the whole run (Python's default 0.005 s): the pipelined split's "
                        "two GPUs' threads share one interpreter lock (bench/gil_contention.py); rows carry "
                        "switch_interval_s")
    p.add_argument("--memory-history", type=int, default=0, metavar="N",
                   help="record each GPU's last N allocator events and write, beside --out, what was alive at each "
                        "mode's peak (memory_<mode>_r<rank>.json) and at an out-of-memory (oom_memory_r<rank>.json), "
                        "by the line that allocated it (bench/memory_trace.py; 400000 for a Flux.2-dev step). Slows "
                        "the run: not for timed rows")
    p.add_argument("--memory-stacks", choices=("python", "all"), default="python",
                   help="--memory-history's stacks: 'all' adds C++ frames, naming the backward's allocations (made on "
                        "autograd's thread, which has no Python frame), at a slower snapshot")
    args = p.parse_args(argv)
    if args.batch < 0:
        p.error(f"--batch {args.batch}: images per batch, at least 1 (0: --micro-batches)")
    args.batch = args.batch or args.micro_batches
    if args.batch % args.micro_batches:
        p.error(f"--batch {args.batch} is not a multiple of --micro-batches {args.micro_batches}")
    if args.split_devices:
        pair = [d.strip() for d in args.split_devices.split(",")]
        if len(pair) != 2 or not all(d == "cpu" or (d.startswith("cuda:") and d[5:].isdigit()) for d in pair):
            p.error(f"--split-devices {args.split_devices!r}: two devices, e.g. cuda:0,cuda:1 or cuda:0,cuda:0")
    return args


def _cache(root: Path, family, variant: str, cfg: dict, res: int, batch: int = 8):
    if family.id == "flux2":
        from bench_flux2 import write_synthetic_cache
    else:
        from train_bench import write_synthetic_cache
    return write_synthetic_cache(root, family, variant, dict(cfg), res, max(8, batch), 0)


class HostPeak:
    """This process's host memory, sampled every ``every`` s from /proc while a mode runs (bench_ram.py samples its
    child the same way): the peaks in bytes."""

    def __init__(self, every: float = 0.02):
        from lowvram_lora.engine.offload.hostmem import process_memory

        self._read, self.every = process_memory, every
        self.rss = self.host = self.locked = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host RAM sampler", daemon=True)

    def _sample(self) -> None:
        mem = self._read()
        self.rss, self.host = max(self.rss, mem.rss), max(self.host, mem.unreclaimable)
        self.locked = max(self.locked, mem.locked)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def __enter__(self) -> "HostPeak":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def fields(self, steps) -> dict:
        """The row's host RAM fields (GB); ``steps``: the run's StepInfo list (its reported pinned bytes)."""
        gb = lambda b: round(b / 1e9, 3)  # noqa: E731
        pinned = max((s.pinned_host_gb for s in steps), default=None)
        return {"peak_host_gb": gb(self.host), "peak_rss_gb": gb(self.rss), "peak_locked_gb": gb(self.locked),
                "host_rss_gb": gb(self._read().rss), "pinned_host_gb": pinned,
                "host_ram_peak_gb": max((s.host_ram_gb for s in steps), default=None),
                # the names every bench row carries beside its peak VRAM
                "host_ram_gb": gb(self.host), "pinned_gb": round(pinned, 3) if pinned is not None else None}


def _wait_for(path: Path) -> None:
    """Rank 1 idles on a file, not on a collective (an NCCL barrier would spin a kernel on cuda:1
    while rank 0 times its split there)."""
    while not path.exists():
        time.sleep(0.5)


def plan_only(args) -> int:
    """``--plan-only``: the pipelined split's plan (or the planner's refusal) for each ``--virtual-stages``, from the
    full-size variant on the meta device (its blocks as int8 slab layers with ``--precision int8``), on two GPUs of
    the assumed kind at ``--budget`` GB each. Nothing is trained: the figures are the planner's predictions."""
    from lowvram_lora.engine.config import LoraSettings
    from lowvram_lora.engine.families import get_family
    from lowvram_lora.engine.offload import OffloadConfig
    from lowvram_lora.engine.offload.footprint import workload_for
    from lowvram_lora.engine.offload.steptime import Machine, peak_flops_for
    from lowvram_lora.engine.parallel.split import plan_split, trainable_per_block
    from train_bench import meta_footprint

    family = get_family(args.family)
    cfg = family.load_config(args.variant)
    lora = LoraSettings(rank=args.rank, alpha=float(args.rank))
    model, fp = meta_footprint(family, args.variant, cfg, args.precision, lora, attach=True)
    per_block, outside = trainable_per_block(model, family)
    machine = Machine(args.link_gbps * 1e9, peak_flops_for("NVIDIA H200"), "H200 (assumed)",
                      f"assumed: {args.link_gbps:g} GB/s")
    gpus = (torch.device("cuda:0"), torch.device("cuda:1"))
    with tempfile.TemporaryDirectory(prefix="parallel-plan-") as tmp:
        dataset = _cache(Path(tmp), family, args.variant, cfg, args.res, args.batch)
        workload = workload_for(dataset, family, args.variant, args.batch)
        for v in args.virtual_stages:
            try:
                plan = plan_split(fp, per_block, outside, workload, OffloadConfig(mode="auto"), gpus,
                                  (int(args.budget * 1e9),) * 2, machines=(machine, machine),
                                  micro_batches=args.micro_batches, virtual_stages=v)
            except Exception as exc:  # noqa: BLE001 - the refusal is the answer
                print(f"v = {v}: REFUSED: {type(exc).__name__}: {exc}")
                continue
            print(f"v = {v}, M = {args.micro_batches}: predicted step {plan.predicted_step_s:.3f} s; {plan.describe()}")
    return 0


def main(argv=None) -> int:
    from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.offload import OffloadConfig
    from lowvram_lora.engine.parallel import ParallelConfig
    from lowvram_lora.engine.parallel.data_parallel import init_from_env, ranks_from_env, shutdown
    from lowvram_lora.engine.train import train_lora

    args = parse_args(argv)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    if args.plan_only:
        return plan_only(args)
    me = ranks_from_env()
    cuda = args.device == "cuda"
    pair = ("cuda:0", "cuda:1") if cuda else ("cpu", "cpu")
    if args.split_devices:
        pair = tuple(d.strip() for d in args.split_devices.split(","))
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', me.rank))}" if cuda else "cpu")
    if cuda and "procs" in args.modes and me.world_size == 2:
        device = torch.device(pair[me.rank])  # each process on its part's GPU (both on one: --split-devices)
    if cuda:
        torch.cuda.set_device(device)
    batch = args.batch
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    flag_dir = Path(os.environ.get("BENCH_FLAG_DIR", out.parent))
    dp_flag = flag_dir / f".dp-start-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
    seen_flag = dp_flag.with_name(dp_flag.name + "-seen")  # rank 1 saw dp_flag: rank 0 may remove it
    run_id = new_run_id()
    gpus = max(me.world_size, 2 if cuda and torch.cuda.device_count() >= 2 else 1)
    base = {"run_id": run_id, "gpu": f"{gpus}x {_gpu_name(device)}", **_versions(), "model": args.variant,
            "lora_rank": args.rank, "lora_targets": "default", "batch": batch, "grad_ckpt": True, "res": args.res,
            "precision": args.precision, "budget_gb_per_gpu": args.budget, "compile": args.compile,
            "command": _command(), "note": args.note, "switch_interval_s": sys.getswitchinterval(),
            "narrow": args.narrow, "split_devices": list(pair),
            "bench": "parallel"}
    emit = row_emitter(out, base) if me.is_main else (lambda row: row)
    lora = LoraSettings(rank=args.rank, alpha=float(args.rank))
    offload = lambda **kw: OffloadConfig(mode="auto", compile=args.compile, **kw)  # noqa: E731 - every streamed mode's
    steps = args.warmup + args.timed
    tmp = tempfile.TemporaryDirectory(prefix=f"parallel-bench-{me.rank}-")
    rows: dict = {}
    history = None
    if cuda and args.memory_history:
        from memory_trace import MemoryHistory

        history = MemoryHistory(args.memory_history, Path(args.out).parent / f"oom_memory_r{me.rank}.json",
                                args.memory_stacks)

    def run(mode: str, model, family, dataset, offload, **kw) -> dict:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            for d in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(d)
        clocks = []  # (wall, this process's CPU time) at each step's end
        rec = StepRecorder(f"{mode} r{me.rank}", hook=lambda info: clocks.append((time.perf_counter(),
                                                                                  time.process_time())))
        t = time.perf_counter()
        error, result = None, None
        with HostPeak() as host:
            try:
                result = train_lora(ModelConfig(dtype="bf16" if cuda else "fp32", family=family.id), dataset, lora,
                                    TrainConfig(steps=steps, device=str(device), learning_rate=1e-4, batch_size=batch),
                                    rec.callback,
                                    preloaded=(model, family, args.variant), offload=offload, **kw)
            except Exception as exc:  # noqa: BLE001 - a row per failure
                error = f"{type(exc).__name__}: {str(exc)[:600]}"
                print("ERROR", error, flush=True)
        row = training_row(rec, args.warmup, t, error, rows.get("resident", {}).get("step_s"), device)
        row.update(host.fields(rec.steps))  # host RAM beside peak VRAM
        # The CPU cores this process kept busy over the timed steps: a pipelined split near 1 is bound by Python
        # launching both GPUs' kernels under one interpreter lock (eager, one-image micro-batches), not by the GPUs.
        if len(clocks) > args.warmup > 0:
            (w0, c0), (w1, c1) = clocks[args.warmup - 1], clocks[-1]
            row["host_cpu_cores"] = round((c1 - c0) / (w1 - w0), 2)
        world = me.world_size if mode == "dp" else 1
        row["images_per_s"] = round(world * batch / row["step_s"], 4) if row["step_s"] else None
        settings = result.settings if result is not None else {}
        row["plan"] = settings.get("offload_plan")
        row["predicted_host_peak_gb"] = (row["plan"] or {}).get("predicted_host_peak_gb")
        predicted = (row["plan"] or {}).get("predicted_step_s")  # the split's: both parts + the crossing
        if predicted and row["step_s"]:  # issue 42: the split's prediction within 10% of the measured step
            row["predicted_step_s"] = predicted
            row["measured_over_predicted"] = round(row["step_s"] / predicted, 3)
        if mode == "procs":  # both processes' figures (the row is rank 0's)
            row["peak_alloc_gb_per_gpu"] = (settings.get("process_split") or {}).get("peak_vram_gb")
            row["peak_host_gb_per_process"] = kw["ranks"].gather(row["peak_host_gb"] or 0.0, device)
            row["pinned_host_gb_per_process"] = kw["ranks"].gather(row.get("pinned_host_gb") or 0.0, device)
            row["micro_batches"] = (row["plan"] or {}).get("micro_batches")
            row["cut"] = (row["plan"] or {}).get("cut")
        elif mode in ("split", "pipeline", "interleave"):
            row["peak_alloc_gb_per_gpu"] = settings.get("split_peak_vram_gb")
            row["micro_batches"] = (row["plan"] or {}).get("micro_batches")
            row["cut"] = (row["plan"] or {}).get("cut")
            row["virtual_stages"] = (row["plan"] or {}).get("virtual_stages")
            row["cuts"] = (row["plan"] or {}).get("cuts")
        elif mode == "dp":
            row["peak_alloc_gb_per_gpu"] = (settings.get("data_parallel") or {}).get("peak_vram_gb")
            row["weight_checksums"] = (settings.get("data_parallel") or {}).get("weight_checksums")
        else:
            row["peak_alloc_gb_per_gpu"] = [row["peak_alloc_gb"]]
        peaks = [p for p in row["peak_alloc_gb_per_gpu"] or [] if p]
        row["peak_max_over_min"] = round(max(peaks) / min(peaks), 3) if len(peaks) > 1 else None
        one = rows.get("one")
        if one and one.get("images_per_s") and row["images_per_s"]:
            row["x_one_gpu_images_per_s"] = round(row["images_per_s"] / one["images_per_s"], 3)
            row["scaling_efficiency"] = round(row["x_one_gpu_images_per_s"] / world, 3)
            row["x_one_gpu_step"] = round(row["step_s"] / one["step_s"], 3)
        if history is not None:  # what was alive at this mode's peak, by the line that allocated it
            tag = f"-v{kw['split'].virtual_stages}" if mode == "interleave" else ""
            path = Path(args.out).parent / f"memory_{mode}{tag}_r{me.rank}.json"
            history.write(path)
            row["memory_trace"] = path.name
        rows[mode] = emit({"mode": mode, **row})
        return rows[mode]

    model = family = cfg = None
    dataset = None
    if me.is_main:
        t = time.perf_counter()
        model, family, cfg = build_random_model(args.variant, device, torch.bfloat16 if cuda else torch.float32, 0.02,
                                                0, family_id=args.family, narrow=args.narrow)
        print(f"random {args.variant}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params in "
              f"{time.perf_counter() - t:.0f} s", flush=True)
        dataset = _cache(Path(tmp.name), family, args.variant, cfg, args.res, batch)
        if "resident" in args.modes:
            run("resident", model, family, dataset, None)
        to_streamed_form(model, family, args.precision, device)
        auto = offload(vram_budget_gb=args.budget)
        if "one" in args.modes:
            run("one", model, family, dataset, auto)
        # The split runs in this one process: it needs two GPUs, not two ranks (torchrun is for dp).
        two = not cuda or torch.cuda.device_count() > max(torch.device(d).index or 0 for d in pair)
        if not two and any(m in args.modes for m in ("split", "pipeline", "interleave")):
            print(f"split modes skipped: {pair[0]},{pair[1]} needs more GPUs than this machine's "
                  f"{torch.cuda.device_count()} (--split-devices cuda:0,cuda:0 puts both parts on one)", flush=True)
        if "split" in args.modes and two:
            run("split", model, family, dataset, offload(),
                split=ParallelConfig(mode="split", devices=pair, vram_budget_gb=(args.budget,)))
        if "pipeline" in args.modes and two and args.micro_batches > 1:
            run("pipeline", model, family, dataset, offload(),
                split=ParallelConfig(mode="split", devices=pair, vram_budget_gb=(args.budget,),
                                     micro_batches=args.micro_batches))
        if "interleave" in args.modes and two and args.micro_batches > 1 and args.micro_batches % 2 == 0:
            for v in args.virtual_stages:  # one row each, in this order
                run("interleave", model, family, dataset, offload(),
                    split=ParallelConfig(mode="split", devices=pair, vram_budget_gb=(args.budget,),
                                         micro_batches=args.micro_batches, virtual_stages=v))
        dp_flag.touch()
    else:
        _wait_for(dp_flag)
        seen_flag.touch()
    def own_model():
        """Rank 1's model and cache, built once, as rank 0's were (its process ran no one-process mode)."""
        built = build_random_model(args.variant, device, torch.bfloat16 if cuda else torch.float32, 0.02, 0,
                                   family_id=args.family, narrow=args.narrow)
        to_streamed_form(built[0], built[1], args.precision, device)
        return built[0], built[1], _cache(Path(tmp.name), built[1], args.variant, built[2], args.res, batch)

    if "dp" in args.modes and me.world_size >= 2 and cuda:
        ranks = init_from_env(device)
        if model is None:
            model, family, dataset = own_model()
        torch.distributed.barrier()
        run("dp", model, family, dataset, offload(vram_budget_gb=args.budget), ranks=ranks)
        shutdown()
    if "procs" in args.modes and me.world_size == 2:
        from lowvram_lora.engine.parallel.process_split import init_process_split

        ranks = init_process_split(pair)
        if model is None:
            model, family, dataset = own_model()
        torch.distributed.barrier()
        run("procs", model, family, dataset, offload(),
            split=ParallelConfig(mode="split", devices=pair, vram_budget_gb=(args.budget,),
                                 micro_batches=args.micro_batches), ranks=ranks)
        shutdown()
    if me.is_main:
        if me.world_size >= 2:
            # Removed before rank 1 polled it (every 0.5 s), the flag would leave rank 1 waiting for ever and
            # torchrun with it (the runs of 2026-11-28 ended so, after their rows were written).
            _wait_for(seen_flag)
        dp_flag.unlink(missing_ok=True)
        seen_flag.unlink(missing_ok=True)
        print("\nmode       step s   images/s   x one-GPU img/s   peak GB per GPU   host RAM GB (predicted)   pinned GB")
        for mode, r in rows.items():
            print(f"{mode:9s} {r['step_s'] or float('nan'):8.3f} {r['images_per_s'] or float('nan'):10.3f} "
                  f"{r.get('x_one_gpu_images_per_s') or float('nan'):17.3f}   {r['peak_alloc_gb_per_gpu']}   "
                  f"{r['peak_host_gb']} ({r.get('predicted_host_peak_gb')})   {r.get('pinned_host_gb')}")
        print(json.dumps({m: r.get("plan") for m, r in rows.items()})[:4000])
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
