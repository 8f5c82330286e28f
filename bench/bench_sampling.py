"""Sampling during training (issue 14): Flux.1-dev random weights at 1024², ``auto`` at a VRAM budget, sample
prompts every N steps; peak VRAM while sampling against the training peak, and seconds per sample image
against sampling the same model all-resident (the baseline of the same run).

No files: the transformer and a full-size Flux.1 VAE (the shipped config) are random, built on the GPU;
the sample prompts' embeddings are random tensors in the cache layout.

    source bench/gpu_env.sh
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/bench_sampling.py --budget 8 --steps 100 \\
        --every 100 --out "$OUT/results.jsonl"

``--tiny`` runs the same on the CPU with the tiny model (a check of this script).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_bench import (  # noqa: E402
    StepRecorder, _command, _gpu_name, _versions, build_random_model, row_emitter, training_row,
    write_synthetic_cache,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--res", type=int, default=1024)
    p.add_argument("--budget", type=float, default=8.0)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--sample-steps", type=int, default=20)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default="bench/results.jsonl")
    return p.parse_args(argv)


def random_vae(device, dtype, latent_channels: int, tiny: bool):
    from diffusers import AutoencoderKL

    from lowvram_lora.engine.families import shared_config

    cfg = shared_config("vae", "flux1", "config.json")
    if tiny:  # the tiny transformer's latent width, small blocks (engine/testing.py's tiny pipeline VAE)
        cfg.update(block_out_channels=[8, 16, 16, 16], layers_per_block=1, norm_num_groups=8)
    cfg["latent_channels"] = latent_channels
    vae = AutoencoderKL.from_config(cfg).to(device, dtype)
    return vae.requires_grad_(False).eval()


def main(argv=None) -> int:
    from safetensors.torch import save_file

    from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.offload import OffloadConfig
    from lowvram_lora.engine.offload.footprint import named_blocks
    from lowvram_lora.engine.sampling import SamplingConfig, decode_latents, sample_latents
    from lowvram_lora.engine.train import train_lora

    args = parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    variant = "flux1-tiny" if args.tiny else "flux1-dev"
    res = 64 if args.tiny else args.res
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    run_id = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]
    emit = row_emitter(out, {"run_id": run_id, "gpu": _gpu_name(device), **_versions(), "model": variant,
                             "lora_rank": 16, "batch": 1, "res": res, "command": _command(), "bench": "sampling"})
    model, family, cfg = build_random_model(variant, device, dtype, 0.02, 0)
    tmp = tempfile.TemporaryDirectory(prefix="sampling-bench-")
    dataset = write_synthetic_cache(Path(tmp.name), family, variant, cfg, res, 2, 0)
    gen = torch.Generator().manual_seed(1)
    prompts = []
    for i in range(args.prompts):
        key = f"sample-prompt-{i}"
        save_file({"prompt_embeds": torch.randn(family.default_max_sequence_length(variant), cfg["joint_attention_dim"],
                                                generator=gen).to(torch.bfloat16),
                   "pooled_prompt_embeds": torch.randn(cfg["pooled_projection_dim"], generator=gen).to(torch.bfloat16)},
                  str(Path(tmp.name) / "text" / f"{key}.safetensors"))
        prompts.append((f"random prompt {i}", key))
    vae = random_vae("cpu", dtype, cfg["in_channels"] // 4, args.tiny)
    dataset = dataclasses.replace(dataset, sample_prompts=prompts)
    latents = None
    object.__setattr__(dataset, "load_vae", lambda family, dtype: vae)  # the random VAE stands in for a file

    # Baseline: the same sampling with every weight resident (no LoRA, no streaming).
    autocast = torch.autocast("cuda", dtype=dtype) if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    latents = [sample_latents(model, family, dataset.load_text(key), res, res, args.sample_steps, 0, 3.5, device,
                              dtype, autocast) for _, key in prompts]
    decode_latents(vae, family, latents, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    resident_s = (time.perf_counter() - t) / len(prompts)
    resident_peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else 0.0
    emit({"mode": "sampling-resident", "seconds_per_image": round(resident_s, 3), "sample_steps": args.sample_steps,
          "peak_alloc_gb": round(resident_peak, 3),
          "note": "all weights on the GPU; with the tiled VAE decode (VAE moved to the GPU for it)"})
    if device.type == "cuda":
        for _, block in named_blocks(model, family):
            block.to("cpu")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    rec = StepRecorder("auto+sampling")
    t = time.perf_counter()
    offload = OffloadConfig(mode="auto", vram_budget_gb=args.budget) if device.type == "cuda" else None
    result = train_lora(ModelConfig(dtype="bf16" if device.type == "cuda" else "fp32", family="flux1"), dataset,
                        LoraSettings(rank=16, alpha=16.0),
                        TrainConfig(steps=args.steps, device=str(device), learning_rate=1e-4), rec.callback,
                        preloaded=(model, family, variant), offload=offload,
                        sampling=SamplingConfig(every=args.every, steps=args.sample_steps, resolution=res, seed=0),
                        sample_dir=Path(tmp.name) / "samples")
    row = training_row(rec, 2, t, None, None, device)
    info = result.settings.get("sampling", {})
    train_peak = max((s.peak_vram_gb for s in rec.steps), default=0.0)
    per_image = info["seconds"] / max(info["images"], 1)
    emit({"mode": f"auto-{args.budget:g}+sampling", "step_s": row["step_s"], "train_peak_alloc_gb": round(train_peak, 3),
          "sample_peak_alloc_gb": info.get("peak_vram_gb"), "sample_images": info.get("images"),
          "sample_seconds": info.get("seconds"), "seconds_per_image": round(per_image, 3),
          "x_resident_sampling": round(per_image / resident_s, 3), "sample_steps": args.sample_steps,
          "every": args.every, "steps": args.steps, "plan": result.settings.get("offload_plan"),
          "note": "seconds per image include the tiled VAE decode on the GPU"})
    print(f"\nresident sampling {resident_s:.2f} s/image; streamed inside training {per_image:.2f} s/image "
          f"(with decode) = {per_image / resident_s:.2f}x; peak while sampling {info.get('peak_vram_gb')} GB vs "
          f"training {train_peak:.2f} GB; training {row['step_s']} s/step")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
