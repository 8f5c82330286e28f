"""Wan clip caching benchmark (issue 25): the time to encode N clips through the Wan VAE, and its peak VRAM.

Cache Text Embeds encodes each clip window once (``engine/caching/vae_encoding.encode_images``: the family's
``vae_for(variant).encode``, diffusers' ``AutoencoderKLWan`` with tiling on, one clip at a time). Here that same
function runs on a VAE with random weights built from the shipped config (Wan 2.1: ``wan2_1``, 16 channels;
Wan 2.2: ``wan2_2``, 48 channels), in bf16 on the GPU, over N random clips of W x H x F in [-1, 1]. The arithmetic
does not depend on the weights' values, so the time and memory are the real ones.

    source bench/gpu_env.sh
    python3 bench/bench_vae_encode.py --vae wan2_1 --res 832x480x81 --clips 10 --out "$OUT/results.jsonl"
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_bench import GB, _command, _gpu_name, _versions, new_run_id, row_emitter  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vae", default="wan2_1", choices=["wan2_1", "wan2_2"])
    ap.add_argument("--res", default="832x480x81", help="W x H x frames of each clip (frames 4k+1)")
    ap.add_argument("--clips", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="bench/results.jsonl")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)

    import diffusers

    from lowvram_lora.engine.caching.vae_encoding import encode_images
    from lowvram_lora.engine.families import get_family

    width, height, frames = (int(v) for v in args.res.split("x"))
    device = torch.device(args.device)
    family = get_family("wan")
    variant = "wan2.2-ti2v-5b" if args.vae == "wan2_2" else "wan2.1-t2v-14b"
    spec = family.vae_for(variant)
    config = spec.config(Path("/nonexistent"))  # the shipped config
    torch.manual_seed(0)
    with torch.device(device):
        vae = getattr(diffusers, spec.class_name).from_config(config).to(torch.bfloat16).requires_grad_(False).eval()
    g = torch.Generator().manual_seed(1)
    clips = [torch.rand(3, frames, height, width, generator=g) * 2 - 1 for _ in range(args.clips)]
    times: list[float] = []
    last = [time.perf_counter()]

    def progress(done: int, total: int) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now
        print(f"  clip {done}/{total}: {times[-1]:.2f} s", flush=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    latents = encode_images(None, family, clips, len(clips), device, torch.bfloat16, progress,
                            vae_loader=lambda: vae, variant=variant)
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None
    reserved = torch.cuda.max_memory_reserved(device) / GB if device.type == "cuda" else None
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    emit = row_emitter(Path(args.out), {"run_id": new_run_id(), "gpu": _gpu_name(device), **_versions()})
    emit({"model": f"{args.vae}-vae", "family": "wan",
          "mode": "vae-encode-clips", "res": args.res, "step_s": None, "clips": args.clips,
          "wall_s": round(wall, 2), "s_per_clip_median": round(sorted(times)[len(times) // 2], 3),
          "first_clip_s": round(times[0], 3),
          "peak_alloc_gb": round(peak, 3) if peak is not None else None,
          "peak_reserved_gb": round(reserved, 3) if reserved is not None else None,
          "latent_shape": list(latents[0].shape), "command": _command(), "note": args.note})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
