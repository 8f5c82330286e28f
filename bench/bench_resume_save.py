"""Time the training loop spends in periodic resume saves (issue 26 §3): background (the state copied to host
memory at the step boundary, written on the writer thread) against the synchronous write it replaced.

The model is built as bench/train_bench.py builds it (random weights, shipped config, straight on the device)
with a synthetic dataset cache; training runs through ``train_lora`` with a ResumeStore saving every
``--save-every`` steps. What is timed is the loop's call of ``_save_state(periodic=True)``: everything the
training thread does for a periodic save (the wait for a save still in flight included). ``--sync`` writes
each state on the training thread instead (``ResumeStore.save``: what every save did before).

    source bench/gpu_env.sh
    python3 bench/bench_resume_save.py --variant flux1-dev --device cuda --res 512 --steps 60 --save-every 10
    python3 bench/bench_resume_save.py --variant flux1-dev --device cuda --res 512 --steps 60 --save-every 10 --sync

On a CPU dev machine::

    python bench/bench_resume_save.py --variant flux1-tiny --device cpu --res 64 --steps 40 --save-every 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_bench import StepRecorder, build_random_model, write_synthetic_cache  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="flux1-tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--res", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--sync", action="store_true", help="write each state on the training thread (the old way)")
    ap.add_argument("--workdir", default=None, help="where the cache and the states go (default: a temp folder)")
    args = ap.parse_args(argv)

    from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.models import resolve_dtype
    from lowvram_lora.engine.train import loop, train_lora
    from lowvram_lora.engine.train.resume import ResumeStore

    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench-resume-"))
    model, family, cfg = build_random_model(args.variant, device, dtype, std=0.02, seed=0)
    dataset = write_synthetic_cache(root / "cache", family, args.variant, cfg, args.res, 4, seed=0)
    store = ResumeStore(root / "resume", "bench", {}, save_every=args.save_every)
    if args.sync:
        store.save_in_background = lambda *state: store.save(*state) is not None

    seconds: list[float] = []
    real = loop._save_state

    def timed(run, periodic=False):
        t0 = time.perf_counter()
        try:
            return real(run, periodic)
        finally:
            if periodic:
                seconds.append(time.perf_counter() - t0)

    loop._save_state = timed
    rec = StepRecorder("sync" if args.sync else "background")
    t0 = time.perf_counter()
    result = train_lora(ModelConfig(dtype=args.dtype, family=family.id), dataset,
                        LoraSettings(rank=args.rank, alpha=float(args.rank)),
                        TrainConfig(steps=args.steps, device=args.device, learning_rate=1e-4,
                                    save_every=args.save_every),
                        rec.callback, preloaded=(model, family, args.variant), resume=store)
    wall = time.perf_counter() - t0
    loop._save_state = real
    state_bytes = 12 * sum(v.numel() for v in result.state_dict.values())  # fp32 weight + two fp32 moments
    steps = [s.seconds_per_step for s in rec.steps[1:]]
    row = {"mode": "sync" if args.sync else "background", "variant": args.variant, "device": str(device),
           "rank": args.rank, "state_mb": round(state_bytes / 1e6, 1), "saves": len(seconds),
           "save_in_loop_median_s": round(statistics.median(seconds), 4) if seconds else None,
           "save_in_loop_max_s": round(max(seconds), 4) if seconds else None,
           "save_share_of_run": round(sum(seconds) / wall, 4), "step_median_s": round(statistics.median(steps), 4),
           "wall_s": round(wall, 2)}
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
