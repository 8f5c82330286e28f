"""Where a training step's host (Python) time goes: the engine's step against diffusers' own forward and backward
of the same model, with and without checkpointing, eager and compiled, each at a tiny width (``--narrow``) so that
the GPU's time is next to nothing and a step's time is its host's.

Why: the pipelined split runs both parts' Python in one interpreter, so a batch takes at least M x one micro-batch's
host time (engine/parallel/split.py ``host_floor_s``; Flux.1-dev's two-GPU rows were bound by it). Every millisecond
cut here is cut from that floor, and from any step that waits on its host (small models, low resolutions).

Per compile mode (``--compile off blocks``):

* ``engine``: ``train_lora`` one GPU, everything resident: its steps timed, then the same number profiled
  (cProfile, this thread; the profiled steps run slower, so read the profile as shares);
* ``raw-ckpt``: the same model, the same LoRA (the engine's ``attach_lora``), diffusers' own gradient checkpointing
  (``enable_gradient_checkpointing``: torch's non-reentrant checkpoint), ``model(**kwargs)`` with the engine's own
  arguments of its last step, loss = mean square, backward;
* ``raw-block-ckpt``: the same with the engine's own block checkpoint (engine/offload/block_checkpoint.py);
  each raw row's ``grad_rel_err_vs_torch_ckpt``: its LoRA gradients against ``raw-ckpt``'s (largest relative L2);
* ``raw``: the same without checkpointing;
* ``raw-frozen``: no LoRA, torch's checkpoint, the latents requiring grad (so the backward runs): what LoRA costs.

``engine`` - ``raw-block-ckpt`` is the engine's own overhead; ``raw-ckpt`` - ``raw`` torch's checkpoint's.

    python3 bench/host_profile.py --family flux1 --variant flux1-dev --res 1024 --out-dir $OUT/host
    python3 bench/host_profile.py --tiny --out-dir /tmp/host   # a check of the script on the CPU
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.utils.checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_parallel import HostPeak, _cache  # noqa: E402
from train_bench import (  # noqa: E402
    StepRecorder, _command, _gpu_name, _versions, build_random_model, new_run_id, row_emitter,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="flux1")
    p.add_argument("--variant", default="flux1-dev")
    p.add_argument("--res", type=int, default=1024)
    p.add_argument("--compile", nargs="+", default=["off", "blocks"], choices=["off", "blocks"])
    p.add_argument("--warmup", type=int, default=3, help="steps before anything is timed (compiled: step 1 compiles)")
    p.add_argument("--timed", type=int, default=3)
    p.add_argument("--profiled", type=int, default=3, help="engine steps under cProfile, after the timed ones")
    p.add_argument("--wide", action="store_true", help="the variant at its own width (default: narrow)")
    p.add_argument("--tiny", action="store_true", help="the tiny Flux.1 on the CPU, fp32, aot_eager: a script check")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--out", default="", help="rows (default: OUT_DIR/results.jsonl)")
    p.add_argument("--note", default="")
    args = p.parse_args(argv)
    if args.tiny:
        args.variant, args.res, args.wide = "flux1-tiny", 64, True
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stats_text(prof: cProfile.Profile, package: str) -> str:
    """The profile's top rows by own time and by cumulative time, and the package's own functions."""
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(40)
    st.sort_stats("cumulative").print_stats(60)
    st.sort_stats("tottime").print_stats(package, 40)
    return out.getvalue()


def torch_checkpoint(block, *args):
    """diffusers' default checkpoint function: torch's non-reentrant checkpoint."""
    return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False)


def _raw_step(model, kwargs: dict, params) -> list[torch.Tensor]:
    """One forward + backward; returns the parameters' gradients (fp32 copies) and clears them."""
    out = model(**kwargs)
    out = out[0] if isinstance(out, tuple) else out.sample
    out.float().pow(2).mean().backward()
    grads = [p.grad.detach().float().clone() for p in params]
    for p in params:
        p.grad = None
    return grads


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gb(device: torch.device):
    return round(torch.cuda.max_memory_allocated(device) / 1e9, 3) if device.type == "cuda" else 0.0


def time_raw(model, kwargs: dict, params, device, warmup: int, timed: int) -> tuple[float, list[torch.Tensor]]:
    """(median seconds of one forward + backward (``_raw_step``), the last step's gradients)."""
    _reset_peak(device)
    times = []
    for i in range(warmup + timed):
        _sync(device)
        t = time.perf_counter()
        grads = _raw_step(model, kwargs, params)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2], grads


def rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest relative L2 error over the parameters' gradients."""
    return max(((g - w).norm() / w.norm().clamp_min(1e-30)).item() for g, w in zip(got, want))


def main(argv=None) -> int:
    from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.offload import OffloadConfig
    from lowvram_lora.engine.offload.block_checkpoint import checkpoint as block_checkpoint
    from lowvram_lora.engine.offload.footprint import named_blocks
    from lowvram_lora.engine.train import train_lora
    from lowvram_lora.engine.train.compile import compile_blocks
    from lowvram_lora.engine.train.lora_attach import attach_lora, detach_lora

    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.tiny else "cuda:0")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    model, family, cfg = build_random_model(args.variant, device, dtype, 0.02, 0, family_id=args.family,
                                            narrow=not args.wide)
    blocks = len(named_blocks(model, family))
    tmp = tempfile.TemporaryDirectory(prefix="host-profile-")
    dataset = _cache(Path(tmp.name), family, args.variant, cfg, args.res, 1)
    lora = LoraSettings(rank=16, alpha=16.0)
    base = {"run_id": new_run_id(), "gpu": f"1x {_gpu_name(device)}", **_versions(), "model": args.variant,
            "lora_rank": 16, "batch": 1, "grad_ckpt": True, "res": args.res, "precision": "fp32" if args.tiny else "bf16",
            "narrow": not args.wide, "command": _command(), "note": args.note, "bench": "host_profile"}
    emit = row_emitter(Path(args.out or out_dir / "results.jsonl"), base)
    summary = [f"# Host time per step: {args.variant} {args.res}, batch 1, LoRA r16, "
               f"{'narrow' if not args.wide else 'full width'}, on {_gpu_name(device)}", "",
               f"`{_command()}`", "", "| compile | mode | step s | ms per block | peak VRAM GB | host RAM GB (RSS) |",
               "|---|---|---|---|---|---|"]
    package = "lowvram_lora"
    for compile_mode in args.compile:
        # -- the engine's step ------------------------------------------------------------------------------
        captured: dict = {}

        def keep(_module, _args, kwargs):  # the transformer's arguments, last call wins
            captured.clear()
            captured.update({k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()})

        hook = model.register_forward_pre_hook(keep, with_kwargs=True)
        prof = cProfile.Profile()
        clocks: list[float] = []
        steps = args.warmup + args.timed + args.profiled

        def on_step(info) -> None:
            _sync(device)
            clocks.append(time.perf_counter())
            if len(clocks) == args.warmup + args.timed:
                prof.enable()
            elif len(clocks) == steps:
                prof.disable()

        rec = StepRecorder(f"engine {compile_mode}", hook=on_step)
        gc.collect()
        _reset_peak(device)
        t0 = time.perf_counter()
        with HostPeak() as host:
            train_lora(ModelConfig(dtype="fp32" if args.tiny else "bf16", family=family.id), dataset, lora,
                       TrainConfig(steps=steps, device=str(device), learning_rate=1e-4, batch_size=1), rec.callback,
                       preloaded=(model, family, args.variant),
                       offload=OffloadConfig(mode="auto", compile=compile_mode))
        hook.remove()
        timed = [b - a for a, b in zip(clocks[args.warmup - 1:], clocks[args.warmup:args.warmup + args.timed])]
        step_s = sorted(timed)[len(timed) // 2]
        (out_dir / f"engine_{compile_mode}.txt").write_text(_stats_text(prof, package))
        prof.dump_stats(str(out_dir / f"engine_{compile_mode}.prof"))
        rows = [("engine", step_s, dict(host.fields(rec.steps), peak_alloc_gb=_peak_gb(device)))]
        # -- diffusers' own step, the same model and arguments ------------------------------------------------
        kwargs = dict(captured)
        model.to(device)  # the engine leaves a preloaded model's step-constant layers where its window put them
        params = attach_lora(model, family, lora, 0)
        handle = compile_blocks(model, family, backend="aot_eager" if args.tiny else None) \
            if compile_mode == "blocks" else None
        warm = max(2, args.warmup) if compile_mode == "blocks" else 2
        reference = None  # torch's checkpoint's gradients: every raw mode's are checked against them
        try:
            for mode, ckpt in (("raw-ckpt", torch_checkpoint), ("raw-block-ckpt", block_checkpoint), ("raw", None)):
                if ckpt is None:
                    model.disable_gradient_checkpointing()
                else:
                    model.enable_gradient_checkpointing(gradient_checkpointing_func=ckpt)
                with HostPeak() as host:
                    s, grads = time_raw(model, kwargs, params, device, warm, args.timed)
                reference = reference or grads
                rows.append((mode, s, dict(host.fields([]), peak_alloc_gb=_peak_gb(device),
                                           grad_rel_err_vs_torch_ckpt=rel_err(grads, reference))))
        finally:
            if handle is not None:
                handle.remove()
            detach_lora(model)
        first = next(k for k in ("hidden_states", "x", "latents") if k in kwargs)
        frozen = dict(kwargs, **{first: kwargs[first].clone().requires_grad_(True)})
        model.enable_gradient_checkpointing()
        with HostPeak() as host:
            s, _ = time_raw(model, frozen, [frozen[first]], device, 2, args.timed)
        rows.append(("raw-frozen", s, dict(host.fields([]), peak_alloc_gb=_peak_gb(device))))
        model.disable_gradient_checkpointing()
        for mode, s, mem in rows:
            per_block = round(s / blocks * 1e3, 2)
            if mem["pinned_host_gb"] is None:  # the raw loops pin nothing: their locked pages say so
                mem = dict(mem, pinned_host_gb=mem["peak_locked_gb"], pinned_host_gb_from="peak_locked_gb")
            emit({"mode": mode, "compile": compile_mode, "step_s": round(s, 4), "ms_per_block": per_block,
                  "blocks": blocks, "wall_s": round(time.perf_counter() - t0, 1), **mem})
            summary.append(f"| {compile_mode} | {mode} | {s:.4f} | {per_block} | {mem['peak_alloc_gb']} | "
                           f"{mem['host_rss_gb']} |")
    (out_dir / "summary.md").write_text("\n".join(summary) + "\n")
    print("\n".join(summary))
    print(json.dumps({"out_dir": str(out_dir)}))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
