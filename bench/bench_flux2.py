"""Flux.2 benchmark (issue 10 §7): resident, int8 slab streamed, and auto, against the bf16 resident
baseline of the same run. No files (the GPU machine's disk cannot hold a 64 GB Flux.2-dev):
a random model is built in GPU memory, and its int8 form is made block by block on the GPU
(``Int8Linear.from_linear``, the slab's quantization), each block then moved to host memory.

Modes (``--modes``), in order:

- ``bf16-resident``: every weight on the GPU (the baseline);
- ``int8-resident``: block Linears int8 on the GPU;
- ``int8-stream-k<K>[-act]``: blocks int8 in pinned host memory, streamed, optional activation offload;
- ``int8-auto-<GB>``: ``auto`` at a VRAM budget;
- ``bf16-auto-<GB>``: ``auto`` with bf16 blocks (run before the int8 conversion);
- a ``-b<budget>`` suffix on any of them compiles the blocks (``compile='blocks'``) at that
  activation-memory budget; without it they run eager.

The copy floor of a streamed row is ``bytes streamed per step / --pinned-gbps`` (DESIGN.md §5:
55 GB/s pinned host->GPU on these machines), printed beside each streamed row.

    source bench/gpu_env.sh
    python3 bench/bench_flux2.py --variant flux2-dev --res 512 1024 --out "$OUT/results.jsonl"
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_bench import (  # noqa: E402
    StepRecorder, _command, _gpu_name, _versions, build_random_model, row_emitter, training_row, new_run_id,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="flux2-dev")
    p.add_argument("--res", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--modes", nargs="+", default=["bf16-resident", "int8-stream-k1-act", "int8-auto-6"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timed", type=int, default=3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--pinned-gbps", type=float, default=55.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="bench/results.jsonl")
    p.add_argument("--note", default="")
    return p.parse_args(argv)


def write_synthetic_cache(root: Path, family, variant: str, cfg: dict, res: int, n_items: int, seed: int):
    """A DatasetCache of random Flux.2 latents (C, res/16, res/16) and prompt embeddings (L, joint)."""
    from safetensors.torch import save_file

    from lowvram_lora.engine.caching import CachedItem, DatasetCache
    from lowvram_lora.engine.families import default_max_sequence_length

    gen = torch.Generator().manual_seed(seed + res)
    seq = default_max_sequence_length(family, variant)
    (root / "latents").mkdir(parents=True, exist_ok=True)
    (root / "text").mkdir(parents=True, exist_ok=True)
    items = []
    for i in range(n_items):
        key = f"bench2-{res}-{i}"
        save_file({"latent": torch.randn(cfg["in_channels"], res // 16, res // 16, generator=gen)},
                  str(root / "latents" / f"{key}.safetensors"))
        save_file({"prompt_embeds": torch.randn(seq, cfg["joint_attention_dim"], generator=gen).to(torch.bfloat16)},
                  str(root / "text" / f"{key}.safetensors"))
        items.append(CachedItem(image=f"synthetic-{i}.png", caption=f"synthetic {i}", bucket=(res, res),
                                text_key=key, latent_key=key))
    return DatasetCache(root, root / "datasets" / f"bench2-{res}.json", f"bench2-{res}", family.id, variant, items)


def to_int8_on_host(model, family, device, bits: int = 8) -> None:
    """Block by block on the GPU: quantize every block Linear (int8 rows, or int4 groups with bits=4: the
    slab's values), then move the block to the CPU (frees its bf16 weights). Non-block modules stay where they are."""
    from lowvram_lora.engine.offload.footprint import named_blocks
    from lowvram_lora.engine.slab import Int4Linear, Int8Linear

    quantized = Int4Linear if bits == 4 else Int8Linear
    for name in family.memory.int8_extra_linears:  # as a slab has them: quantized, resident
        parent, _, child = name.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        setattr(holder, child, quantized.from_linear(getattr(holder, child).to(device)))
    for _, block in named_blocks(model, family):
        block.to(device)  # quantize on the GPU (blocks may already be on the host)
        for name, module in list(block.named_modules()):
            if isinstance(module, torch.nn.Linear) and not isinstance(module, (Int8Linear, Int4Linear)):
                parent, _, child = name.rpartition(".")
                setattr(block.get_submodule(parent) if parent else block, child, quantized.from_linear(module))
        block.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()


def to_streamed_form(model, family, precision: str, device) -> None:
    """Blocks to host memory (int8 slab layers when ``precision`` is int8): what a loaded checkpoint looks like to a
    streamed mode. Shared by the benches that run resident modes first, then streamed ones."""
    from lowvram_lora.engine.offload.footprint import named_blocks

    if precision in ("int8", "int4"):
        to_int8_on_host(model, family, device, 4 if precision == "int4" else 8)
    else:
        for _, block in named_blocks(model, family):
            block.to("cpu")
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.offload import OffloadConfig

    args = parse_args(argv)
    device = torch.device(args.device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    run_id = new_run_id()
    cuda = device.type == "cuda"  # CPU only for a smoke test of this script on a tiny model
    base = {"run_id": run_id, "gpu": _gpu_name(device) if cuda else "cpu", **_versions(), "model": args.variant, "lora_rank": args.rank,
            "lora_targets": "default", "batch": 1, "grad_ckpt": True, "command": _command(), "note": args.note}

    emit = row_emitter(out, base)

    t = time.perf_counter()
    model, family, cfg = build_random_model(args.variant, device, torch.bfloat16, 0.02, 0, family_id="flux2")
    print(f"random {args.variant}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params in "
          f"{time.perf_counter() - t:.0f} s", flush=True)
    datasets, rows = {}, {}
    tmp = tempfile.TemporaryDirectory(prefix="flux2-bench-")
    for res in args.res:
        datasets[res] = write_synthetic_cache(Path(tmp.name) / str(res), family, args.variant, dict(cfg), res, 4, 0)
    precision = "bf16"
    for mode in args.modes:
        kind, _, placement = mode.partition("-")
        compiled = {"compile": "off"}  # "-b<budget>" last: compiled blocks at that activation-memory budget
        head, sep, tail = placement.rpartition("-b")
        if sep and tail.replace(".", "", 1).isdigit():
            placement, compiled = head, {"compile": "blocks", "activation_memory_budget": float(tail)}
        if kind == "int8" and precision == "bf16":
            t = time.perf_counter()
            to_int8_on_host(model, family, device)
            precision = "int8"
            print(f"int8 blocks made and moved to host memory in {time.perf_counter() - t:.0f} s", flush=True)
        if kind != precision:
            raise SystemExit(f"mode {mode!r}: list bf16 modes before int8 ones")
        if placement == "resident":
            from lowvram_lora.engine.offload.footprint import named_blocks

            for _, block in named_blocks(model, family):
                block.to(device)
            offload = OffloadConfig(mode="resident", **compiled)
        elif placement.startswith("stream-k"):
            spec = placement[len("stream-k"):]
            offload = OffloadConfig(mode="stream", prefetch_depth=int(spec[0]), activation_offload=spec.endswith("-act"),
                                    **compiled)
        elif placement.startswith("auto-"):
            offload = OffloadConfig(mode="auto", vram_budget_gb=float(placement[len("auto-"):]), **compiled)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
        for res in args.res:
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            rec = StepRecorder(f"{mode} {res}")
            t = time.perf_counter()
            error, result = None, None
            try:
                from lowvram_lora.engine.train import train_lora

                result = train_lora(ModelConfig(dtype="bf16", family="flux2"), datasets[res],
                                    LoraSettings(rank=args.rank, alpha=float(args.rank)),
                                    TrainConfig(steps=args.warmup + args.timed, device=args.device, learning_rate=1e-4),
                                    rec.callback, preloaded=(model, family, args.variant), offload=offload)
            except (torch.cuda.OutOfMemoryError, Exception) as exc:  # noqa: BLE001 - a row per failure
                error = f"{type(exc).__name__}: {str(exc)[:400]}"
                print("ERROR", error, flush=True)
            resident = rows.get(("bf16-resident", res), {}).get("step_s")
            plan = (result.settings.get("offload_plan") if result is not None else None) or {}
            streamed_gb = plan.get("streamed_gb_per_step") if plan.get("mode") == "stream" else None
            floor = streamed_gb / args.pinned_gbps if streamed_gb else None
            row = training_row(rec, args.warmup, t, error, resident, device)
            rows[(mode, res)] = emit({
                "mode": mode, "res": res, **row, "copy_floor_s": round(floor, 4) if floor else None,
                "x_copy_floor": round(row["step_s"] / floor, 3) if row["step_s"] and floor else None, "plan": plan,
            })
        if placement == "resident" and precision == "int8":
            from lowvram_lora.engine.offload.footprint import named_blocks

            for _, block in named_blocks(model, family):
                block.to("cpu")
    print("\nmode                     res   step s   x resident   x copy floor   peak alloc GB")
    for (mode, res), r in rows.items():
        print(f"{mode:24s} {res:5d} {r['step_s'] or float('nan'):8.3f} {r['x_resident'] or float('nan'):12.3f}"
              f" {r['x_copy_floor'] or float('nan'):14.3f} {r['peak_alloc_gb']:15.2f}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
