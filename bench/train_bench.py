"""LoRA training step time and peak VRAM of a full-size Flux transformer, per resolution and mode.

The transformer is built from the shipped config with random weights directly on
the device (no download, no checkpoint), the dataset is a synthetic cache of random
latents and text embeddings, and training goes through the engine's ``train_lora``.
Every (resolution, mode) appends one JSON row to ``--out``; ``bench/report.py``
turns the rows into bench/RESULTS.md.

On the GPU machine (see bench/gpu_env.sh)::

    source bench/gpu_env.sh
    python3 bench/train_bench.py --res 512 1024 2048 --out "$OUT/results.jsonl"

On a CPU dev machine, a quick check of the script itself::

    python bench/train_bench.py --variant flux1-tiny --device cpu --res 64 --warmup 1 --timed 2 --out /tmp/r.jsonl

Modes: only ``resident`` (all weights on the GPU) exists in the engine today. A new
mode is one function registered in ``MODES`` below: it gets the model (already on the
device, in the compute dtype) and must leave it there, unchanged, when it returns, so
the next resolution and mode reuse it. Rows of one invocation share a ``run_id``, and
report.py prints each mode's step time as a ratio to ``resident`` of the same run.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable

import torch

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "results.jsonl"
GB, GIB = 1e9, 2 ** 30


# ---------------------------------------------------------------------------- model

#: ``narrow_config``'s attention head width: the variant's depth and operator sequence at a width whose kernels take
#: next to no GPU time, so a step's time is its host's (Python, dispatch, launches).
NARROW_HEAD_DIM = 32


def narrow_config(cfg: dict) -> dict:
    """``cfg`` (a Flux-style transformer config: attention_head_dim, num_attention_heads, axes_dims_rope,
    joint_attention_dim, pooled_projection_dim where present) at two heads of ``NARROW_HEAD_DIM`` and 64-wide text
    and pooled inputs; the block counts, and so every operator a step runs, stay the variant's."""
    out = dict(cfg)
    head = out.get("attention_head_dim")
    if not head or head % NARROW_HEAD_DIM or "num_attention_heads" not in out:
        raise SystemExit(f"--narrow: {cfg.get('_class_name')} has no attention_head_dim divisible by "
                         f"{NARROW_HEAD_DIM} (narrowing is for the Flux-style families)")
    scale = head // NARROW_HEAD_DIM
    out.update(attention_head_dim=NARROW_HEAD_DIM, num_attention_heads=2)
    if out.get("axes_dims_rope"):
        axes = [a // scale for a in out["axes_dims_rope"]]
        if sum(axes) != NARROW_HEAD_DIM or any(a % 2 for a in axes):
            raise SystemExit(f"--narrow: axes_dims_rope {out['axes_dims_rope']} do not narrow to even parts of "
                             f"{NARROW_HEAD_DIM}")
        out["axes_dims_rope"] = axes
    for key in ("joint_attention_dim", "pooled_projection_dim"):
        if key in out:
            out[key] = 64
    return out


def build_random_model(variant: str, device: torch.device, dtype: torch.dtype, std: float, seed: int,
                       family_id: str = "flux1", narrow: bool = False):
    """(model, family, config) with random weights, built on ``meta`` and materialised
    straight on ``device`` in ``dtype``: no CPU init of 12B (or 32B) parameters. ``narrow``: the variant's blocks
    at ``narrow_config``'s width."""
    from lowvram_lora.engine.families import get_family, meta_model

    family = get_family(family_id)
    cfg = family.load_config(variant)
    if narrow:
        cfg = narrow_config(cfg)
    # Parameters on meta; tensors a model computes at construction (Lumina 2's RoPE tables) stay real.
    model = meta_model(family, cfg)
    # Buffers a model computes at construction (Wan's RoPE tables) are real: kept as they are (their dtype too).
    buffers = {n: b.detach().clone() for n, b in model.named_buffers() if b.device.type != "meta"}
    for p in model.parameters():  # still on meta: free; parameters only, as the loader casts (buffers keep fp32)
        p.data = p.data.to(dtype)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name and name.endswith(".weight"):
                p.fill_(1.0)  # RMSNorm / LayerNorm scales: identity, as trained models are near
            else:
                p.normal_(0.0, std, generator=gen)
        for name, b in model.named_buffers():
            if name not in buffers:  # garbage after to_empty: fail loudly rather than time it
                raise RuntimeError(f"model has buffer {name!r} on meta; initialise it in build_random_model")
            b.copy_(buffers[name].to(device))
    model.requires_grad_(False)
    model.eval()
    bad = [n for n, p in model.named_parameters() if p.device.type == "meta" or not torch.isfinite(p).all()]
    if bad:
        raise RuntimeError(f"parameters left uninitialised or non-finite: {bad[:5]} ...")
    return model, family, cfg


def meta_footprint(family, variant: str, cfg: dict, precision: str, lora, *, attach: bool = False):
    """(model, footprint) of the full-size variant built on the meta device, as a ``--plan-only`` plans it: bf16, the
    blocks swapped to int8 / int4 slab layers when ``precision`` says so (as the benches convert them), the LoRA's
    trainable count and AdamW's bytes per parameter. ``attach``: the LoRA is attached to the model too, for planners
    that count it per block."""
    from lowvram_lora.engine.config import TrainConfig
    from lowvram_lora.engine.families import meta_model
    from lowvram_lora.engine.offload.footprint import lora_param_count, measure_footprint
    from lowvram_lora.engine.slab.layout import swap_in_int8_linears
    from lowvram_lora.engine.train.lora_attach import attach_lora
    from lowvram_lora.engine.train.optimizers import lora_bytes_per_param

    model = meta_model(family, cfg)
    torch.nn.Module.to(model, dtype=torch.bfloat16)
    model.requires_grad_(False)
    trainable = lora_param_count(model, family, lora)
    if attach:
        attach_lora(model, family, lora, 0)
    if precision in ("int8", "int4"):
        swap_in_int8_linears(model, family, 4 if precision == "int4" else 8)
    fp = measure_footprint(model, family, f"{family.display_name} ({variant}, {precision})",
                           trainable_params=trainable)
    fp.lora_bytes_per_param = lora_bytes_per_param(TrainConfig())
    return model, fp


# -------------------------------------------------------------------------- dataset

def parse_res(token) -> tuple[int, int, int]:
    """``1024`` (square), ``832x480`` (width x height) or ``832x480x81`` (a clip of 81 frames) -> (w, h, frames)."""
    parts = [int(x) for x in str(token).lower().split("x")]
    if len(parts) == 1:
        return parts[0], parts[0], 1
    if len(parts) == 2:
        return parts[0], parts[1], 1
    return parts[0], parts[1], parts[2]


def write_synthetic_cache(root: Path, family, variant: str, cfg: dict, res, n_items: int, seed: int,
                          references: int | None = None):
    """A DatasetCache of ``n_items`` random latents at ``res`` (``parse_res``: a side, WxH, or WxHxF for clips)
    and random text embeddings, in the engine's cache layout, with the manifest ``open_dataset_cache`` reads (worker
    processes open the cache by it: data parallel, Dual-GPU Split mode experts).
    ``references``: reference (control) images per item at the target's size, for a variant that takes them
    (None: one where the variant needs them, none where they are optional, as Flux.2's)."""
    from safetensors.torch import save_file

    from lowvram_lora.engine.caching import CachedItem, DatasetCache
    from lowvram_lora.engine.families import default_max_sequence_length
    from lowvram_lora.engine.caching.encoders import encoder_kind

    from types import SimpleNamespace

    w, h, frames = parse_res(res)
    gen = torch.Generator().manual_seed(seed + w * h * frames)
    latent_shape = family.latent_shape(SimpleNamespace(config=SimpleNamespace(**cfg)), w, h,
                                       **({"frames": frames} if frames > 1 else {}))
    seq_len = default_max_sequence_length(family, variant)
    widths = family.text_widths(cfg)
    (root / "latents").mkdir(parents=True, exist_ok=True)
    (root / "text").mkdir(parents=True, exist_ok=True)
    items = []
    for i in range(n_items):
        key = f"bench-{res}-{i}"
        latent = torch.randn(latent_shape, generator=gen)
        entry = {"latent": latent.contiguous()}
        condition = family.first_frame(variant)
        if condition is not None:  # image-to-video: the first frame's conditioning beside the latent (Wan I2V)
            entry.update(condition.example(cfg, latent_shape, gen))
        save_file(entry, str(root / "latents" / f"{key}.safetensors"))
        text = {}
        for spec in family.text_encoder_specs(variant):
            # Padded encoders: the full length, as cached; variable-length ones: a 128-token caption (template
            # included), a typical length for Z-Image's and Lumina 2's captions.
            shape = ((widths[spec.cache_key],) if encoder_kind(spec.kind).output == "pooled"
                     else (seq_len if spec.length == "padded" else min(128, seq_len), widths[spec.cache_key]))
            text[spec.cache_key] = torch.randn(shape, generator=gen).to(torch.bfloat16)
        control = family.control_images(variant)
        count = 0 if control is None else (references if references is not None else 0 if control.optional else 1)
        for k in range(count):  # an edit model: reference images at the target's size, latents in the text entry
            text[f"control_latents_{k}"] = torch.randn(latent_shape, generator=gen)
        save_file(text, str(root / "text" / f"{key}.safetensors"))
        items.append(CachedItem(image=f"synthetic-{i}.png", caption=f"synthetic {i}", bucket=(w, h),
                                text_key=key, latent_key=key, frames=list(range(frames)) if frames > 1 else [],
                                **({"controls": [f"control_{k}.png" for k in range(count)],
                                    "control_sizes": [[w, h]] * count} if count else {})))
    from dataclasses import asdict

    from lowvram_lora.engine.caching.cache import MANIFEST_VERSION

    manifest = root / "datasets" / f"bench-{res}.json"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"version": MANIFEST_VERSION, "dataset_hash": f"bench-{res}", "family": family.id,
                                    "variant": variant, "items": [asdict(i) for i in items], "repeats": 1,
                                    "flip": False}))
    return DatasetCache(root, manifest, f"bench-{res}", family.id, variant, items)


# --------------------------------------------------------------------------- timing

class StepRecorder:
    """Collects every step's wall time, loss and peak allocation; fails fast on a NaN loss."""

    def __init__(self, label: str, hook: Callable | None = None):
        from lowvram_lora.engine.callbacks import TrainingCallback

        class _CB(TrainingCallback):
            def on_step(cb_self, info):
                self.steps.append(info)
                print(f"  [{label}] step {info.step}/{info.total_steps}: {info.seconds_per_step:.3f} s, "
                      f"loss {info.loss:.4f}, peak alloc {info.peak_vram_gb:.2f} GB", flush=True)
                if not math.isfinite(info.loss):
                    raise FloatingPointError(f"non-finite loss {info.loss} at step {info.step}")
                if hook is not None:
                    hook(info)

            def log(cb_self, message):
                print(f"  [{label}] {message}", flush=True)

        self.steps = []
        self.callback = _CB()


# ---------------------------------------------------------------------------- modes

def mode_resident(ctx: dict, dataset, steps: int, callback, loss=None):
    """All weights resident on the device, gradient checkpointing: the engine's only mode today."""
    from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.train import train_lora

    args = ctx["args"]
    return train_lora(
        ModelConfig(dtype=args.dtype, family="flux1"),
        dataset,
        LoraSettings(rank=args.rank, alpha=float(args.rank), target_modules=lora_targets(ctx)),
        TrainConfig(steps=steps, device=args.device, batch_size=args.batch,
                    learning_rate=1e-4),
        callback,
        preloaded=(ctx["model"], ctx["family"], args.variant),
        loss=loss,
    )


def mode_resident_validate(ctx: dict, dataset, steps: int, callback):
    """``resident`` plus a validation pass after every step (the first cached item held out, 4 fixed noise levels:
    4 no-grad forwards per step, Loss & Validation Options' default): its cost beside ``resident``."""
    from dataclasses import replace

    from lowvram_lora.engine.train.loss_options import LossOptions

    held = replace(dataset, validation_items=dataset.items[:1])
    return mode_resident(ctx, held, steps, callback, LossOptions(validation_every=1, validation_timesteps=4))


def mode_resident_masked(ctx: dict, dataset, steps: int, callback):
    """``resident`` with masked loss (a half-white mask per item, cached at the bucket's pixel size): the mask's
    load, area resize and weighted loss beside ``resident``."""
    from dataclasses import replace

    from safetensors.torch import save_file

    (dataset.cache_dir / "masks").mkdir(exist_ok=True)
    items = []
    for it in dataset.items:
        w, h = it.bucket
        mask = torch.zeros(h, w, dtype=torch.uint8)
        mask[:, : w // 2] = 255
        save_file({"mask": mask}, str(dataset.cache_dir / "masks" / f"{it.latent_key}.safetensors"))
        items.append(replace(it, mask_key=it.latent_key))
    return mode_resident(ctx, replace(dataset, items=items, mask_source="beside"), steps, callback)


def mode_resident_preserve(ctx: dict, dataset, steps: int, callback):
    """``resident`` with differential output preservation (weight 1): each step also runs a class prompt (the first
    item's synthetic caption entry stands in for it) with the adapter off, no gradients, and on, with backward: its
    cost beside ``resident``."""
    from dataclasses import replace

    from lowvram_lora.engine.train.loss_options import LossOptions

    cls = replace(dataset, preservation_prompt="synthetic class prompt", preservation_text_key=dataset.items[0].text_key)
    return mode_resident(ctx, cls, steps, callback, LossOptions(preservation_weight=1.0))


def lora_targets(ctx: dict) -> list[str] | None:
    """None = the family's default set; "attention" keeps only attention projections
    (no single-block proj_mlp / proj_out), the set of DESIGN.md's earlier reference."""
    if ctx["args"].lora_targets == "default":
        return None
    return [n for n in ctx["family"].lora.target_modules(ctx["model"]) if ".attn." in n]


# name -> fn(ctx, dataset, steps, callback) -> TrainedLora. Add offload modes here.
MODES: dict[str, Callable] = {"resident": mode_resident, "resident-validate": mode_resident_validate,
                              "resident-masked": mode_resident_masked, "resident-preserve": mode_resident_preserve}


# ----------------------------------------------------------------------------- main

def _start_profiler(args, steps: int):
    """Records only the last step (the callback calls prof.step() after each one)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=acts, schedule=schedule(wait=max(steps - 2, 0), warmup=1, active=1, repeat=1))
    prof.start()
    return prof


def _report_profile(prof, label: str, step_s: float, out_dir: Path) -> None:
    import re

    ka = prof.key_averages()
    text = ka.table(sort_by="self_device_time_total", row_limit=35, max_name_column_width=70)
    by_cpu = ka.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70)
    totals = "; ".join(m.group(0) for m in re.finditer(r"Self (CPU|CUDA|XPU|MPS|device) time total: *\S+", text))
    summary = f"[{label}] profiled step: wall {step_s:.3f} s (with profiler); {totals or 'no totals'}"
    print(summary + "\n" + text + "\n" + by_cpu, flush=True)
    name = "profile_" + label.replace(" ", "_").replace("px", "") + ".txt"
    (out_dir / name).write_text(summary + "\n" + text + "\n" + by_cpu)


def new_run_id() -> str:
    """A run's id in the results: its UTC start time and 6 random hex digits."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]


def row_emitter(out: Path, base: dict):
    """``emit(row)``: stamp the date and the run's common fields, append to ``out`` (jsonl), print a
    short ROW line (without the per-step lists); returns the full row. Shared by the bench scripts."""
    def emit(row: dict) -> dict:
        row = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), **base, **row}
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print("ROW", json.dumps({k: v for k, v in row.items() if k not in ("step_times", "losses", "command")}),
              flush=True)
        return row

    return emit


def host_fields(steps: list) -> dict:
    """Host RAM beside peak VRAM, under the names every row uses: the process's resident set now (RSS; anonymous +
    shared, what cannot be reclaimed) and its locked pages (engine/offload/hostmem.py), and the most the steps
    reported (their host RAM and pinned buffers)."""
    from lowvram_lora.engine.offload.hostmem import process_memory

    mem = process_memory()
    return {"host_rss_gb": round(mem.rss / GB, 3), "host_unreclaimable_gb": round(mem.unreclaimable / GB, 3),
            "host_locked_gb": round(mem.locked / GB, 3),
            "host_ram_peak_gb": max((s.host_ram_gb for s in steps), default=None),
            "pinned_host_gb": max((s.pinned_host_gb for s in steps), default=None)}


def training_row(rec: "StepRecorder", warmup: int, started: float, error: str | None, resident_step: float | None,
                 device: torch.device) -> dict:
    """The timing/memory fields of one training mode: median of the timed steps, ratio to the resident
    baseline of the same run, peak allocated/reserved, host RAM (``host_fields``), every step's time and loss."""
    cuda = device.type == "cuda"
    timed = [s.seconds_per_step for s in rec.steps][warmup:]
    step = statistics.median(timed) if timed and error is None else None
    return {
        "step_s": round(step, 4) if step else None, "error": error, "resident_step_s": resident_step,
        "x_resident": round(step / resident_step, 3) if step and resident_step else None,
        "peak_alloc_gb": round(torch.cuda.max_memory_allocated(device) / GB, 3) if cuda else 0.0,
        "peak_reserved_gb": round(torch.cuda.max_memory_reserved(device) / GB, 3) if cuda else 0.0,
        "peak_alloc_gib": round(torch.cuda.max_memory_allocated(device) / GIB, 3) if cuda else 0.0,
        "steps_warmup": warmup, "steps_timed": len(timed),
        "step_times": [round(s.seconds_per_step, 4) for s in rec.steps],
        "losses": [round(s.loss, 5) for s in rec.steps], "wall_s": round(time.perf_counter() - started, 1),
        "breakdown": _median_breakdown([s.breakdown for s in rec.steps][warmup:]),
        **host_fields(rec.steps),
    }


def _median_breakdown(parts: list) -> dict | None:
    """Median seconds per part of the timed steps (engine/train/step_timing.py)."""
    parts = [p for p in parts if p]
    if not parts:
        return None
    return {k: round(statistics.median(p[k] for p in parts), 4) for k in parts[0]}


def _versions() -> dict:
    import diffusers
    import peft

    return {"torch": torch.__version__, "diffusers": diffusers.__version__, "peft": peft.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version()}


def _gpu_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def _command() -> str:
    argv = [Path(sys.executable).name if "python" in Path(sys.executable).name else sys.executable] + sys.argv
    return shlex.join(argv)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="flux1-dev", help="shipped config: flux1-dev, flux1-schnell, flux1-tiny")
    p.add_argument("--res", type=int, nargs="+", default=[512, 1024, 2048], help="square resolutions in pixels")
    p.add_argument("--modes", nargs="+", default=["resident"], choices=sorted(MODES))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2, help="steps run but not timed")
    p.add_argument("--timed", type=int, default=4, help="steps whose median is step_s (>= 4 for a real row)")
    p.add_argument("--items", type=int, default=2, help="synthetic cache items per resolution")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="jsonl to append rows to; default $OUT/results.jsonl when OUT is set, else bench/results.jsonl")
    p.add_argument("--lora-targets", default="default", choices=["default", "attention"],
                   help="default: the family's LoRA targets; attention: attention projections only")
    p.add_argument("--profile", action="store_true",
                   help="profile the last step with torch.profiler and print the top kernels "
                        "(times include profiler overhead: keep these rows out of results.jsonl)")
    p.add_argument("--note", default="", help="free text stored in every row")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = str(Path(os.environ["OUT"]) / "results.jsonl") if os.environ.get("OUT") else str(DEFAULT_OUT)
    for r in args.res:
        if r % 16:
            p.error(f"resolution {r} must be a multiple of 16")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from lowvram_lora.engine.models import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    run_id = new_run_id()
    versions = _versions()
    command = _command()
    gpu = _gpu_name(device)
    print(f"run {run_id} on {gpu}: {versions}", flush=True)
    print(f"command: {command}", flush=True)

    t0 = time.perf_counter()
    model, family, cfg = build_random_model(args.variant, device, dtype, args.init_std, args.seed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    n_params = sum(p.numel() for p in model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"built {args.variant}: {n_params / 1e9:.2f}B params, {model_bytes / GB:.2f} GB {dtype} "
          f"on {device} in {time.perf_counter() - t0:.1f} s", flush=True)

    ctx = {"args": args, "model": model, "family": family, "config": cfg, "device": device}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    steps = args.warmup + args.timed
    with tempfile.TemporaryDirectory(prefix="lowvram-bench-") as tmp:
        for res in args.res:
            dataset = write_synthetic_cache(Path(tmp) / str(res), family, args.variant, cfg, res, args.items,
                                            args.seed)
            for mode in args.modes:
                label = f"{res}px {mode}"
                prof = _start_profiler(args, steps) if args.profile else None
                rec = StepRecorder(label, (lambda info, pr=prof: pr.step()) if prof else None)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                row = {
                    "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                    "run_id": run_id, "gpu": gpu, **versions, "model": args.variant, "res": res, "mode": mode,
                    "lora_rank": args.rank, "lora_targets": args.lora_targets, "batch": args.batch, "dtype": args.dtype, "grad_ckpt": True,
                    "model_params": n_params, "model_gb": round(model_bytes / GB, 3),
                }
                t_run = time.perf_counter()
                try:
                    result = MODES[mode](ctx, dataset, steps, rec.callback)
                except torch.cuda.OutOfMemoryError as exc:
                    row.update(step_s=None, error=f"OOM: {str(exc)[:300]}")
                    result = None
                    print(f"  [{label}] OOM", flush=True)
                times = [s.seconds_per_step for s in rec.steps]
                timed = times[args.warmup:]
                if result is not None:
                    if len(timed) < 1:
                        raise RuntimeError(f"{label}: no timed steps ({len(times)} run)")
                    row.update(
                        step_s=round(statistics.median(timed), 4),
                        step_s_mean=round(statistics.fmean(timed), 4),
                        step_s_min=round(min(timed), 4), step_s_max=round(max(timed), 4),
                        steps_warmup=args.warmup, steps_timed=len(timed),
                        step_times=[round(t, 4) for t in times],
                        losses=[round(s.loss, 5) for s in rec.steps],
                        lora_params=sum(v.numel() for v in result.state_dict.values()),
                    )
                if device.type == "cuda":
                    row.update(
                        peak_alloc_gb=round(torch.cuda.max_memory_allocated(device) / GB, 3),
                        peak_reserved_gb=round(torch.cuda.max_memory_reserved(device) / GB, 3),
                        peak_alloc_gib=round(torch.cuda.max_memory_allocated(device) / GIB, 3),
                        gpu_total_gb=round(torch.cuda.get_device_properties(device).total_memory / GB, 2),
                    )
                else:
                    row.update(peak_alloc_gb=None, peak_reserved_gb=None)
                row.update(host_fields(rec.steps))
                row.update(wall_s=round(time.perf_counter() - t_run, 2), command=command, note=args.note)
                if prof is not None:
                    prof.stop()
                    _report_profile(prof, label, times[-1] if times else float("nan"), out.parent)
                    row["note"] = (row["note"] + "; " if row["note"] else "") + "profiled"
                if len(timed) < 4 and result is not None:
                    row["note"] = (row["note"] + "; " if row["note"] else "") + f"only {len(timed)} timed steps"
                rows.append(row)
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                if result is not None:
                    print(f"  [{label}] median {row['step_s']:.3f} s/step over {len(timed)} steps; "
                          f"peak alloc {row['peak_alloc_gb']} GB, reserved {row['peak_reserved_gb']} GB", flush=True)
                del result

    print(f"\nrows appended to {out}\n")
    print(f"{'res':>5} {'mode':<12} {'step s':>8} {'alloc GB':>9} {'resv GB':>8} {'lora params':>12}")
    for r in rows:
        s = f"{r['step_s']:.3f}" if r.get("step_s") is not None else "OOM"
        print(f"{r['res']:>5} {r['mode']:<12} {s:>8} {str(r.get('peak_alloc_gb')):>9} "
              f"{str(r.get('peak_reserved_gb')):>8} {str(r.get('lora_params', '-')):>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
