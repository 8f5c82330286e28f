"""Can a compiled GEMM read int8 weights directly (issue 26 item 1: the dequant kernels cost 25 ms of a compiled
int8 streamed step)? For each Flux.1-dev linear at 1024² (4,608 tokens), forward (x @ W^T) and the backward's
grad_input (dy @ W), milliseconds per call of:

- ``bf16``: cuBLAS on a bf16 weight (what the resident model runs);
- ``dequant+mm``: the compiled engine's path today, ``dequantize_rows`` then the matmul (inductor: a fused
  cast-and-scale kernel writing the bf16 weight, then cuBLAS);
- ``dequant+mm autotune``: the same under ``max-autotune-no-cudagraphs`` with inductor's prologue fusion on, which may
  fold the int8 read into a Triton GEMM template;
- ``cast-mm-scale autotune``: the scale moved to the output (``(x @ q^T) * s``; for grad_input ``(dy * s) @ q``), so
  the only prologue left is the int8 -> bf16 cast.

Values: each compiled result against the bf16 reference of the dequantized weight (max abs error printed).

    source bench/gpu_env.sh && python3 bench/bench_int8_gemm.py --out "$OUT/int8_gemm.jsonl"
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: (name, in, out) of Flux.1-dev's block linears (per block: double blocks have img and txt copies of the first four).
SHAPES = [("qkv", 3072, 3072 * 3), ("proj", 3072, 3072), ("mlp.0", 3072, 12288), ("mlp.2", 12288, 3072),
          ("single.linear1", 3072, 3072 * 3 + 12288), ("single.linear2", 3072 + 12288, 3072)]


def timed(fn, *args, iters: int = 20) -> float:
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn(*args)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4608)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    import torch._inductor.config as icfg

    from lowvram_lora.engine.slab.quantize import dequantize_rows, quantize_rows

    if hasattr(icfg, "prologue_fusion"):
        icfg.prologue_fusion = True
    dev, bf = torch.device("cuda"), torch.bfloat16

    def fwd_dequant(x, q, s):
        return F.linear(x, dequantize_rows(q, s, bf))

    def fwd_scale_out(x, q, s):
        return (F.linear(x, q.to(bf)).float() * s).to(bf)

    def bwd_dequant(dy, q, s):
        return dy @ dequantize_rows(q, s, bf)

    def bwd_scale_in(dy, q, s):
        return (dy.float() * s).to(bf) @ q.to(bf)

    compiled = {
        "dequant+mm": (torch.compile(fwd_dequant, dynamic=False), torch.compile(bwd_dequant, dynamic=False)),
        "dequant+mm autotune": (torch.compile(fwd_dequant, mode="max-autotune-no-cudagraphs", dynamic=False),
                                torch.compile(bwd_dequant, mode="max-autotune-no-cudagraphs", dynamic=False)),
        "cast-mm-scale autotune": (torch.compile(fwd_scale_out, mode="max-autotune-no-cudagraphs", dynamic=False),
                                   torch.compile(bwd_scale_in, mode="max-autotune-no-cudagraphs", dynamic=False)),
    }
    rows = []
    totals: dict[str, float] = {}
    for name, k, n in SHAPES:
        g = torch.Generator(device=dev).manual_seed(0)
        w = (torch.randn(n, k, device=dev, generator=g) * 0.02)
        q, s = quantize_rows(w)
        q, s = q.to(dev), s.to(dev)
        wd = dequantize_rows(q, s, bf)
        x = torch.randn(args.tokens, k, device=dev, dtype=bf, generator=g)
        dy = torch.randn(args.tokens, n, device=dev, dtype=bf, generator=g)
        ref_f, ref_b = F.linear(x, wd), dy @ wd
        row = {"linear": name, "in": k, "out": n, "tokens": args.tokens,
               "bf16_fwd_ms": round(timed(lambda a, b: F.linear(a, b), x, wd), 4),
               "bf16_bwd_ms": round(timed(lambda a, b: a @ b, dy, wd), 4)}
        for label, (f, b) in compiled.items():
            t0 = time.perf_counter()
            try:
                out_f, out_b = f(x, q, s), b(dy, q, s)
                row[f"{label}_compile_s"] = round(time.perf_counter() - t0, 1)
                row[f"{label}_fwd_ms"] = round(timed(f, x, q, s), 4)
                row[f"{label}_bwd_ms"] = round(timed(b, dy, q, s), 4)
                row[f"{label}_err"] = round(max((out_f.float() - ref_f.float()).abs().max().item(),
                                                (out_b.float() - ref_b.float()).abs().max().item()), 5)
            except Exception as exc:  # noqa: BLE001 - the other variants still run
                row[f"{label}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
        for key, v in row.items():
            if key.endswith("_ms"):
                totals[key] = totals.get(key, 0.0) + v
    print("\ntotal ms over the six shapes (one of each):")
    for key, v in totals.items():
        print(f"  {key:36s} {v:8.3f}")
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "int8_gemm", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    **r}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
