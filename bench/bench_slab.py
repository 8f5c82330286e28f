"""INT8 slab benchmark: build cost, int8 accuracy, and int8 training against the bf16 baseline, in one run.

1. Writes a full-size random Flux.1-dev checkpoint with BFL names (bf16, ~23.8 GB) to ``--workdir``.
2. Builds the slab from it in a child process (wall time, peak host RSS of the builder, slab size).
3. Loads both (bf16 from the checkpoint, int8 from the memory-mapped slab) and measures the
   relative output error of one forward at ``--res``, int8 vs bf16.
4. Trains LoRA r16 through ``train_lora``: ``bf16-resident`` (the baseline of this run), then modes
   ``<bf16|int8>-<resident|stream-k<K>[-act]>[-8bit]``: int8 blocks resident or streamed from pinned
   host memory (dequantized on the GPU), activation offload, torchao 8-bit AdamW moments. ``--adapters`` trains
   each mode once per adapter type (lora, loha, lokr, dora; rows ``<mode>+<type>`` beside plain LoRA's).

Rows are appended to ``--out`` in train_bench.py's format (``bench/report.py`` renders them), each training row with
the process's measured host RAM (``host_ram_gb``: RSS, pinned buffers included) and pinned bytes beside peak VRAM.

On the GPU machine (carry .whl)::

    source bench/gpu_env.sh
    python3 bench/bench_slab.py --res 1024 --out "$OUT/results.jsonl"

LoKr and DoRA beside LoRA, int8 streamed, with the resident baseline (issue 40)::

    python3 bench/bench_slab.py --res 1024 --modes bf16-resident int8-stream-k1-act --adapters lora lokr dora \
        --out "$OUT/results.jsonl"

A smoke run of the same code on the CPU (tiny Flux.1, resident modes only; streaming needs CUDA)::

    python3 bench/bench_slab.py --device cpu --variant flux1-tiny --res 64 --modes bf16-resident int8-resident \
        --adapters lora lokr dora --warmup 1 --timed 1 --workdir /tmp/slab-bench-tiny --out /tmp/tiny.jsonl
"""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_bench import (  # noqa: E402
    GB, StepRecorder, _command, _gpu_name, _versions, row_emitter, training_row, write_synthetic_cache, new_run_id,
)

BUILD_CHILD = """
import json, resource, sys, time
from lowvram_lora.engine.slab import build_slab
t = time.perf_counter()
path = build_slab(sys.argv[1], sys.argv[2], progress=False)
print(json.dumps({"slab": str(path), "build_s": time.perf_counter() - t,
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}))
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--res", type=int, default=1024)
    p.add_argument("--variant", default="flux1-dev")
    p.add_argument("--modes", nargs="+",
                   default=["bf16-resident", "int8-resident", "int8-stream-k2", "int8-stream-k1-act"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timed", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--workdir", default="/tmp/slab-bench")
    p.add_argument("--out", default="bench/results.jsonl")
    p.add_argument("--note", default="")
    p.add_argument("--adapters", nargs="+", default=["lora"],
                   help="adapter types each mode trains (engine/lora_io/adapters/); rows <mode>+<type> after lora's")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run on a tiny variant (resident modes)")
    return p.parse_args(argv)


def _inputs(family, model, res: int, device):
    g = torch.Generator().manual_seed(0)
    cfg = model.config
    lat = torch.randn(1, cfg.in_channels // 4, res // 8, res // 8, generator=g)
    embeds = {"prompt_embeds": torch.randn(1, 512, cfg.joint_attention_dim, generator=g),
              "pooled_prompt_embeds": torch.randn(1, cfg.pooled_projection_dim, generator=g)}
    lat = lat.to(device, torch.bfloat16)
    embeds = {k: v.to(device, torch.bfloat16) for k, v in embeds.items()}
    return family.model_inputs(model, lat, embeds, torch.tensor([0.5], device=device), 1.0)


@torch.no_grad()
def _forward(family, model, res, device):
    with torch.autocast(device.type, dtype=torch.bfloat16):
        return model(**_inputs(family, model, res, device))[0].float()


def _train(model, family, variant, dataset, args, offload, recorder, optimizer="adamw", adapter="lora"):
    from lowvram_lora.engine.config import AdapterConfig, LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.train import train_lora

    return train_lora(
        ModelConfig(dtype="bf16", family="flux1"), dataset,
        LoraSettings(rank=args.rank, alpha=float(args.rank), adapter=AdapterConfig(type=adapter)),
        TrainConfig(steps=args.warmup + args.timed, device=args.device, learning_rate=1e-4,
                    optimizer=optimizer),
        recorder.callback, preloaded=(model, family, variant), offload=offload,
    )


def main(argv=None) -> int:
    from lowvram_lora.engine.models import load_transformer
    from lowvram_lora.engine.offload import OffloadConfig
    from lowvram_lora.engine.slab.testing import write_random_checkpoint

    args = parse_args(argv)
    device = torch.device(args.device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    run_id = new_run_id()
    base = {"run_id": run_id, "gpu": _gpu_name(device), **_versions(), "model": args.variant, "res": args.res,
            "lora_rank": args.rank, "lora_targets": "default", "batch": 1, "grad_ckpt": True,
            "command": _command(), "note": args.note}

    emit = row_emitter(out, base)

    ckpt = work / f"{args.variant}-random.safetensors"
    if not ckpt.exists():
        t = time.perf_counter()
        write_random_checkpoint(ckpt, "flux1", args.variant, layout="bfl")
        print(f"random checkpoint {ckpt.stat().st_size / GB:.2f} GB written in {time.perf_counter() - t:.0f} s",
              flush=True)

    shutil.rmtree(work / "slabs", ignore_errors=True)  # the build is timed: never an earlier run's slab
    child = subprocess.run([sys.executable, "-c", BUILD_CHILD, str(ckpt), str(work / "slabs")],
                           capture_output=True, text=True)
    if child.returncode != 0:
        print(child.stderr[-3000:], flush=True)
        raise SystemExit("slab build failed")
    built = json.loads(child.stdout.strip().splitlines()[-1])
    slab = Path(built["slab"])
    emit({"mode": "slab-build", "step_s": None, "build_s": round(built["build_s"], 1),
          "build_peak_rss_gb": round(built["peak_rss_gb"], 2), "slab_gb": round(slab.stat().st_size / GB, 2),
          "source_gb": round(ckpt.stat().st_size / GB, 2)})

    bf16, family, _, variant = load_transformer(ckpt, "flux1", torch.bfloat16)
    int8, _, _, _ = load_transformer(slab, "flux1", torch.bfloat16)
    bf16.to(device)
    int8.to(device)
    ref, got = _forward(family, bf16, args.res, device), _forward(family, int8, args.res, device)
    rel = ((got - ref).norm() / ref.norm()).item()
    emit({"mode": "int8-accuracy", "step_s": None, "rel_output_error": round(rel, 5),
          "note": (args.note + "; " if args.note else "") + "one forward, int8 slab vs bf16, same random weights"})
    del ref, got

    rows = {}
    with tempfile.TemporaryDirectory(prefix="slab-bench-") as tmp:
        dataset = write_synthetic_cache(Path(tmp), family, variant, dict(bf16.config), args.res, 4, 0)
        int8.to("cpu")  # each mode places only its own model on the GPU: peaks are that mode's alone
        for mode in args.modes:
            # <bf16|int8>-<resident|stream-k<K>[-act]>[-8bit]; -8bit = torchao AdamW8bit moments
            optimizer = "adamw8bit" if mode.endswith("-8bit") else "adamw"
            precision, _, placement = mode.removesuffix("-8bit").partition("-")
            if precision == "int8" and bf16 is not None:  # bf16 modes come first; free its 24 GB
                bf16.to("cpu")
                bf16 = None
                gc.collect()
            model = bf16 if precision == "bf16" else int8
            if model is None or precision not in ("bf16", "int8"):
                raise SystemExit(f"mode {mode!r}: list bf16 modes before int8 ones; precision bf16|int8")
            offload = None
            if placement == "resident":
                model.to(device)
            elif placement.startswith("stream-k"):
                model.to("cpu")  # streamed: blocks go to pinned host memory, the rest to the GPU
                spec = placement[len("stream-k"):]
                offload = OffloadConfig(mode="stream", prefetch_depth=int(spec[0]),
                                        activation_offload=spec.endswith("-act"))
            else:
                raise SystemExit(f"unknown mode {mode!r}")
            for adapter in args.adapters:
                label = mode if adapter == "lora" else f"{mode}+{adapter}"
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                rec = StepRecorder(label)
                t = time.perf_counter()
                try:
                    _train(model, family, variant, dataset, args, offload, rec, optimizer, adapter)
                    error = None
                except torch.cuda.OutOfMemoryError as exc:
                    error = f"OOM: {str(exc)[:300]}"
                resident = rows.get("bf16-resident", {}).get("step_s")
                timed = rec.steps[args.warmup:]
                rows[label] = emit({"mode": label, "adapter": adapter,
                                    **training_row(rec, args.warmup, t, error, resident, device),
                                    "host_ram_gb": max((s.host_ram_gb for s in timed), default=None),
                                    "pinned_gb": round(max((s.pinned_host_gb for s in timed), default=0.0), 2)})
    print("\nmode                 step s   x bf16-resident   peak alloc GB   peak reserved GB")
    for mode, r in rows.items():
        print(f"{mode:20s} {r['step_s'] or float('nan'):7.3f}   {r['x_resident'] or float('nan'):15.3f}"
              f"   {r['peak_alloc_gb']:13.2f}   {r['peak_reserved_gb']:16.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
