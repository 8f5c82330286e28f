"""Clip caching benchmark (issues 25, 39): the time to encode N clips through a video VAE, its peak VRAM and host RAM.

Cache Text Embeds encodes each clip window once (``engine/caching/vae_encoding.encode_images``: the family's
``vae_for(variant).encode``, diffusers' video VAE with tiling on, one clip at a time). Here that same function runs on
a VAE with random weights built from the shipped config (Wan 2.1: ``wan2_1``, ``AutoencoderKLWan``, 16 channels;
Wan 2.2: ``wan2_2``, 48 channels; LTX-2.3: ``ltx2``, ``AutoencoderKLLTX2Video``, 128 channels, 32x spatial and 8x
temporal, ``configs/vae/ltx2.3.json``), in bf16 on the GPU, over N random clips of W x H x F in [-1, 1]. The
arithmetic does not depend on the weights' values, so the time and memory are the real ones. Frames are 4k+1 for
Wan, 8k+1 for LTX-2; width and height a multiple of the VAE's spatial factor (8 / 16 / 32). Host RAM while the clips
encode, sampled every 20 ms (the one clip held on the host included): ``host_rss_gb`` the peak resident set,
``host_unreclaimable_peak_gb`` the peak of anonymous + shared memory (what the RAM planner counts).

    source bench/gpu_env.sh
    python3 bench/bench_vae_encode.py --vae wan2_1 --res 832x480x81 --clips 10 --out "$OUT/results.jsonl"
    python3 bench/bench_vae_encode.py --vae ltx2 --res 960x544x89 --clips 10 --out "$OUT/results.jsonl"

A CPU check that the command runs (not a measurement): ``--device cpu --vae ltx2 --res 64x64x9 --clips 1``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_bench import GB, _command, _gpu_name, _versions, new_run_id, row_emitter  # noqa: E402
from bench_experts import HostSampler  # noqa: E402

#: --vae -> (family, variant whose VAE is timed, frames are a multiple of this plus 1, W / H a multiple of this).
VAES = {"wan2_1": ("wan", "wan2.1-t2v-14b", 4, 8), "wan2_2": ("wan", "wan2.2-ti2v-5b", 4, 16),
        "ltx2": ("ltx2", "ltx2.3", 8, 32)}


def shipped_config(family, spec) -> dict:
    """The VAE's shipped diffusers config, as a single file without a companion folder is read with: Wan's
    ``spec.config`` (no companion), LTX-2's ``configs/vae/<single_file_config>.json`` of its family folder."""
    import json
    from importlib import resources

    from lowvram_lora.engine.families.base import family_package

    if hasattr(spec, "config"):
        return spec.config(Path("/nonexistent"))
    ref = resources.files(family_package(family)).joinpath("configs", "vae", f"{spec.single_file_config}.json")
    return {k: v for k, v in json.loads(ref.read_text()).items() if not k.startswith("_")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vae", default="wan2_1", choices=list(VAES),
                    help="wan2_1 / wan2_2: Wan's VAEs; ltx2: LTX-2.3's video VAE")
    ap.add_argument("--res", default="832x480x81",
                    help="W x H x frames of each clip (frames 4k+1 for Wan, 8k+1 for LTX-2: 960x544x89)")
    ap.add_argument("--clips", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="bench/results.jsonl")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)

    import diffusers

    from lowvram_lora.engine.caching.vae_encoding import encode_images
    from lowvram_lora.engine.families import get_family

    family_id, variant, frame_step, pixel_step = VAES[args.vae]
    try:
        width, height, frames = (int(v) for v in args.res.split("x"))
    except ValueError:
        ap.error(f"--res {args.res!r}: give W x H x frames, e.g. 832x480x81")
    if (frames - 1) % frame_step or width % pixel_step or height % pixel_step:
        ap.error(f"--res {args.res}: the {args.vae} VAE takes {frame_step}k+1 frames and a width and height that are "
                 f"multiples of {pixel_step}")
    device = torch.device(args.device)
    family = get_family(family_id)
    spec = family.vae_for(variant)
    config = shipped_config(family, spec)
    torch.manual_seed(0)
    with torch.device(device):
        vae = getattr(diffusers, spec.class_name).from_config(config).to(torch.bfloat16).requires_grad_(False).eval()
    g = torch.Generator().manual_seed(1)
    # One random clip given N times (the arithmetic does not depend on the values): the host holds one clip at a time,
    # as the cache build does, so the row's host RAM is the encode's (10 distinct 960x544x89 clips would be 5.6 GB).
    clip = torch.rand(3, frames, height, width, generator=g) * 2 - 1
    clips = (clip for _ in range(args.clips))
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
    host = HostSampler()
    t0 = time.perf_counter()
    latents = encode_images(None, family, clips, args.clips, device, torch.bfloat16, progress,
                            vae_loader=lambda: vae, variant=variant)
    wall = time.perf_counter() - t0
    ram = host.stop()
    peak = torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None
    reserved = torch.cuda.max_memory_reserved(device) / GB if device.type == "cuda" else None
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    emit = row_emitter(Path(args.out), {"run_id": new_run_id(), "gpu": _gpu_name(device), **_versions()})
    emit({"model": f"{args.vae}-vae", "family": family_id, "variant": variant,
          "mode": "vae-encode-clips", "res": args.res, "step_s": None, "clips": args.clips,
          "wall_s": round(wall, 2), "s_per_clip_median": round(sorted(times)[len(times) // 2], 3),
          "first_clip_s": round(times[0], 3),
          "peak_alloc_gb": round(peak, 3) if peak is not None else None,
          "peak_reserved_gb": round(reserved, 3) if reserved is not None else None,
          "host_ram_gb": ram["host_peak_gb"], "pinned_gb": ram["host_locked_peak_gb"],  # the rows' common names
          "host_rss_gb": round(ram["host_rss_peak_gb"], 2), "host_unreclaimable_peak_gb": ram["host_peak_gb"],
          "latent_shape": list(latents[0].shape), "command": _command(), "note": args.note})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
