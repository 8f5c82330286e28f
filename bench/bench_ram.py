"""Host-RAM benchmark (issue 35): a run held to a RAM budget beside its RAM-unlimited row of the same run.

Each row is a training process of its own (a fresh interpreter, so its host memory is the row's alone), trained
through ``train_lora`` from a real int8 slab file on this machine's disk, as a user's run reads it: random full-size
weights (``--variant``), built once into ``--workdir`` (a random bf16 checkpoint, quantized by ``build_slab``, the
checkpoint then deleted). Rows (``--rows``):

- ``auto-<V>``: ``auto`` at a V GB VRAM budget, RAM budget 0 (auto: 85% of what is free; this 128 GB machine: the
  RAM-unlimited row);
- ``auto-<V>-ram<R>``: the same at ``ram_budget_gb=R``, run inside a cgroup v2 whose ``memory.max`` is R GB where one
  can be made here (``--cgroup``: the kernel then holds the process to it, page cache included), else under the
  planner's budget alone (``"ram_limit": "emulated"`` in the row).
- either with ``-compiled``: the blocks compiled (as a run of 200+ steps gets them; these short runs would not).

``--bits 4`` builds and trains from an int4 slab instead (``...-int4.slab.safetensors``).

What is measured (the parent samples the child's ``/proc/<pid>/status`` every 20 ms):
``peak_host_gb``: the highest RssAnon + RssShmem (the pages the kernel cannot reclaim: heap, torch's host tensors,
pinned buffers): what the RAM plan predicts (``predicted_host_peak_gb``); ``peak_rss_gb`` (VmRSS, with the slab's
mapped file pages: page cache, clean, reclaimable) and ``peak_file_gb`` beside it; ``peak_locked_gb`` (VmLck +
VmPin); in a cgroup also its ``memory.peak`` (page cache included). ``process_base_gb``: a child that imports the
engine, starts CUDA and runs one matmul, and stops there (the plan's PROCESS_BASE_BYTES).

    source bench/gpu_env.sh
    PYTHONUNBUFFERED=1 python3 bench/bench_ram.py --variant flux1-dev --res 1024 --rows auto-8 auto-8-ram12 \\
        --cgroup --out "$OUT/results.jsonl"
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

GB = 1e9
ROW = re.compile(r"^auto-([0-9.]+)(?:-ram([0-9.]+))?(-compiled)?$")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="flux1-dev")
    p.add_argument("--family", default="")
    p.add_argument("--res", default="1024")
    p.add_argument("--rows", nargs="+", default=["auto-8", "auto-8-ram12"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timed", type=int, default=3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--workdir", default="/tmp/ram-bench")
    p.add_argument("--keep-slab", action="store_true", help="leave the slab in --workdir afterwards")
    p.add_argument("--ckpt-dir", default="", help="where the random checkpoint is written before the slab is built "
                   "from it (default --workdir); /dev/shm keeps a 30 GB checkpoint off a small disk (freed before the rows)")
    p.add_argument("--bits", type=int, default=8, choices=(8, 4), help="the slab's bits (4: an int4 slab)")
    p.add_argument("--ckpt-dtype", default="bf16", choices=("bf16", "fp8"),
                   help="the random checkpoint the slab is built from: fp8 (float8_e4m3fn, as many ComfyUI users' files) "
                        "halves its bytes, so a 20B model's checkpoint and slab fit a 64 GB disk together")
    p.add_argument("--cgroup", action="store_true", help="hold -ram rows with a cgroup v2 memory.max where possible")
    p.add_argument("--out", default="bench/results.jsonl")
    p.add_argument("--note", default="")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------- the slab


def fast_random_tensors() -> None:
    """Bench only: random weights from one Gaussian pool, tiled (write_random_checkpoint draws every element with
    its own generator: 122 s for Flux.1-dev's 24 GB, randn-bound). The values only need to be finite and of the
    right scale for memory and step-time figures."""
    import torch

    from lowvram_lora.engine.slab import testing

    pool = torch.randn(1 << 24) * 0.02

    def tiled(name, shape, dtype, seed=0, std=0.02):
        n = torch.Size(shape).numel()
        reps = -(-n // pool.numel())
        offset = hash(name) % 4096
        flat = pool.roll(offset).repeat(reps)[:n] if reps > 1 else pool[offset:offset + n] if offset + n <= pool.numel() \
            else pool[:n]
        return flat.view(shape).to(dtype)

    testing.random_tensor = tiled


def slab_path(args) -> Path:
    """The slab ``ensure_slab`` builds in ``--workdir`` (int4 slabs carry their suffix)."""
    return Path(args.workdir) / (f"{args.variant}-int8.safetensors" if args.bits == 8
                                 else f"{args.variant}-int4.slab.safetensors")


def ensure_slab(args, family_id: str) -> tuple[Path, dict]:
    from lowvram_lora.engine.slab import build_slab
    from lowvram_lora.engine.slab.testing import write_random_checkpoint

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    slab = slab_path(args)
    if slab.exists():
        return slab, {"slab_reused": True}
    fast_random_tensors()
    ckpt = Path(args.ckpt_dir or work) / f"{args.variant}-random-{args.ckpt_dtype}.safetensors"
    t = time.perf_counter()
    import torch

    write_random_checkpoint(ckpt, family_id, args.variant, layout="bfl",
                            dtype=torch.float8_e4m3fn if args.ckpt_dtype == "fp8" else torch.bfloat16)
    write_s = time.perf_counter() - t
    t = time.perf_counter()
    build_slab(ckpt, slab, family_id, progress=False, bits=args.bits)
    build_s = time.perf_counter() - t
    ckpt.unlink()
    info = {"checkpoint_write_s": round(write_s, 1), "slab_build_s": round(build_s, 1), "ckpt_dtype": args.ckpt_dtype,
            "slab_gb": round(slab.stat().st_size / GB, 2)}
    print(f"slab: {info}", flush=True)
    return slab, info


def overlap_bound(row: dict, ref: dict) -> dict:
    """Issue 35's overlap bound for a row: max(compute, link bytes / link rate, disk bytes / disk rate), with the
    compute taken from the RAM-unlimited row of the same run (its step is compute-bound: nothing on disk) and the
    disk rate the one the run's reads really gave (bytes over the seconds a read was in flight, DiskReader.busy_s),
    beside the probed rate's bound."""
    plan, stats = row.get("plan") or {}, row.get("stats") or {}
    if not row.get("step_s") or not ref.get("step_s") or not plan.get("link_gbps"):
        return {}
    link_s = plan.get("streamed_gb_per_step", 0.0) / plan["link_gbps"]
    disk_gb = row.get("disk_gb_per_step") or 0.0
    measured = stats.get("disk_gbps_busy")
    out = {"bound_compute_s": ref["step_s"], "bound_link_s": round(link_s, 3)}
    for key, rate in (("probed", plan.get("disk_gbps")), ("measured", measured)):
        if disk_gb and not rate:  # no measured rate (a row from before DiskReader.busy_s): say nothing
            continue
        disk_s = disk_gb / rate if disk_gb else 0.0
        out[f"bound_disk_{key}_s"] = round(disk_s, 3)
        out[f"x_overlap_{key}"] = round(row["step_s"] / max(ref["step_s"], link_s, disk_s), 3)
    return out


# --------------------------------------------------------------------------------------------- cgroup


def make_cgroup(limit_bytes: int) -> tuple[Path | None, str]:
    """A cgroup v2 under this process's own with ``memory.max``; (None, why not) where this machine does not allow
    it (a read-only /sys/fs/cgroup, no memory controller delegated). Nothing else is moved or changed."""
    from lowvram_lora.engine.offload.hostmem import own_cgroup

    cg = own_cgroup()
    if cg is None or cg.version != 2:
        return None, "no cgroup v2"
    if "memory" not in (cg.path / "cgroup.subtree_control").read_text().split():
        return None, f"memory controller not enabled for children of {cg.path}"
    folder = cg.path / f"lowvram-ram-bench-{os.getpid()}"
    try:
        folder.mkdir()
        (folder / "memory.max").write_text(str(limit_bytes))
        try:
            (folder / "memory.swap.max").write_text("0")
        except OSError:
            pass
    except OSError as exc:
        return None, f"cannot make {folder}: {exc}"
    return folder, "cgroup v2 memory.max"


# --------------------------------------------------------------------------------------------- children


def status_of(pid: int) -> dict:
    from lowvram_lora.engine.offload.hostmem import _kv_bytes

    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return {k: _kv_bytes(text, k) or 0 for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmLck", "VmPin")}


def run_child(args, kind: str, extra: list[str], cgroup: Path | None) -> dict:
    """Run this script as a child (``--child kind``), sample its memory every 20 ms; its JSON result + the peaks."""
    out = Path(tempfile.mkstemp(prefix="ram-row-", suffix=".json")[1])
    cmd = [sys.executable, __file__, "--child", kind, "--result", str(out), "--variant", args.variant,
           "--family", args.family, "--res", args.res, "--warmup", str(args.warmup), "--timed", str(args.timed),
           "--rank", str(args.rank), "--workdir", args.workdir, "--bits", str(args.bits), *extra]

    def enter():  # in the child, before exec: join the cgroup
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    # As the memory benches run (bench_memory.py): without expandable segments the allocator's fragmentation at an
    # 8 GB cap overran the budget by 0.67 GB on the first try (a VRAM matter, not this bench's).
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
           or "expandable_segments:True"}
    proc = subprocess.Popen(cmd, preexec_fn=enter, env=env)
    peaks = {"host": 0, "rss": 0, "file": 0, "locked": 0}
    while proc.poll() is None:
        s = status_of(proc.pid)
        if s:
            peaks["host"] = max(peaks["host"], s["RssAnon"] + s["RssShmem"])
            peaks["rss"] = max(peaks["rss"], s["VmRSS"])
            peaks["file"] = max(peaks["file"], s["RssFile"])
            peaks["locked"] = max(peaks["locked"], s["VmLck"] + s["VmPin"])
        time.sleep(0.02)
    try:
        result = json.loads(out.read_text() or "{}")
    except ValueError:
        result = {}
    out.unlink(missing_ok=True)
    result.update(returncode=proc.returncode, peak_host_gb=round(peaks["host"] / GB, 3),
                  peak_rss_gb=round(peaks["rss"] / GB, 3), peak_file_gb=round(peaks["file"] / GB, 3),
                  peak_locked_gb=round(peaks["locked"] / GB, 3))
    # The rows' common names. CUDA's pinned host memory (cudaHostAlloc) shows in neither VmLck nor VmPin, so the
    # streamer's own count of what it pinned stands beside the kernel's locked pages.
    result.update(host_ram_gb=result["peak_host_gb"],
                  pinned_gb=max(result["peak_locked_gb"], (result.get("stats") or {}).get("pinned_gb", 0.0)))
    if cgroup is not None:
        for name in ("memory.peak", "memory.events"):
            try:
                text = (cgroup / name).read_text().strip()
            except OSError:
                continue
            if name == "memory.peak" and text.isdigit():
                result["cgroup_peak_gb"] = round(int(text) / GB, 3)
            elif name == "memory.events":
                result["cgroup_events"] = dict(line.split() for line in text.splitlines())
    return result


def child_base(args) -> dict:
    """What a training process holds before any model: the engine and its libraries imported, CUDA started."""
    import torch

    import diffusers  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401

    from lowvram_lora.engine.offload.hostmem import process_memory
    from lowvram_lora.engine.train import train_lora  # noqa: F401

    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    torch.nn.functional.scaled_dot_product_attention(a[None, None], a[None, None], a[None, None]).sum().item()
    mem = process_memory()
    return {"process_base_gb": round(mem.unreclaimable / GB, 3), "process_base_rss_gb": round(mem.rss / GB, 3)}


def child_train(args, vram: float, ram: float, compiled: bool = False) -> dict:
    import torch

    from train_bench import StepRecorder, training_row, write_synthetic_cache
    from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.families import get_family
    from lowvram_lora.engine.offload import OffloadConfig
    from lowvram_lora.engine.train import train_lora

    family = get_family(args.family)
    slab = slab_path(args)
    res = int(args.res) if args.res.isdigit() else args.res
    tmp = tempfile.TemporaryDirectory(prefix="ram-bench-cache-")
    dataset = write_synthetic_cache(Path(tmp.name), family, args.variant, family.load_config(args.variant), res, 2, 0)
    rec = StepRecorder(f"auto-{vram:g} ram {ram:g}")
    t = time.perf_counter()
    error, result = None, None
    try:
        result = train_lora(ModelConfig(transformer_path=str(slab), family=family.id, dtype="bf16"), dataset,
                            LoraSettings(rank=args.rank, alpha=float(args.rank)),
                            TrainConfig(steps=args.warmup + args.timed, device="cuda", learning_rate=1e-4, batch_size=1),
                            rec.callback, offload=OffloadConfig(mode="auto", vram_budget_gb=vram, ram_budget_gb=ram,
                                                               compile="blocks" if compiled else "auto"))
    except Exception as exc:  # noqa: BLE001 - a row per failure
        import traceback

        error = f"{type(exc).__name__}: {str(exc)[:800]}"
        traceback.print_exc()
    row = training_row(rec, args.warmup, t, error, None, torch.device("cuda"))
    plan = (result.settings.get("offload_plan") if result is not None else None) or {}
    stats = (result.settings.get("offload_stats") if result is not None else None) or {}
    row.update(plan=plan, predicted_peak_gb=plan.get("predicted_peak_gb"),
               predicted_host_peak_gb=plan.get("predicted_host_peak_gb"),
               disk_gb_per_step=plan.get("disk_gb_per_step", 0.0),
               stats={k: v for k, v in stats.items() if not isinstance(v, list)},
               host_ram_gb_per_step=[s.host_ram_gb for s in rec.steps])
    from lowvram_lora.engine.offload.hostmem import cgroup_limit_bytes, resolve_ram_budget

    limit = cgroup_limit_bytes()  # what the engine's cgroup reader sees from inside the row's process
    row.update(cgroup_limit_seen_gb=round(limit / GB, 3) if limit else None,
               auto_ram_budget=resolve_ram_budget(0).describe())
    tmp.cleanup()
    return row


# --------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    from lowvram_lora.engine.families import families

    args.family = args.family or next(f.id for f in families().values() if args.variant in f.variants)
    if args.child:
        if args.child == "base":
            out = child_base(args)
        else:
            m = ROW.match(args.child)
            out = child_train(args, float(m[1]), float(m[2] or 0), bool(m[3]))
        Path(args.result).write_text(json.dumps(out))
        return 0

    import torch

    from train_bench import _command, _gpu_name, _versions, new_run_id, row_emitter
    from lowvram_lora.engine.offload.hostmem import physical_ram_bytes

    for row in args.rows:
        if not ROW.match(row):
            raise SystemExit(f"unknown row {row!r}: auto-<V>[-ram<R>][-compiled]")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    slab, slab_info = ensure_slab(args, args.family)
    emit = row_emitter(out, {
        "run_id": new_run_id(), "gpu": _gpu_name(device), **_versions(), "model": args.variant, "lora_rank": args.rank,
        "batch": 1, "grad_ckpt": True, "command": _command(), "note": args.note, "bench": "ram", "precision": f"int{args.bits}",
        "machine_ram_gb": round(physical_ram_bytes() / GB, 1), "emulate_disk_gbps": os.environ.get(
            "LOWVRAM_EMULATE_DISK_GBPS") or None, **slab_info})
    base = run_child(args, "base", [], None)
    print(f"process base: {base}", flush=True)
    unlimited = {}
    try:
        for row in args.rows:
            m = ROW.match(row)
            ram = float(m[2] or 0)
            cgroup, how = (None, "none")
            if ram:
                cgroup, how = make_cgroup(int(ram * GB)) if args.cgroup else (None, "not asked")
            print(f"--- {row}: RAM held by {how if cgroup is not None else 'the planner only (' + how + ')'}",
                  flush=True)
            r = run_child(args, row, [], cgroup)
            if cgroup is not None:
                cgroup.rmdir()
            key = (m[1], m[3])
            if not ram:
                unlimited[key] = r
            ref = unlimited.get(key, {})
            r.update(mode=row, res=args.res, vram_budget_gb=float(m[1]), ram_budget_gb=ram or None,
                     ram_limit=("cgroup" if cgroup is not None else "emulated") if ram else "unlimited",
                     ram_limit_why=how, process_base_gb=base.get("process_base_gb"),
                     host_vs_predicted=(round(r["peak_host_gb"] / r["predicted_host_peak_gb"], 3)
                                        if r.get("predicted_host_peak_gb") else None),
                     unlimited_step_s=ref.get("step_s"),
                     x_unlimited=(round(r["step_s"] / ref["step_s"], 3) if r.get("step_s") and ref.get("step_s")
                                  else None))
            r.update(overlap_bound(r, ref))
            emit(r)
    finally:
        if not args.keep_slab:
            from lowvram_lora.engine.slab.format import manifest_path_for

            manifest_path_for(slab).unlink(missing_ok=True)
            slab.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
