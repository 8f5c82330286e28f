"""Sampling during training (issue 14; issue 26 item 4: each streamed block once per denoising step for all
prompts): Flux.1-dev random weights, the sample prompts sampled at checkpoints inside training; seconds per sample
image and the peak VRAM while sampling against the training peak of the same plan, beside sampling the same model
all-resident (the baseline of the same run).

Modes (``--modes``, in order; list the resident ones first):

- ``resident``: bf16, every weight on the GPU, the prompts sampled one at a time (the sampler before batching);
- ``resident-batched``: the same, every prompt in one forward per denoising step;
- ``resident[-batched]-lora[-compiled]``: with the rank-16 LoRA a resident training run samples with (its GEMMs, adds
  and casts are in every streamed mode's sampling too, whose model trains that LoRA); ``-compiled``: blocks compiled;
- ``stream-k<K>[-act]``: blocks streamed (prefetch K, activation offload) while training a few steps with samples
  at step 0 and at the end; the sampler batches as many prompts per forward as the plan allows
  (engine/sampling.rows_per_forward, logged);
- ``stream-k<K>[-act]-rows1``: the same with one prompt per forward (the old per-prompt path), for comparison;
- ``auto-<GB>``: ``auto`` at that budget, as the shipped workflows train.

``--precision int8`` converts the blocks to int8 slab layers before the first streamed mode (bench_flux2).
``x_resident_sampling``: s/image over the fastest resident mode of the run, or over ``--baseline``.

No files: the transformer and a full-size Flux.1 VAE (the shipped config) are random, built on the GPU;
the sample prompts' embeddings are random tensors in the cache layout.

    source bench/gpu_env.sh
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/bench_sampling.py --res 1024 --prompts 4 \\
        --sample-steps 20 --precision int8 --modes resident resident-batched stream-k2-act stream-k2-act-rows1 \\
        --out "$OUT/results.jsonl"

``--profile-dir D`` also records each mode's last ``sample_prompts`` call with torch.profiler (one profiler step
per denoising step: 3 skipped, 1 recorded and dropped, ``--profile-steps`` analysed by bench/profile_analysis.py)
and the streamer's counters over that call (copies, prefetch misses, resyncs, copy-engine busy and compute-stall
seconds): ``D/sampling_<mode>.json`` and ``D/sampling_summary.md`` (each mode, then each minus the first).

``--tiny`` runs the same on the CPU with the tiny model, every mode resident (streaming needs CUDA): a check of
this script.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_bench import (  # noqa: E402
    StepRecorder, _command, _gpu_name, _versions, build_random_model, row_emitter, training_row,
    write_synthetic_cache, new_run_id,
)
from lowvram_lora.engine.families import default_max_sequence_length  # noqa: E402


RESIDENT = re.compile(r"^resident(-batched)?(-lora)?(-compiled)?$")
STREAM = re.compile(r"^stream-k(\d)(-act)?(-rows1)?(-compiled)?$")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--res", type=int, default=1024)
    p.add_argument("--modes", nargs="+", default=["resident", "resident-batched", "stream-k2-act",
                                                  "stream-k2-act-rows1"])
    p.add_argument("--precision", default="bf16", choices=["bf16", "int8"])
    p.add_argument("--steps", type=int, default=2, help="training steps of a streamed mode (samples at 0 and the end)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--sample-steps", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="the tiny model on the CPU, fp32, every mode resident")
    p.add_argument("--out", default="bench/results.jsonl")
    p.add_argument("--baseline", default="", help="the resident mode x_resident_sampling divides by (default: the "
                   "fastest resident mode of the run)")
    p.add_argument("--profile-dir", default="", help="profile each mode's last sampling call into this folder")
    p.add_argument("--profile-steps", type=int, default=3, help="denoising steps analysed per profiled call")
    return p.parse_args(argv)


class SamplingProfiler:
    """Wraps ``engine.sampling.sample_prompts`` (the bench's resident calls and the training loop's Sampler both
    look it up there): each call runs under torch.profiler with one profiler step per denoising step (the sampler's
    ``poll``), and the streamer's counters are read around it. Each mode keeps its last call."""

    def __init__(self, out_dir: Path, steps: int, cuda: bool):
        self.out_dir, self.steps, self.cuda = out_dir, steps, cuda
        self.handle = None  # the streamed mode's OffloadHandle (captured from apply_offload)
        self.last: dict | None = None
        self.rows: list[tuple[str, dict]] = []

    def install(self):
        from lowvram_lora.engine import sampling as sampling_mod
        from lowvram_lora.engine.offload import streamer

        real_sample, real_apply = sampling_mod.sample_prompts, streamer.apply_offload

        def apply_offload(*a, **k):
            self.handle = real_apply(*a, **k)
            return self.handle

        def sample_prompts(*a, **k):
            return self.record(real_sample, a, k)

        sampling_mod.sample_prompts, streamer.apply_offload = sample_prompts, apply_offload
        return lambda: (setattr(sampling_mod, "sample_prompts", real_sample),
                        setattr(streamer, "apply_offload", real_apply))

    def _counters(self) -> dict:
        h = self.handle
        if h is None or h.scheduler is None or getattr(h, "_removed", False):
            return {}
        out = h.scheduler.stats.as_dict()
        eng = h.engine
        out["copy_events"], out["stall_events"] = len(getattr(eng, "_copy_events", [])), len(getattr(eng, "_stall_events", []))
        return out

    def record(self, real, a, k):
        from torch.profiler import ProfilerActivity, profile, schedule

        from profile_analysis import analyze, kineto_events

        results = []
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        prof = profile(activities=activities, schedule=schedule(wait=3, warmup=1, active=1 + self.steps, repeat=1),
                       on_trace_ready=lambda p: results.append(p.profiler.kineto_results),
                       record_shapes=False, with_stack=False, profile_memory=False)
        bound = inspect.signature(real).bind(*a, **k)
        poll = bound.arguments.get("poll")

        def stepping():
            if poll is not None:
                poll()
            prof.step()

        bound.arguments["poll"] = stepping
        a, k = bound.args, bound.kwargs
        if self.cuda:
            torch.cuda.synchronize()
        before = self._counters()
        t0 = time.perf_counter()
        prof.start()
        try:
            return real(*a, **k)
        finally:
            prof.stop()
            if self.cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            after = self._counters()
            row = {"sample_prompts_s": round(seconds, 3), "max_rows": k.get("max_rows"), "prompts": len(a[2]),
                   "counters": {key: after[key] - before.get(key, 0) for key in after
                                if key not in ("copy_events", "stall_events")}}
            eng = self.handle.engine if self.handle is not None and after else None
            if eng is not None and self.cuda and after["stall_events"] >= before.get("stall_events", 0):
                new_copy = eng._copy_events[before.get("copy_events", 0):]
                new_stall = eng._stall_events[before.get("stall_events", 0):]
                row["copy_busy_s"] = round(sum(x.elapsed_time(y) for x, y in new_copy) / 1e3, 3)
                row["compute_stall_s"] = round(sum(x.elapsed_time(y) for x, y in new_stall) / 1e3, 3)
            try:
                row["summary"] = analyze(kineto_events(results[-1]), steps=self.steps) if results else None
            except Exception as exc:  # noqa: BLE001 - the timing still counts
                row["summary"], row["error"] = None, f"{type(exc).__name__}: {exc}"
            self.last = row

    def end_mode(self, mode: str) -> None:
        """Keep the mode's last call; write its JSON and the summary of every mode so far."""
        from profile_analysis import diff_markdown, mode_markdown

        if self.last is None:
            return
        row, self.last, self.handle = self.last, None, None
        self.rows.append((mode, row))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"sampling_{mode}.json").write_text(json.dumps(row, indent=1, default=str))
        parts = ["# Sampling profile: one profiler step = one denoising step (every forward of it)", ""]
        for m, r in self.rows:
            parts += [f"- {m}: sample_prompts {r['sample_prompts_s']} s for {r['prompts']} prompts, max_rows "
                      f"{r['max_rows']}, streamer {r['counters']}, copy busy {r.get('copy_busy_s')} s, compute "
                      f"stall {r.get('compute_stall_s')} s"]
        parts.append("")
        for m, r in self.rows:
            if r.get("summary"):
                parts.append(mode_markdown(m, r["summary"], {}))
        base = next(((m, r) for m, r in self.rows if r.get("summary")), None)
        for m, r in self.rows:
            if base and r.get("summary") and m != base[0]:
                parts.append(diff_markdown(base[0], base[1]["summary"], m, r["summary"]))
        (self.out_dir / "sampling_summary.md").write_text("\n".join(parts))


def random_vae(device, dtype, latent_channels: int, tiny: bool):
    from diffusers import AutoencoderKL

    from lowvram_lora.engine.families import shared_config

    cfg = shared_config("vae", "flux1", "config.json")
    if tiny:  # the tiny transformer's latent width, small blocks (engine/testing.py's tiny pipeline VAE)
        cfg.update(block_out_channels=[8, 16, 16, 16], layers_per_block=1, norm_num_groups=8)
    cfg["latent_channels"] = latent_channels
    vae = AutoencoderKL.from_config(cfg).to(device, dtype)
    return vae.requires_grad_(False).eval()


def offload_for(mode: str):
    from lowvram_lora.engine.offload import OffloadConfig

    m = STREAM.match(mode)
    if m:
        return OffloadConfig(mode="stream", prefetch_depth=int(m[1]), activation_offload=bool(m[2]),
                             compile="blocks" if m[4] else "off")
    m = re.match(r"^auto-([0-9.]+)(-compiled)?$", mode)
    if m:
        return OffloadConfig(mode="auto", vram_budget_gb=float(m[1]), compile="blocks" if m[2] else "off")
    raise SystemExit(f"unknown mode {mode!r}")


def main(argv=None) -> int:
    from safetensors.torch import save_file

    from lowvram_lora.engine import sampling as sampling_mod
    from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.sampling import SamplingConfig, decode_latents, sample_latents
    from lowvram_lora.engine.train import train_lora

    args = parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    cuda = device.type == "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    variant = "flux1-tiny" if args.tiny else "flux1-dev"
    res = 64 if args.tiny else args.res
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    run_id = new_run_id()
    emit = row_emitter(out, {"run_id": run_id, "gpu": _gpu_name(device), **_versions(), "model": variant,
                             "lora_rank": 16, "batch": 1, "res": res, "prompts": args.prompts,
                             "command": _command(), "bench": "sampling"})
    model, family, cfg = build_random_model(variant, device, dtype, 0.02, 0)
    tmp = tempfile.TemporaryDirectory(prefix="sampling-bench-")
    dataset = write_synthetic_cache(Path(tmp.name), family, variant, cfg, res, 2, 0)
    gen = torch.Generator().manual_seed(1)
    prompts = []
    for i in range(args.prompts):
        key = f"sample-prompt-{i}"
        save_file({"prompt_embeds": torch.randn(default_max_sequence_length(family, variant), cfg["joint_attention_dim"],
                                                generator=gen).to(torch.bfloat16),
                   "pooled_prompt_embeds": torch.randn(cfg["pooled_projection_dim"], generator=gen).to(torch.bfloat16)},
                  str(Path(tmp.name) / "text" / f"{key}.safetensors"))
        prompts.append((f"random prompt {i}", key))
    vae = random_vae("cpu", dtype, cfg["in_channels"] // 4, args.tiny)
    dataset = dataclasses.replace(dataset, sample_prompts=prompts)
    object.__setattr__(dataset, "load_vae", lambda family, dtype: vae)  # the random VAE stands in for a file
    embeds = [dataset.load_text(key) for _, key in prompts]
    autocast = torch.autocast("cuda", dtype=dtype) if cuda else None
    resident_best, on_gpu, precision, results = None, True, "bf16", []
    rows_of_plan = sampling_mod.rows_per_forward
    profiler = SamplingProfiler(Path(args.profile_dir), args.profile_steps, cuda) if args.profile_dir else None
    uninstall = profiler.install() if profiler else (lambda: None)
    sample_prompts = lambda *a, **k: sampling_mod.sample_prompts(*a, **k)  # noqa: E731 - profiled when asked

    for mode in args.modes:
        if mode.startswith("resident"):
            if not on_gpu:
                raise SystemExit("list the resident modes before the streamed ones")
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            if not RESIDENT.match(mode):
                raise SystemExit(f"unknown mode {mode!r}")
            with_lora, compiled_resident = "-lora" in mode, mode.endswith("-compiled")
            if with_lora:  # the LoRA a resident training run samples with (rank 16, fp32, as train_lora attaches it)
                from lowvram_lora.engine.config import LoraSettings as _Lora
                from lowvram_lora.engine.train.lora_attach import attach_lora, detach_lora, skip_lora_input_cast

                attach_lora(model, family, _Lora(rank=16, alpha=16.0), seed=0)
                if cuda:
                    skip_lora_input_cast(model)  # as the loop does under autocast
            if compiled_resident:  # compiled blocks, as a run of 200+ steps has them
                from lowvram_lora.engine.train.compile import compile_blocks

                compiled_handle = compile_blocks(model, family, 1.0, backend=None if cuda else "aot_eager")
                with torch.no_grad():  # the first pass compiles the no-grad graphs: not timed
                    sample_prompts(model, family, embeds, res, res, args.sample_steps, 0, 3.5, device, dtype, autocast)
                if cuda:
                    torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                if "-batched" not in mode:
                    latents = [sample_latents(model, family, e, res, res, args.sample_steps, 0, 3.5, device, dtype,
                                              autocast) for e in embeds]
                else:
                    latents = sample_prompts(model, family, embeds, res, res, args.sample_steps, 0, 3.5, device, dtype,
                                             autocast)
            decode_latents(vae, family, latents, device)
            if cuda:
                torch.cuda.synchronize()
            per_image = (time.perf_counter() - t) / len(prompts)
            if args.baseline == mode or (not args.baseline and per_image < (resident_best or per_image + 1)):
                resident_best = per_image
            if compiled_resident:
                compiled_handle.remove()  # the streamed modes compile (or not) on their own
            if with_lora:
                detach_lora(model)  # train_lora attaches its own
            peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0
            if profiler:
                profiler.end_mode(mode)
            results.append(emit({"mode": f"sampling-{mode}", "precision": "bf16" if cuda else "fp32", "seconds_per_image": round(per_image, 3),
                                 "sample_steps": args.sample_steps, "peak_alloc_gb": round(peak, 3),
                                 "note": "all weights on the GPU" + (", with a rank-16 LoRA" if with_lora else "")
                                         + "; with the tiled VAE decode (VAE moved to the GPU for it)"}))
            continue
        offload = offload_for(mode) if cuda else None  # the CPU check trains resident (streaming needs CUDA)
        if on_gpu and cuda:
            from bench_flux2 import to_streamed_form

            to_streamed_form(model, family, args.precision, device)
            precision = args.precision
        on_gpu = False
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        rows_logged = []

        def rows_per_forward(*a, **k):  # what the loop's bound chose (or 1 for the -rows1 comparison)
            rows = 1 if mode.endswith("-rows1") else rows_of_plan(*a, **k)
            rows_logged.append(rows)
            return rows

        rec = StepRecorder(mode)
        compiled = mode.endswith("-compiled")
        runs: list[float] = []  # each checkpoint's sampling, timed (compiled: only the last counts, the first compiles)
        real_run = sampling_mod.Sampler.run

        def timed_run(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return real_run(self, *a, **k)
            finally:
                runs.append(time.perf_counter() - t0)

        sampling_mod.Sampler.run = timed_run
        t = time.perf_counter()
        sampling_mod.rows_per_forward = rows_per_forward
        try:
            result = train_lora(ModelConfig(dtype="bf16" if cuda else "fp32", family="flux1"), dataset,
                                LoraSettings(rank=16, alpha=16.0),
                                TrainConfig(steps=args.steps, device=str(device), learning_rate=1e-4), rec.callback,
                                preloaded=(model, family, variant), offload=offload,
                                sampling=SamplingConfig(every=1 if compiled else args.steps, steps=args.sample_steps,
                                                        resolution=res, seed=0, at_start=not compiled),
                                sample_dir=Path(tmp.name) / "samples" / mode)
        finally:
            sampling_mod.rows_per_forward = rows_of_plan
            sampling_mod.Sampler.run = real_run
        row = training_row(rec, 1, t, None, None, device)
        if profiler:
            profiler.end_mode(mode)
        info = result.settings.get("sampling", {})
        train_peak = max((s.peak_vram_gb for s in rec.steps), default=0.0)
        per_image = info["seconds"] / max(info["images"], 1)
        if compiled and runs:  # the last checkpoint's sampling: compiled graphs warm
            per_image = runs[-1] / len(prompts)
        plan = result.settings.get("offload_plan") or {}
        results.append(emit({
            "mode": f"{mode}+sampling", "precision": precision if cuda else "fp32", "step_s": row["step_s"],
            "train_peak_alloc_gb": round(train_peak, 3), "predicted_peak_gb": plan.get("predicted_peak_gb"),
            "sample_peak_alloc_gb": info.get("peak_vram_gb"), "sample_images": info.get("images"),
            "sample_seconds": info.get("seconds"), "seconds_per_image": round(per_image, 3),
            "x_resident_sampling": round(per_image / resident_best, 3) if resident_best else None,
            "rows_per_forward": rows_logged[0] if rows_logged else None, "sample_steps": args.sample_steps,
            "every": 1 if compiled else args.steps, "steps": args.steps, "plan": plan,
            "note": "seconds per image include the tiled VAE decode on the GPU; samples at step 0 and the last"}))
    print("\nmode                          s/image   x resident   rows   sample peak   train peak   predicted")
    for r in results:
        print(f"{r['mode']:28s} {r['seconds_per_image']:8.2f} {r.get('x_resident_sampling') or float('nan'):12.3f} "
              f"{str(r.get('rows_per_forward', '')):>6s} {r.get('sample_peak_alloc_gb', r.get('peak_alloc_gb')) or 0:13.2f} "
              f"{r.get('train_peak_alloc_gb') or 0:12.2f} {r.get('predicted_peak_gb') or 0:11.2f}")
    uninstall()
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
