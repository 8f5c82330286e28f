"""Memory frontier benchmark (issue 13): finer recompute (token chunks) and host-held AdamW moments,
against the resident row of the same run. Random full-size model built in GPU memory, synthetic cache.

Modes (``--modes``), run in order for every resolution:

- ``resident``: bf16, every weight on the GPU (the baseline of the run; skip it at large batch);
  ``resident-compiled``: the same with compiled blocks (the compute the compiled streamed rows are predicted from);
- ``stream-k<K>[-act][-c<N>][-host][-m<M>][-b<B>]``: stream with prefetch K, activation offload, recompute in N
  token chunks, AdamW moments on the host, each batch run M samples at a time, compiled blocks at
  activation-memory budget B (else eager);
- ``auto-<GB>[-ram<R>][-compiled]``: ``auto`` at that budget (it picks chunks / host moments when it needs them;
  ``-ram<R>``: at a RAM budget of R GB, which the planner holds; with ``-compiled`` blocks compiled as auto compiles
  runs of 200+ steps, whose activation-memory budget it may lower); the allocator is held to the budget
  (engine/offload/streamer.cap_allocator).

The modulation window (engine/train/step_window.py) is on in streamed modes (the planner's K) and off in the resident
baselines (the step as it was); ``<mode>-nowin`` runs a streamed mode without it; ``<mode>-link<GBPS>`` runs a streamed
mode at that emulated link only (0: the real one), whatever ``--link-gbps`` says.

``--precision int8`` (or ``int4``) converts the blocks to int8 (int4) slab layers after the bf16 modes (list
``resident`` first).

``--link-gbps N`` emulates a slower host-to-GPU link: ``LOWVRAM_EMULATE_LINK_GBPS=N`` makes the copy engine pace its
copies to N GB/s (engine/offload/link.py) and the planner plan for it. Every streamed row records the step time the
model predicts (engine/offload/steptime.py) on the link measured here (through the pacer when emulating): from FLOPs
(``predicted_step_s``), and from the measured resident step of the same run and compile mode
(``predicted_step_s_from_resident``), beside the measured step, the copy stall and the link rate the copies got.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/bench_memory.py --res 1024 --precision int8 \
        --modes resident resident-compiled auto-8-compiled --link-gbps 25 --out "$OUT/results.jsonl"

    source bench/gpu_env.sh
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/bench_memory.py --res 1024 2048 \\
        --modes resident stream-k1-act stream-k1-act-c8 auto-4 --out "$OUT/results.jsonl"

Video variants take WxHxF sizes (issue 39: LTX-2.3 video LoRA, Wan I2V one expert). Each row records the host RAM
(``host_ram_gb``: RssAnon + RssShmem at each step, the highest; ``pinned_gb``) beside the peak VRAM:

    python3 bench/bench_memory.py --variant ltx2.3 --res 960x544x89 --precision int8 \\
        --modes resident auto-6-ram24-compiled --warmup 1 --timed 2 --out "$OUT/results.jsonl"

``--plan-only`` prints each mode's plan (or the planner's refusal) for the full-size variant without a GPU (a model on
the meta device): check a GPU command with it first. ``--device cpu`` runs the script on a tiny variant (resident;
auto stays resident on a CPU):

    python bench/bench_memory.py --plan-only --variant wan2.1-i2v-14b --res 832x480x81 --modes resident auto-8-compiled
    python bench/bench_memory.py --device cpu --variant ltx2-tiny --res 64x64x17 --precision int8 \\
        --modes resident auto-6 --warmup 1 --timed 1 --out /tmp/r.jsonl
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gil_contention import Contention  # noqa: E402
from train_bench import (  # noqa: E402
    StepRecorder, _command, _gpu_name, _versions, build_random_model, row_emitter, training_row,
    write_synthetic_cache, new_run_id,
)

STREAM = re.compile(r"^stream-k(\d)(-act)?(?:-c(\d+))?(-host)?(?:-m(\d+))?(?:-b([0-9.]+))?$")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="flux1-dev")
    p.add_argument("--family", default="", help="the variant's family (default: the one that ships --variant)")
    p.add_argument("--res", nargs="+", default=["1024", "2048"],
                   help="sizes: a side (1024), WxH (832x480) or WxHxF for clips (832x480x81)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--device", default="cuda",
                   help="cuda (the bench); cpu: a smoke of the script itself on a tiny variant (no VRAM figures, no "
                        "link: the planner assumes its default)")
    p.add_argument("--modes", nargs="+", default=["resident", "stream-k1-act", "stream-k1-act-c8"])
    p.add_argument("--precision", default="bf16", choices=["bf16", "int8", "int4"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timed", type=int, default=3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--out", default="bench/results.jsonl")
    p.add_argument("--note", default="")
    p.add_argument("--references", type=int, default=None,
                   help="reference images per item at the target's size, for an edit variant (Flux.2: 0 unless given)")
    p.add_argument("--cap-gb", type=float, default=0.0,
                   help="stream-* modes: hold the allocator to this many GB (torch.cuda.set_per_process_memory_"
                        "fraction), as a card of that size would; auto modes hold it to their budget themselves")
    p.add_argument("--link-gbps", type=float, nargs="+", default=[0.0],
                   help="emulate a host-to-GPU link of this many GB/s (LOWVRAM_EMULATE_LINK_GBPS): streamed copies are "
                        "paced to it and auto plans for it; 0: the real link. Several: each streamed mode runs at each")
    p.add_argument("--plan-only", action="store_true",
                   help="no training, no GPU: each mode's plan (or its refusal) for the full-size --variant at each "
                        "--res, from a model on the meta device, on an assumed H100 link: a check of a GPU command "
                        "before it spends device time")
    p.add_argument("--fragmentation", type=float, default=None,
                   help="override the family's allocator fragmentation factor (MemoryProfile.fragmentation: the plan "
                        "keeps max(0.5 GB, this x its largest tensor) free): measures whether a smaller margin holds "
                        "(Wan compiled: 2026-11-28's out-of-memory runs had 0.05-0.12 GB of holes against Wan's 2.2)")
    p.add_argument("--contend", type=int, default=0, metavar="N",
                   help="N busy Python threads beside each mode's run (bench/gil_contention.py): how much its step "
                        "waits on the interpreter lock, which a pipelined split's two GPUs share; rows carry "
                        "contending_threads and contender_share")
    p.add_argument("--contend-kind", default="python", choices=["python", "ops"],
                   help="what the busy threads run: a pure Python loop (the worst case: it lets go only when the "
                        "switch interval forces it) or one-element torch operator calls (as another GPU's launching "
                        "thread does)")
    p.add_argument("--switch-interval", type=float, default=0.0, metavar="S",
                   help="sys.setswitchinterval(S) for the whole run (Python's default 0.005): how long a thread that "
                        "holds the interpreter lock keeps it from one that waits")
    p.add_argument("--snapshot", default="", help="a mode: record the allocator from its step 2 on and print what "
                                                  "is live at the peak (torch.cuda.memory._snapshot), by source line")
    return p.parse_args(argv)


MARK_BYTES = 512  # the allocator's smallest block: a marker allocation of (1 + block) of these per block visit


def marked_units(model, family) -> list[tuple[str, object]]:
    """(kind, module) of every streaming unit in run order: a block, or each part of a block that streams in
    parts with activation offload (engine/offload/units.py; the parts are made once, so these are the ones
    training uses)."""
    from lowvram_lora.engine.offload.footprint import named_blocks
    from lowvram_lora.engine.offload.units import parts_of

    out = []
    for name, block in named_blocks(model, family):
        kind = name.split(".")[0]
        out += [(f"{kind}.{p}", m) for p, m in (parts_of(family, block) or [])] or [(kind, block)]
    return out


def install_block_markers(units) -> list:
    """A forward pre-hook on every unit that allocates and frees a tiny tensor whose size names the unit,
    so the allocator trace says which unit ran when (the hooks also fire at each backward recompute).
    Bench only: it costs one 512-byte allocation per unit visit. A block split into parts also fires for
    the block itself in the forward; the marker of its first part follows at once."""
    hooks = []
    for i, (_, unit) in enumerate(units):
        def block_marker(module, args, i=i):
            torch.empty(MARK_BYTES * (1 + i), dtype=torch.uint8, device="cuda")
        hooks.append(unit.register_forward_pre_hook(block_marker))
    return hooks


def peak_breakdown(snapshot: dict, base_bytes: int, kinds: list[str], top: int = 18) -> tuple[str, dict]:
    """Replay the allocator trace: the live allocations at the highest point, grouped by the first stack
    frame outside torch (what made them), and the highest point while each kind of block ran (its forward,
    or its recompute + backward), from the block markers. ``base_bytes`` were allocated before recording."""
    from collections import Counter

    events = snapshot["device_traces"][torch.cuda.current_device()]
    marker_sizes = {MARK_BYTES * (1 + i): i for i in range(len(kinds))}
    live, total, peak, at_peak, block, peak_block = {}, 0, 0, {}, None, None
    by_kind: dict[str, int] = {}

    def is_marker(ev):  # by the frame that made it: other allocations can have a marker's size
        return ev["size"] in marker_sizes and any(f["name"] == "block_marker" for f in ev.get("frames", []))

    for ev in events:
        if ev["action"] == "alloc":
            if is_marker(ev):
                block = marker_sizes[ev["size"]]
                continue
            live[ev["addr"]] = ev
            total += ev["size"]
            if total > peak:
                peak, at_peak, peak_block = total, dict(live), block
            if block is not None:
                by_kind[kinds[block]] = max(by_kind.get(kinds[block], 0), total)
        elif ev["action"] == "free_completed":
            if ev["addr"] in live:
                total -= live.pop(ev["addr"])["size"]
            elif not is_marker(ev):  # allocated before recording began (counted in base_bytes)
                total -= ev["size"]

    def where(ev):
        for f in ev.get("frames", []):
            name = f["filename"]
            if "/torch/" not in name and "<" not in name:
                return f"{name.split('site-packages/')[-1].split('lowvram_lora/')[-1]}:{f['line']} {f['name']}"
        return "torch internals"

    groups = Counter()
    for ev in at_peak.values():
        groups[where(ev)] += ev["size"]
    kind_gb = {k: round((base_bytes + v) / 1e9, 3) for k, v in by_kind.items()}
    lines = [f"allocated before recording: {base_bytes / 1e9:.2f} GB; at the peak {peak / 1e9:.2f} GB more "
             f"({(base_bytes + peak) / 1e9:.2f} GB in all; allocations made before recording and freed since are "
             f"subtracted, so the rows below can add up to more) "
             f"(while block {peak_block} ran: {kinds[peak_block] if peak_block is not None else '?'}), from:"]
    lines += [f"  {b / 1e9:7.3f} GB  {w}" for w, b in groups.most_common(top)]
    lines.append("highest total while each kind of block ran: "
                 + ", ".join(f"{k} {v:.2f} GB" for k, v in kind_gb.items()))
    return "\n".join(lines), kind_gb


def window_for(mode: str) -> tuple[str, int | None]:
    """(the mode without ``-nowin``, train_lora's ``step_window``): the resident baselines run as before the modulation
    window (off), streamed modes with it (the planner's K) unless ``-nowin`` turns it off."""
    mode = re.sub(r"-link[0-9.]+$", "", mode)
    if mode.endswith("-nowin"):
        return mode[:-len("-nowin")], 0
    return mode, 0 if mode.startswith("resident") else None


def links_for(mode: str, default: list) -> list:
    """The links a streamed mode runs at: its own ``-link<GBPS>`` suffix (0: the real link), else ``--link-gbps``."""
    m = re.search(r"-link([0-9.]+)$", mode)
    return [float(m[1])] if m else default


def offload_for(mode: str):
    from lowvram_lora.engine.offload import OffloadConfig

    if mode == "resident":
        return None
    if mode == "resident-compiled":
        return OffloadConfig(mode="resident", compile="blocks")
    m = STREAM.match(mode)
    if m:
        compiled = {"compile": "blocks", "activation_memory_budget": float(m[6])} if m[6] else {"compile": "off"}
        return OffloadConfig(mode="stream", prefetch_depth=int(m[1]), activation_offload=bool(m[2]),
                             recompute_chunks=int(m[3]) if m[3] else None, optimizer_on_host=bool(m[4]),
                             micro_batch_size=int(m[5]) if m[5] else None, **compiled)
    m = re.match(r"^auto-([0-9.]+)(?:-ram([0-9.]+))?(-compiled)?(?:-margin([0-9.]+))?$", mode)
    if m and m[4] is not None and not float(m[4]):
        raise SystemExit(f"{mode}: -margin0 would be the default margin (allocator_margin_gb 0 is unset); use "
                         f"--fragmentation 0 to plan with the 0.5 GB headroom alone")
    if m:  # -compiled: as a run of 200+ steps gets it (compile auto), which these short runs would not; -ram<R>: the
        # RAM plan's budget (the planner holds it; bench_ram.py holds a run to it with a cgroup); -margin<G>: Offload
        # Tuning's allocator_margin_gb (what the out-of-memory advice names)
        return OffloadConfig(mode="auto", vram_budget_gb=float(m[1]), ram_budget_gb=float(m[2] or 0),
                             compile="blocks" if m[3] else "auto", allocator_margin_gb=float(m[4]) if m[4] else None)
    raise SystemExit(f"unknown mode {mode!r}")


def predicted_timing(model, family, variant, dataset, batch, summary: dict, machine, compiled: bool,
                     resident_step_s, stats: dict, warmup: int) -> dict:
    """The step-time model's prediction for the plan that ran (rebuilt from its summary on this model), on the link
    measured here: from FLOPs, and from the resident step of this run in the same compile mode (when it ran); and
    what the copies measured: the link rate they got (streamed bytes per step / copy-engine busy time)."""
    import statistics

    from lowvram_lora.engine.offload.footprint import measure_footprint, workload_for
    from lowvram_lora.engine.offload.plan import build_plan, resident_order, with_step_time

    fp = measure_footprint(model, family, variant)
    wl = workload_for(dataset, family, variant, batch)
    plan = build_plan(fp, wl, resident_order(fp.block_bytes)[:summary["resident_blocks"]], summary["prefetch_depth"],
                      summary["activation_offload"], recompute_chunks=summary["recompute_chunks"],
                      optimizer_on_host=summary["optimizer_on_host"], micro_batch=summary["micro_batch"],
                      compiled_budget=summary["activation_memory_budget"])
    out = {"predicted_step_s": round(with_step_time(plan, machine, None, compiled).predicted_step_s, 4),
           "predicted_stall_s": round(plan.step_time.stall_s, 4),
           "predicted_link_busy_s": round(plan.step_time.link_busy_s, 4),
           "predicted_step_s_from_resident": None, "predicted_compiled": compiled,
           "plan_predicted_step_s": summary.get("predicted_step_s"), "plan_link_gbps": summary.get("link_gbps")}
    if resident_step_s:
        out["predicted_step_s_from_resident"] = round(
            with_step_time(plan, machine, resident_step_s, compiled).predicted_step_s, 4)
    copy_s = [c for c in stats.get("step_copy_s", [])[warmup:] if c > 0]
    if copy_s and plan.streamed_bytes_per_step:
        out["copy_busy_s"] = statistics.median(copy_s)
        out["measured_link_gbps"] = round(plan.streamed_bytes_per_step / 1e9 / out["copy_busy_s"], 2)
    return out


def plan_only(args, family_id: str) -> int:
    """``--plan-only``: the plan each mode would run with (or the planner's refusal), from the variant built on the
    meta device: bf16 for the resident modes, the blocks swapped to int8 / int4 slab layers for the streamed ones
    when ``--precision`` says so (as the bench converts them); on an H100's measured link (DESIGN.md section 5, 53.8
    GB/s) and bf16 peak; compile as the mode says. Nothing is trained; the figures are predictions."""
    from lowvram_lora.engine.config import LoraSettings
    from lowvram_lora.engine.families import get_family
    from lowvram_lora.engine.offload import OffloadConfig
    from lowvram_lora.engine.offload.footprint import workload_for
    from lowvram_lora.engine.offload.plan import make_plan
    from lowvram_lora.engine.offload.steptime import Machine, peak_flops_for
    from train_bench import meta_footprint, parse_res

    family = get_family(family_id)
    cfg = family.load_config(args.variant)
    lora = LoraSettings(rank=args.rank, alpha=float(args.rank))
    machine = Machine(53.8e9, peak_flops_for("H100"), "H100 (assumed)", "assumed: DESIGN.md section 5")

    def footprint(precision: str):
        return meta_footprint(family, args.variant, cfg, precision, lora)[1]

    fps = {"bf16": footprint("bf16")}
    fps[args.precision] = fps.get(args.precision) or footprint(args.precision)
    print(f"{args.variant}: {sum(fps['bf16'].block_bytes) / 1e9:.1f} GB of bf16 blocks, "
          f"{fps['bf16'].other_bytes / 1e9:.2f} GB outside them; link {machine.describe()}")
    with tempfile.TemporaryDirectory(prefix="memory-plan-") as tmp:
        for res in args.res:
            w, h, frames = parse_res(res)
            dataset = write_synthetic_cache(Path(tmp) / str(res), family, args.variant, cfg, res, 1, 0,
                                            references=args.references)
            wl = workload_for(dataset, family, args.variant, args.batch)
            print(f"--- {res}: {wl.image_tokens} image tokens, {wl.text_tokens} text tokens")
            for mode in args.modes:
                name = window_for(mode)[0]
                offload = offload_for(name) or OffloadConfig(mode="resident")
                compiled = offload.compile == "blocks"
                fp = fps["bf16" if offload.mode == "resident" else args.precision]
                budget = int(offload.vram_budget_gb * 1e9) if offload.mode == "auto" else None
                ram = int(offload.ram_budget_gb * 1e9) if offload.ram_budget_gb else None
                try:
                    plan = make_plan(fp, wl, offload, budget, compiled=compiled, machine=machine, ram_budget_bytes=ram,
                                     ram_source=f" (the mode's -ram{offload.ram_budget_gb:g})" if ram else "")
                except Exception as exc:  # noqa: BLE001 - the refusal is the answer
                    print(f"{mode:24s} REFUSED: {type(exc).__name__}: {exc}")
                    continue
                peak, host = plan.predicted_peak_bytes / 1e9, plan.predicted_host_peak_bytes / 1e9
                print(f"{mode:24s} peak {peak:6.2f} GB, host {host:6.2f} GB, step "
                      f"{plan.predicted_step_s or float('nan'):7.2f} s (FLOPs, {machine.name}); {plan.describe()}")
    return 0


def main(argv=None) -> int:
    from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.offload.footprint import named_blocks
    from lowvram_lora.engine.offload.hostmem import release_freed_heap
    from lowvram_lora.engine.train import train_lora

    args = parse_args(argv)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    if args.fragmentation is not None:
        import dataclasses

        from lowvram_lora.engine.families import families

        family = next((f for f in families().values()
                       if f.id == args.family or (not args.family and args.variant in f.variants)), None)
        if family is None:
            raise SystemExit(f"--fragmentation: no family ships --variant {args.variant!r} (or --family {args.family!r})")
        type(family).memory = dataclasses.replace(family.memory, fragmentation=args.fragmentation)
    if args.plan_only:
        from lowvram_lora.engine.families import families

        args.res = [int(r) if str(r).isdigit() else r for r in args.res]
        return plan_only(args, args.family or next(f.id for f in families().values() if args.variant in f.variants))
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    run_id = new_run_id()
    from lowvram_lora.engine.offload.link import ENV_EMULATE_GBPS, resolve_machine

    def use_link(gbps: float):
        """Emulate ``gbps`` (0: the real link) from here on: the copy engine and the planner read the variable when
        a run starts. The machine the predictions use: the real link (probed once, cached) or the paced one."""
        if gbps:
            os.environ[ENV_EMULATE_GBPS] = f"{gbps:g}"
        else:
            os.environ.pop(ENV_EMULATE_GBPS, None)
        machine = resolve_machine(device)  # None off CUDA
        print(f"link: {machine.describe() if machine else 'none (not CUDA)'}", flush=True)
        return machine

    machine = use_link(0.0)
    base = {"run_id": run_id, "gpu": _gpu_name(device), **_versions(), "model": args.variant, "lora_rank": args.rank,
            "lora_targets": "default", "batch": args.batch, "grad_ckpt": True, "command": _command(),
            "note": args.note, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "bench": "memory",
            "switch_interval_s": sys.getswitchinterval(),
            "real_link_gbps": round(machine.link_bytes_per_s / 1e9, 2) if machine else None}
    emit = row_emitter(out, base)
    from lowvram_lora.engine.families import families

    family_id = args.family or next(f.id for f in families().values() if args.variant in f.variants)
    model, family, cfg = build_random_model(args.variant, device, torch.bfloat16, 0.02, 0, family_id)
    tmp = tempfile.TemporaryDirectory(prefix="memory-bench-")
    args.res = [int(r) if str(r).isdigit() else r for r in args.res]  # rows keep 1024 as a number
    datasets = {res: write_synthetic_cache(Path(tmp.name) / str(res), family, args.variant, cfg, res, 2 * args.batch, 0,
                                           references=args.references)
                for res in args.res}
    rows, on_gpu, precision = {}, True, "bf16"
    for mode in args.modes:
        offload_mode, step_window = window_for(mode)
        offload = offload_for(offload_mode)
        streams = offload is not None and offload.mode != "resident"
        if streams and on_gpu:
            if args.precision in ("int8", "int4"):
                # Quantized block by block where the blocks are (the GPU), then moved to the host as int8 / int4:
                # no bf16 copy of the model passes through host memory, whose freed pages the C heap may keep
                # (they would count in the row's host RAM; a loaded slab never has them).
                from bench_flux2 import to_int8_on_host

                to_int8_on_host(model, family, device, 4 if args.precision == "int4" else 8)
                precision = args.precision
            else:
                for _, block in named_blocks(model, family):
                    block.to("cpu")
            if cuda:
                torch.cuda.empty_cache()
            release_freed_heap()  # what the conversion freed (engine/offload/hostmem.py)
            on_gpu = False
        if not streams and not on_gpu:
            raise SystemExit("list 'resident' and 'resident-compiled' before the streamed modes")
        for gbps in (links_for(mode, args.link_gbps) if streams else [None]):
            machine = use_link(gbps) if streams else None
            link_fields = {"link_gbps_emulated": gbps or None,
                           "link_gbps": round(machine.link_bytes_per_s / 1e9, 2) if machine else None,
                           "link_source": machine.source if machine else None}
            for res in args.res:
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                base_bytes = [0]

                units = marked_units(model, family)
                markers = install_block_markers(units) if mode == args.snapshot else []

                def start_recording(info, mode=mode):
                    if mode == args.snapshot and info.step == 1:
                        torch.cuda.synchronize()
                        base_bytes[0] = torch.cuda.memory_allocated()
                        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")

                contention = Contention(args.contend, kind=args.contend_kind)

                def on_step(info, start_recording=start_recording, contention=contention):
                    contention.mark()
                    start_recording(info)

                rec = StepRecorder(f"{mode} {res}", on_step)
                capped = bool(args.cap_gb) and mode.startswith("stream-")
                if capped:
                    total = torch.cuda.get_device_properties(device).total_memory
                    torch.cuda.set_per_process_memory_fraction(args.cap_gb * 1e9 / total, torch.cuda.current_device())
                t = time.perf_counter()
                error, result = None, None
                try:
                    with contention:
                        result = train_lora(ModelConfig(dtype="bf16", family=family.id), datasets[res],
                                            LoraSettings(rank=args.rank, alpha=float(args.rank)),
                                            TrainConfig(steps=args.warmup + args.timed, device=device.type,
                                                        learning_rate=1e-4, batch_size=args.batch),
                                            rec.callback, preloaded=(model, family, args.variant), offload=offload,
                                            step_window=step_window)
                except Exception as exc:  # noqa: BLE001 - a row per failure
                    import traceback

                    error = f"{type(exc).__name__}: {str(exc)[:500]}"
                    print("ERROR", error, flush=True)
                    traceback.print_exc()
                if capped:
                    torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
                resident_s = rows.get(("resident", res, None), {}).get("step_s")
                row = training_row(rec, args.warmup, t, error, resident_s, device)
                if capped:
                    row["cap_gb"] = args.cap_gb
                if mode == args.snapshot:
                    for h in markers:
                        h.remove()
                    kinds = [k for k, _ in units]
                    text, kind_gb = peak_breakdown(torch.cuda.memory._snapshot(), base_bytes[0], kinds)
                    torch.cuda.memory._record_memory_history(enabled=None)
                    print(f"\n[{mode} {res}] memory at the peak (steps 2+):\n{text}\n", flush=True)
                    row["peak_breakdown"] = text
                    row["peak_by_block_kind_gb"] = kind_gb
                plan = (result.settings.get("offload_plan") if result is not None else None) or {}
                timing = {}
                if plan and streams and result is not None:
                    compiled = offload.compile == "blocks" or bool(re.search(r"-b[0-9.]+$", mode))
                    baseline = rows.get(("resident-compiled" if compiled else "resident", res, None), {})
                    timing = predicted_timing(model, family, args.variant, datasets[res], args.batch, plan, machine,
                                              compiled, baseline.get("step_s"), result.settings.get("offload_stats")
                                              or {}, args.warmup)
                compiled_base = rows.get(("resident-compiled", res, None), {}).get("step_s")
                timed_steps = rec.steps[args.warmup:]
                if args.contend:  # the busy threads' share of the interpreter lock over the timed steps
                    row.update(contending_threads=args.contend, contend_kind=args.contend_kind,
                               contender_share=contention.share(args.warmup - 1))
                row.update({  # the modulation window (issue 37) and the host memory beside the VRAM
                    "window": (result.settings.get("step_window") if result is not None else None) or {"steps": 0},
                    "x_resident_compiled": round(row["step_s"] / compiled_base, 3) if row["step_s"] and compiled_base
                    else None,
                    # the mean over the timed steps counts the window's pass at its share (the median may skip it)
                    "step_s_mean": round(sum(s.seconds_per_step for s in timed_steps) / len(timed_steps), 4)
                    if timed_steps and row["step_s"] else None,
                    # a run that failed before its timed steps: what its earlier steps held (the row's error says so)
                    "host_ram_gb": max((s.host_ram_gb for s in timed_steps or rec.steps), default=None),
                    # pinned: the streamer's blocks and activations, plus the window's held weights
                    "pinned_gb": round(max((s.pinned_host_gb for s in timed_steps or rec.steps), default=0.0)
                                       + ((result.settings.get("step_window") or {}).get("held_gb", 0.0)
                                          if result is not None else 0.0), 3)})
                rows[(mode, res, gbps)] = emit({"mode": mode, "res": res, "precision": precision, **row,
                                                "plan": plan, "predicted_peak_gb": plan.get("predicted_peak_gb"),
                                                **link_fields, **timing})
    print("\nmode                     link   res   step s   predicted (FLOPs / resident)   x resident   "
          "peak alloc GB   predicted   reserved")
    nan = float("nan")
    for (mode, res, gbps), r in rows.items():
        print(f"{mode:22s} {r.get('link_gbps') or nan:5.1f} {str(res):>5s} {r['step_s'] or nan:8.3f} "
              f"{r.get('predicted_step_s') or nan:12.3f} / {r.get('predicted_step_s_from_resident') or nan:6.3f}"
              f"        {r['x_resident'] or nan:12.3f}"
              f" {r['peak_alloc_gb']:15.2f} {r['predicted_peak_gb'] or nan:11.2f} {r['peak_reserved_gb']:10.2f}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
