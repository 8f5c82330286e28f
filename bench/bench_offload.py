"""Block streaming against the all-resident baseline, in one run: step time, peak VRAM, copy/stall time.

Full-size Flux.1 with random weights, built on the meta device: the modules outside the
blocks are materialised on the GPU, each block is filled on the GPU and copied once into
its pinned host buffer (no second host copy, pinned once for every mode of the run).
Training goes through the engine's ``train_lora`` with an ``OffloadConfig``; rows are
appended to ``--out`` in train_bench.py's format (``bench/report.py`` renders them), each
with the resident step time of the same run and the ratio, and the plan and copy
diagnostics in ``note``.

On the GPU machine (carry .whl)::

    source bench/gpu_env.sh
    python3 bench/bench_offload.py --res 1024 --aspect --modes resident stream-k1 stream-k2 stream-k3 stream-k1-act auto-3 auto-4 auto-6 auto-12 peer
    python3 bench/bench_offload.py --res 512 2048 --warmup 1 --timed 3 --modes resident stream-k1 stream-k2 stream-k1-act stream-k2-act auto-8
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/bench_offload.py --res 1024 2048 --aspect \
        --warmup 1 --timed 3 --modes resident stream-k2 stream-k1-act --note "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"

(the commands behind the rows of 2026-11-22 in bench/results.jsonl; ``--aspect`` adds a 4:3 bucket so
steps alternate between two activation sizes, as aspect-ratio bucketing does).

On a CPU dev machine, a check of the script itself (CUDA-only modes are skipped)::

    python bench/bench_offload.py --variant flux1-tiny --device cpu --res 64 --modes resident --warmup 1 --timed 1

Modes: ``resident``; ``stream-k<K>[-act][-r<R>]`` (prefetch depth K, activation offload,
R resident blocks); ``auto-<GB>``; ``peer`` (diffusers group offloading, block_level,
use_stream=True, one block per group, under the same step function as train_lora).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_bench import GB, GIB, StepRecorder, _command, _gpu_name, _versions, write_synthetic_cache, new_run_id  # noqa: E402


# ---------------------------------------------------------------------------- model

def build_streamable_model(variant: str, device: torch.device, dtype: torch.dtype, std: float, seed: int,
                           config_overrides: dict | None = None):
    """(model, family, cfg): non-block modules on ``device``, every block's frozen tensors in a pinned
    host buffer (HostBlock), filled with random values on the device and copied over once."""
    from lowvram_lora.engine.families import get_family
    from lowvram_lora.engine.offload.footprint import named_blocks
    from lowvram_lora.engine.offload.host import HostBlock

    family = get_family("flux1")
    cfg = dict(family.load_config(variant), **(config_overrides or {}))
    with torch.device("meta"):
        model = family.transformer_class().from_config(cfg)
    torch.nn.Module.to(model, dtype=dtype)
    model.requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(seed)

    def init_(name: str, t: torch.Tensor) -> None:
        if t.ndim == 1 and "norm" in name and name.endswith(".weight"):
            t.fill_(1.0)  # norm scales: identity, as trained models are near
        else:
            t.normal_(0.0, std, generator=gen)

    blocks = named_blocks(model, family)
    in_blocks = {id(t) for _, b in blocks for t in b.parameters()}
    with torch.no_grad():
        for name, module in model.named_modules():  # the rest: straight on the device
            for pname, p in list(module._parameters.items()):
                if p is not None and id(p) not in in_blocks:
                    new = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=False)
                    init_(f"{name}.{pname}", new)
                    module._parameters[pname] = new
        if any(True for _ in model.buffers()):
            raise RuntimeError("model has buffers; initialise them in build_streamable_model")
        pin = device.type == "cuda"
        for block_name, block in blocks:
            full = {id(m): f"{block_name}.{n}" if n else block_name for n, m in block.named_modules()}

            def fill(hb, full=full):
                tmp = torch.empty(hb.nbytes, dtype=torch.uint8, device=device)  # one block on the device
                for e, view in zip(hb.entries, hb.views(tmp)):
                    init_(f"{full[id(e.module)]}.{e.name}", view)
                hb.buffer.copy_(tmp)

            HostBlock.for_block(block, block_name, pin=pin, fill=fill)
    model.eval()
    bad = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if bad:
        raise RuntimeError(f"parameters left uninitialised: {bad[:5]}")
    return model, family, cfg


def restore_host(ctx: dict) -> None:
    """Back to the canonical state after a mode: blocks in pinned host memory, the rest on the device."""
    from lowvram_lora.engine.offload.footprint import named_blocks

    model, device = ctx["model"], ctx["device"]
    for _, block in named_blocks(model, ctx["family"]):
        hb = getattr(block, "_lowvram_host_block", None)
        if hb is not None and not hb.bound_to_host():
            hb.bind_host()  # frozen weights: the host copy is still exact; drops any device copy
    for t in ctx["other_tensors"]:
        if t.device != device:
            t.data = t.data.to(device)


# ---------------------------------------------------------------------------- modes

def _train(ctx, dataset, steps, callback, offload):
    from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.train import train_lora

    args = ctx["args"]
    try:
        return train_lora(
            ModelConfig(dtype=args.dtype, family="flux1"), dataset,
            LoraSettings(rank=args.rank, alpha=float(args.rank), target_modules=_targets(ctx)),
            TrainConfig(steps=steps, device=args.device, batch_size=args.batch,
                        learning_rate=1e-4),
            callback, preloaded=(ctx["model"], ctx["family"], args.variant), offload=offload,
        )
    finally:
        restore_host(ctx)


def _targets(ctx):
    if ctx["args"].lora_targets == "default":
        return None
    return [n for n in ctx["family"].lora.target_modules(ctx["model"]) if ".attn." in n]


def mode_fn(name: str):
    from lowvram_lora.engine.offload import OffloadConfig

    if name == "resident":
        return lambda ctx, ds, steps, cb: _train(ctx, ds, steps, cb, None)
    if name == "peer":
        return mode_peer
    m = re.fullmatch(r"auto-(\d+(?:\.\d+)?)", name)
    if m:
        return lambda ctx, ds, steps, cb: _train(ctx, ds, steps, cb,
                                                 OffloadConfig(mode="auto", vram_budget_gb=float(m.group(1))))
    m = re.fullmatch(r"stream-k(\d)(-act)?(?:-r(\d+))?", name)
    if m:
        cfg = OffloadConfig(mode="stream", prefetch_depth=int(m.group(1)), activation_offload=bool(m.group(2)),
                            resident_blocks=int(m.group(3)) if m.group(3) else None)
        return lambda ctx, ds, steps, cb: _train(ctx, ds, steps, cb, cfg)
    raise SystemExit(f"unknown mode {name!r}: resident, stream-k<K>[-act][-r<R>], auto-<GB>, peer")


def mode_peer(ctx, dataset, steps, callback):
    """diffusers group offloading (block_level, use_stream) under train_lora's own step function."""
    from diffusers.hooks import apply_group_offloading

    from lowvram_lora.engine.callbacks import StepInfo
    from lowvram_lora.engine.config import LoraSettings, TrainConfig
    from lowvram_lora.engine.train.batching import bucket_batches
    from lowvram_lora.engine.attention import training_attention
    from lowvram_lora.engine.train.loop import _clip, _load_batch, _micro_step
    from lowvram_lora.engine.train.lora_attach import attach_lora, detach_lora, lora_state_dict
    from lowvram_lora.engine.lora_io.trained import TrainedLora

    args, model, family, device = ctx["args"], ctx["model"], ctx["family"], ctx["device"]
    dtype = torch.bfloat16
    train = TrainConfig(steps=steps, device=args.device, batch_size=args.batch, learning_rate=1e-4)
    model.enable_gradient_checkpointing()
    params = attach_lora(model, family, LoraSettings(rank=args.rank, alpha=float(args.rank),
                                                     target_modules=_targets(ctx)), train.seed)
    for p in params:
        p.data = p.data.to(device)
    result = TrainedLora(state_dict={}, rank=args.rank, alpha=float(args.rank), family="flux1",
                         variant=args.variant, steps=0, requested_steps=steps)
    try:
        apply_group_offloading(model, onload_device=device, offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1, use_stream=True)
        opt = torch.optim.AdamW(params, lr=train.learning_rate)
        gen = torch.Generator().manual_seed(train.seed)
        batches = bucket_batches(dataset.training_items(), train.batch_size, train.seed, lambda it: it.bucket)
        torch.cuda.reset_peak_memory_stats(device)
        model.train()
        with training_attention(device):
            for step in range(1, steps + 1):
                t0 = time.perf_counter()
                lat, emb = _load_batch(dataset, next(batches), device, dtype, gen)
                loss = _micro_step(model, family, lat, emb, train, gen, torch.autocast("cuda", dtype=dtype), 1.0)
                gn = _clip(params, train.max_grad_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize(device)
                result.loss_history.append(loss)
                result.steps = step
                callback.on_step(StepInfo(step, steps, loss, train.learning_rate, gn,
                                          time.perf_counter() - t0, torch.cuda.max_memory_allocated(device) / GB))
        result.state_dict = lora_state_dict(model)
        b_norm = sum(v.float().norm().item() for k, v in result.state_dict.items() if ".lora_B." in k)
        result.settings["peer_lora_b_norm"] = b_norm  # 0: the LoRA never learned (snapshot swapping)
        return result
    finally:
        for m in model.modules():
            reg = getattr(m, "_diffusers_hook", None)
            if reg is not None:
                for hook_name in ("group_offloading", "lazy_prefetch_group_offloading", "layer_execution_tracker"):
                    if reg.get_hook(hook_name) is not None:
                        reg.remove_hook(hook_name, recurse=False)
        detach_lora(model)
        model.disable_gradient_checkpointing()
        model.eval()
        restore_host(ctx)


# ----------------------------------------------------------------------------- main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="flux1-dev")
    p.add_argument("--res", type=int, nargs="+", default=[1024])
    p.add_argument("--modes", nargs="+", default=["resident", "stream-k1", "stream-k2", "stream-k3",
                                                  "auto-3", "auto-6", "auto-12"])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timed", type=int, default=4)
    p.add_argument("--items", type=int, default=2)
    p.add_argument("--aspect", action="store_true",
                   help="also a 4:3 bucket in the synthetic data (allocator growth across buckets)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora-targets", default="default", choices=["default", "attention"])
    p.add_argument("--out", default=None, help="jsonl to append to; default $OUT/results.jsonl or bench/results.jsonl")
    p.add_argument("--note", default="")
    args = p.parse_args(argv)
    if args.out is None:
        import os

        args.out = (str(Path(os.environ["OUT"]) / "results.jsonl") if os.environ.get("OUT")
                    else str(Path(__file__).resolve().parent / "results.jsonl"))
    for m in args.modes:
        mode_fn(m)  # fail on a typo before building 24 GB
    return args


def _median(xs):
    return round(statistics.median(xs), 4) if xs else None


def main(argv=None) -> int:
    args = parse_args(argv)
    from lowvram_lora.engine.errors import ConfigError
    from lowvram_lora.engine.models import resolve_device, resolve_dtype
    from lowvram_lora.engine.offload.host import host_rss_bytes

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    cuda = device.type == "cuda"
    modes = [m for m in args.modes if cuda or m == "resident"]
    run_id = new_run_id()
    versions, command, gpu = _versions(), _command(), _gpu_name(device)
    print(f"run {run_id} on {gpu}: {versions}\ncommand: {command}", flush=True)
    t0 = time.perf_counter()
    model, family, cfg = build_streamable_model(args.variant, device, dtype, args.init_std, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"built {args.variant}: {n_params / 1e9:.2f}B params, {model_bytes / GB:.2f} GB, blocks pinned on the "
          f"host in {time.perf_counter() - t0:.1f} s; host RSS {host_rss_bytes() / GB:.1f} GB", flush=True)
    from lowvram_lora.engine.offload.footprint import named_blocks

    if cuda:  # host->GPU bandwidth from a registered block buffer (6.6 GB/s would mean it is not pinned)
        hb = named_blocks(model, family)[0][1]._lowvram_host_block
        dst = torch.empty(hb.nbytes, dtype=torch.uint8, device=device)
        dst.copy_(hb.buffer, non_blocking=True)
        torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        for _ in range(5):
            dst.copy_(hb.buffer, non_blocking=True)
        torch.cuda.synchronize(device)
        print(f"host->GPU from a pinned block buffer: {5 * hb.nbytes / (time.perf_counter() - t1) / GB:.1f} GB/s "
              f"(is_pinned={hb.buffer.is_pinned()})", flush=True)
        del dst
    in_blocks = {id(t) for _, b in named_blocks(model, family) for t in b.parameters()}
    ctx = {"args": args, "model": model, "family": family, "config": cfg, "device": device,
           "other_tensors": [p for p in model.parameters() if id(p) not in in_blocks]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows, steps = [], args.warmup + args.timed
    with tempfile.TemporaryDirectory(prefix="lowvram-bench-") as tmp:
        for res in args.res:
            dataset = write_synthetic_cache(Path(tmp) / str(res), family, args.variant, cfg, res, args.items,
                                            args.seed)
            if args.aspect:  # a second, 4:3 bucket of about the same area (fewer tokens than the square)
                from safetensors.torch import save_file

                from lowvram_lora.engine.caching import CachedItem

                w, h = round(res * (4 / 3) ** 0.5 / 64) * 64, round(res * 0.75 ** 0.5 / 64) * 64
                key = f"bench-{res}-aspect"
                lat = torch.randn(cfg["in_channels"] // 4, h // 8, w // 8, generator=torch.Generator().manual_seed(1))
                save_file({"latent": lat}, str(dataset.cache_dir / "latents" / f"{key}.safetensors"))
                dataset.items.append(CachedItem("aspect.png", "aspect", (w, h), dataset.items[0].text_key, key))
            resident_step = None
            for mode in modes:
                label = f"{res}px {mode}"
                rec = StepRecorder(label)
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                row = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "run_id": run_id,
                       "gpu": gpu, **versions, "model": args.variant, "res": res, "mode": mode,
                       "lora_rank": args.rank, "lora_targets": args.lora_targets, "batch": args.batch,
                       "dtype": args.dtype, "grad_ckpt": True, "model_params": n_params,
                       "model_gb": round(model_bytes / GB, 3)}
                t_run = time.perf_counter()
                result, err = None, None
                try:
                    result = mode_fn(mode)(ctx, dataset, steps, rec.callback)
                except torch.cuda.OutOfMemoryError as exc:
                    err = f"OOM: {str(exc).splitlines()[0][:300]}"
                except ConfigError as exc:  # e.g. auto refusing a budget below its smallest plan
                    err = f"refused: {str(exc)[:400]}"
                except Exception as exc:  # the peer may not train at all; record why and go on
                    if mode != "peer":
                        raise
                    err = f"{type(exc).__name__}: {str(exc)[:300]}"
                if err:
                    print(f"  [{label}] failed: {err}", flush=True)
                    restore_host(ctx)
                times = [s.seconds_per_step for s in rec.steps]
                timed = times[args.warmup:]
                notes = [args.note] if args.note else []
                if result is not None and timed:
                    row.update(step_s=round(statistics.median(timed), 4), step_s_mean=round(statistics.fmean(timed), 4),
                               step_s_min=round(min(timed), 4), step_s_max=round(max(timed), 4),
                               steps_warmup=args.warmup, steps_timed=len(timed),
                               step_times=[round(t, 4) for t in times], losses=[round(s.loss, 5) for s in rec.steps],
                               lora_params=sum(v.numel() for v in result.state_dict.values()))
                    if mode == "resident":
                        resident_step = row["step_s"]
                    if resident_step:
                        row["resident_step_s"] = resident_step
                        row["x_resident"] = round(row["step_s"] / resident_step, 3)
                    plan, stats = result.settings.get("offload_plan"), result.settings.get("offload_stats")
                    if plan:
                        row["plan"] = plan
                        copy_s = stats.get("step_copy_s", [])[args.warmup:]
                        stall_s = stats.get("step_stall_s", [])[args.warmup:]
                        row["stats"] = {k: v for k, v in stats.items() if not k.startswith("step_")}
                        row.update(copy_busy_s=_median(copy_s), stall_s=_median(stall_s))
                        notes.append(
                            f"plan {plan['mode']}: {plan['streamed_blocks']} streamed, {plan['resident_blocks']} "
                            f"resident, k={plan['prefetch_depth']}, act offload {'on' if plan['activation_offload'] else 'off'}, "
                            f"predicted peak {plan['predicted_peak_gb']} GB, {plan['streamed_gb_per_step']} GB/step"
                            + (f"; copy engine busy {row['copy_busy_s']} s/step, compute stalled {row['stall_s']} s/step"
                               if row.get("copy_busy_s") is not None else "")
                            + f"; sync loads {stats.get('sync_loads')}")
                    if "peer_lora_b_norm" in result.settings:
                        row["peer_lora_b_norm"] = result.settings["peer_lora_b_norm"]
                        notes.append(f"LoRA B norm after training {result.settings['peer_lora_b_norm']:.3g}")
                elif err:
                    row.update(step_s=None, error=err)
                if cuda:
                    alloc, resv = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
                    row.update(peak_alloc_gb=round(alloc / GB, 3), peak_reserved_gb=round(resv / GB, 3),
                               peak_alloc_gib=round(alloc / GIB, 3), reserved_minus_alloc_gb=round((resv - alloc) / GB, 3),
                               gpu_total_gb=round(torch.cuda.get_device_properties(device).total_memory / GB, 2))
                row.update(host_rss_gb=round(host_rss_bytes() / GB, 2), wall_s=round(time.perf_counter() - t_run, 2),
                           command=command, note="; ".join(n for n in notes if n))
                if len(timed) < 4 and result is not None:
                    row["note"] += ("; " if row["note"] else "") + f"only {len(timed)} timed steps"
                rows.append(row)
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"  [{label}] {row.get('step_s')} s/step (x{row.get('x_resident', '-')}), peak alloc "
                      f"{row.get('peak_alloc_gb')} GB, reserved {row.get('peak_reserved_gb')} GB; {row['note']}",
                      flush=True)
                del result

    print(f"\nrows appended to {out}\n")
    print(f"{'res':>5} {'mode':<16} {'step s':>7} {'x res':>6} {'alloc':>6} {'resv':>6} {'pred':>6} "
          f"{'copy s':>6} {'stall':>6}")
    for r in rows:
        s = f"{r['step_s']:.3f}" if r.get("step_s") is not None else (r.get("error") or "-")[:7]
        pred = (r.get("plan") or {}).get("predicted_peak_gb", "-")
        print(f"{r['res']:>5} {r['mode']:<16} {s:>7} {str(r.get('x_resident', '-')):>6} "
              f"{str(r.get('peak_alloc_gb')):>6} {str(r.get('peak_reserved_gb')):>6} {str(pred):>6} "
              f"{str(r.get('copy_busy_s', '-')):>6} {str(r.get('stall_s', '-')):>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
