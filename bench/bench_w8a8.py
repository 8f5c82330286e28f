"""W8A8 benchmark (issue 12 §1): int8 x int8 slab compute against dequant and bf16, in one run.

No files: a random Flux.1-dev (bf16) is built in GPU memory, and an int8 copy is made from it
by swapping every block Linear for ``Int8Linear.from_linear`` (the slab's quantization).

1. Layer timings for Flux.1 shapes at ``--res`` (forward + grad_input, CUDA events):
   bf16 ``F.linear``, int8 dequant, w8a8 (int8 backward), w8a8 (bf16 backward), fp8.
2. Accuracy: relative error against bf16 of one double block's output and of the whole
   model's output, for the dequant and the w8a8 path.
3. Training LoRA r16 through ``train_lora`` with the same seed and data:
   ``bf16-resident`` (this run's baseline), then
   ``int8-<resident|stream-k<K>[-act]>-<dequant|w8a8|w8a8bf|fp8>``; a ``-c<budget>`` suffix compiles the
   blocks (``compile='blocks'``) at that activation-memory budget, e.g. ``bf16-resident-c0.5``; a
   ``-adamw8bit`` suffix (last) trains with ``optimizer='adamw8bit'``.
   Loss curves of every row are kept (same seed and data as the baseline: compare them).

Rows go to ``--out`` in train_bench.py's format (``bench/report.py`` renders them).

On the GPU machine (carry .whl)::

    source bench/gpu_env.sh
    python3 bench/bench_w8a8.py --res 1024 --out "$OUT/results.jsonl"
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_bench import (  # noqa: E402
    StepRecorder, _command, _gpu_name, _versions, build_random_model, row_emitter, training_row,
    write_synthetic_cache, new_run_id,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--res", type=int, default=1024)
    p.add_argument("--variant", default="flux1-dev")
    p.add_argument("--modes", nargs="+", default=[
        "bf16-resident", "int8-resident-dequant", "int8-resident-w8a8", "int8-resident-w8a8bf",
        "int8-stream-k1-act-dequant", "int8-stream-k1-act-w8a8", "int8-resident-fp8", "int8-stream-k1-act-fp8"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timed", type=int, default=5)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--skip-layers", action="store_true", help="skip the layer timings")
    p.add_argument("--out", default="bench/results.jsonl")
    p.add_argument("--note", default="")
    return p.parse_args(argv)


def quantize_in_memory(model, family):
    """An int8 copy: every block Linear replaced by Int8Linear.from_linear (the slab's rows + scales)."""
    from lowvram_lora.engine.slab import Int8Linear
    from lowvram_lora.engine.slab.layout import block_linears

    q = copy.deepcopy(model)
    for name, linear in block_linears(q, family).items():
        parent, _, child = name.rpartition(".")
        setattr(q.get_submodule(parent), child, Int8Linear.from_linear(linear))
    gc.collect()
    torch.cuda.empty_cache()
    return q


def _time(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def layer_timings(tokens: int, device) -> list[dict]:
    """Forward + grad_input of one Linear per Flux.1 shape, ms per call."""
    from lowvram_lora.engine.slab import Int8Linear
    from lowvram_lora.engine.slab.int8_linear import set_int8_compute

    shapes = {"qkv/out 3072x3072": (3072, 3072), "mlp in 3072->12288": (3072, 12288),
              "mlp out 12288->3072": (12288, 3072), "single out 15360->3072": (15360, 3072)}
    rows = []
    for label, (k, n) in shapes.items():
        lin = torch.nn.Linear(k, n, device=device, dtype=torch.bfloat16).requires_grad_(False)
        q = Int8Linear.from_linear(lin)
        x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)

        def fwd_bwd(f):
            def run():
                x.grad = None
                f(x).backward(g)
            return run

        row = {"shape": label, "tokens": tokens}
        row["bf16_ms"] = _time(fwd_bwd(lambda t: F.linear(t, lin.weight, lin.bias)))
        set_int8_compute(q, "dequant")
        row["dequant_ms"] = _time(fwd_bwd(q))
        set_int8_compute(q, "w8a8", "int8")
        row["w8a8_ms"] = _time(fwd_bwd(q))
        set_int8_compute(q, "w8a8", "bf16")
        row["w8a8_bf16bwd_ms"] = _time(fwd_bwd(q))
        set_int8_compute(q, "fp8")
        row["fp8_ms"] = _time(fwd_bwd(q))
        row["fp8_fwd_only_ms"] = _time(lambda: q(x.detach()))
        set_int8_compute(q, "w8a8", "int8")
        row["w8a8_fwd_only_ms"] = _time(lambda: q(x.detach()))
        row["bf16_fwd_only_ms"] = _time(lambda: F.linear(x.detach(), lin.weight, lin.bias))
        rows.append({k2: (round(v, 4) if isinstance(v, float) else v) for k2, v in row.items()})
        print("LAYER", json.dumps(rows[-1]), flush=True)
    return rows


@torch.no_grad()
def accuracy(bf16, int8, family, res, device) -> dict:
    from lowvram_lora.engine.slab.int8_linear import set_int8_compute

    g = torch.Generator().manual_seed(0)
    cfg = bf16.config
    lat = torch.randn(1, cfg.in_channels // 4, res // 8, res // 8, generator=g).to(device, torch.bfloat16)
    embeds = {"prompt_embeds": torch.randn(1, 512, cfg.joint_attention_dim, generator=g).to(device, torch.bfloat16),
              "pooled_prompt_embeds": torch.randn(1, cfg.pooled_projection_dim, generator=g).to(device, torch.bfloat16)}
    inputs = family.model_inputs(bf16, lat, embeds, torch.tensor([0.5], device=device), 1.0)
    captured = {}

    def grab(tag):
        def hook(_m, _args, out):
            captured[tag] = (out[1] if isinstance(out, tuple) else out).float()  # image stream of block 0
        return hook

    out = {}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = bf16.transformer_blocks[0].register_forward_hook(grab("bf16"))
        ref = bf16(**inputs)[0].float()
        h.remove()
        for mode in ("dequant", "w8a8", "fp8"):
            set_int8_compute(int8, mode)
            h = int8.transformer_blocks[0].register_forward_hook(grab(mode))
            got = int8(**inputs)[0].float()
            h.remove()
            out[f"model_rel_err_{mode}"] = round(((got - ref).norm() / ref.norm()).item(), 5)
            out[f"block0_rel_err_{mode}"] = round(
                ((captured[mode] - captured["bf16"]).norm() / captured["bf16"].norm()).item(), 5)
    set_int8_compute(int8, "dequant")
    return out


def main(argv=None) -> int:
    from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.offload import OffloadConfig
    from lowvram_lora.engine.train import train_lora

    args = parse_args(argv)
    device = torch.device("cuda")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    run_id = new_run_id()
    base = {"run_id": run_id, "gpu": _gpu_name(device), **_versions(), "model": args.variant, "res": args.res,
            "lora_rank": args.rank, "lora_targets": "default", "batch": 1, "grad_ckpt": True,
            "command": _command(), "note": args.note}

    emit = row_emitter(out, base)

    tokens = (args.res // 16) ** 2 + 512
    if not args.skip_layers:
        for r in layer_timings(tokens, device):
            emit({"mode": "w8a8-layer", "step_s": None, **r})

    bf16, family, cfg = build_random_model(args.variant, device, torch.bfloat16, 0.02, 0)
    int8 = quantize_in_memory(bf16, family)
    emit({"mode": "w8a8-accuracy", "step_s": None, **accuracy(bf16, int8, family, args.res, device),
          "note": "one forward at t=0.5, random weights std 0.02; rel error vs bf16"})

    rows = {}
    with tempfile.TemporaryDirectory(prefix="w8a8-bench-") as tmp:
        dataset = write_synthetic_cache(Path(tmp), family, args.variant, dict(cfg), args.res, 4, 0)
        int8.to("cpu")
        for mode in args.modes:
            model = None
            precision, _, rest = mode.partition("-")
            optimizer = "adamw"  # "-adamw8bit": torchao's 8-bit AdamW (on one flat buffer)
            if rest.endswith("-adamw8bit"):
                rest, optimizer = rest[: -len("-adamw8bit")], "adamw8bit"
            compile_budget = None  # "-c<budget>": compile='blocks' at that activation-memory budget
            head, sep, tail = rest.rpartition("-c")
            if sep and tail.replace(".", "", 1).isdigit():
                rest, compile_budget = head, float(tail)
            compile_kw = ({"compile": "blocks", "activation_memory_budget": compile_budget}
                          if compile_budget is not None else {})
            compute = "dequant"
            for suffix in ("-dequant", "-w8a8bf", "-w8a8", "-fp8"):
                if rest.endswith(suffix):
                    compute, rest = suffix[1:], rest[: -len(suffix)]
                    break
            if precision == "int8" and bf16 is not None:  # bf16 modes first; then free its 24 GB
                del bf16
                bf16 = None
                gc.collect()
                torch.cuda.empty_cache()
            model = bf16 if precision == "bf16" else int8
            if model is None:
                raise SystemExit(f"mode {mode!r}: list bf16 modes before int8 ones")
            backward = "bf16" if compute == "w8a8bf" else "int8"
            int8_compute = "w8a8" if compute.startswith("w8a8") else compute
            if rest == "resident":
                model.to(device)
                offload = OffloadConfig(mode="resident", int8_compute=int8_compute, **compile_kw)
            elif rest.startswith("stream-k"):
                model.to("cpu")
                spec = rest[len("stream-k"):]
                offload = OffloadConfig(mode="stream", prefetch_depth=int(spec[0]),
                                        activation_offload=spec.endswith("-act"), int8_compute=int8_compute,
                                        **compile_kw)
            else:
                raise SystemExit(f"unknown mode {mode!r}")
            if precision == "int8":  # train_lora sets the compute path; the backward choice is the bench's
                from lowvram_lora.engine.slab.int8_linear import set_int8_compute
                set_int8_compute(model, "dequant", backward)
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            rec = StepRecorder(mode)
            t = time.perf_counter()
            error, trained = None, None
            try:
                trained = train_lora(ModelConfig(dtype="bf16", family="flux1"), dataset,
                           LoraSettings(rank=args.rank, alpha=float(args.rank)),
                           TrainConfig(steps=args.warmup + args.timed, device="cuda", learning_rate=1e-4,
                                       optimizer=optimizer),
                           rec.callback, preloaded=(model, family, args.variant), offload=offload)
            except torch.cuda.OutOfMemoryError as exc:
                error = f"OOM: {str(exc)[:300]}"
            resident = rows.get("bf16-resident", {}).get("step_s")
            row = training_row(rec, args.warmup, t, error, resident, device)
            if compile_budget is not None and trained is not None:
                info = trained.settings.get("compile", {})
                row["compile_first_step_s"], row["compile_graphs"] = info.get("first_step_s"), info.get("graphs")
            rows[mode] = emit({"mode": mode, **row})
            if precision == "int8":
                model.to("cpu")
    print("\nmode                          step s   x bf16-resident   peak alloc GB")
    for mode, r in rows.items():
        print(f"{mode:28s} {r['step_s'] or float('nan'):7.3f}   {r['x_resident'] or float('nan'):15.3f}"
              f"   {r['peak_alloc_gb']:13.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
