"""Diagnostic: a hand-written LoRA training step on the same random model, outside
``train_lora``, to tell engine overhead from the model's own cost.

Variants (``--variants``):
  engine-like   fp32 LoRA weights under bf16 autocast, grad-norm clip, AdamW: what train_lora does,
                minus its data path (cache reads, CPU noise) and per-step bookkeeping
  bf16-lora     LoRA weights in bf16, no autocast (everything bf16), same clip + AdamW
  fp32-nocast   as engine-like, but peft's input cast is switched off (cast_input_dtype_enabled=False):
                peft otherwise copies every LoRA layer's bf16 input to fp32 (to match the fp32 LoRA
                weight) and autocast copies it back to bf16 for the matmul, two passes over the
                activation per LoRA layer; with the cast off, autocast casts only the small weights

    python3 bench/diag_step.py --res 512 1024 --variants engine-like bf16-lora

Prints one line per (res, variant, targets) with the median step time and peak memory;
writes nothing to results.jsonl (these are not product numbers).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_bench import build_random_model  # noqa: E402


def run_variant(model, family, variant: str, targets: str, res: int, warmup: int, timed: int, device) -> dict:
    from lowvram_lora.engine.config import LoraSettings
    from lowvram_lora.engine.attention import training_attention
    from lowvram_lora.engine.train.lora_attach import attach_lora, detach_lora

    names = None
    if targets == "attention":
        names = [n for n in family.lora.target_modules(model) if ".attn." in n]
    model.enable_gradient_checkpointing()
    params = attach_lora(model, family, LoraSettings(rank=16, alpha=16.0, target_modules=names), seed=0)
    if variant == "bf16-lora":
        for p in params:
            p.data = p.data.to(torch.bfloat16)
        autocast = contextlib.nullcontext()
    else:
        if variant == "fp32-nocast":
            from peft.tuners.tuners_utils import BaseTunerLayer

            for m in model.modules():
                if isinstance(m, BaseTunerLayer):
                    m.cast_input_dtype_enabled = False
        autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator(device=device).manual_seed(0)
    cfg, dt = model.config, torch.bfloat16
    lat = torch.randn(1, cfg.in_channels // 4, res // 8, res // 8, device=device, generator=g, dtype=dt)
    embeds = {"prompt_embeds": torch.randn(1, 512, cfg.joint_attention_dim, device=device, generator=g, dtype=dt),
              "pooled_prompt_embeds": torch.randn(1, cfg.pooled_projection_dim, device=device, generator=g,
                                                  dtype=dt)}
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    model.train()
    with training_attention(device):
        for _ in range(warmup + timed):
            sync()
            t0 = time.perf_counter()
            sig = torch.rand(1, device=device, generator=g).clamp(0.05, 0.95)
            noise = torch.randn(lat.shape, device=device, generator=g, dtype=lat.dtype)
            s = sig.view(-1, 1, 1, 1).to(lat.dtype)
            noisy, target = (1 - s) * lat + s * noise, noise - lat
            with autocast:
                pred = model(**family.model_inputs(model, noisy, embeds, sig, 1.0))[0]
            loss = torch.nn.functional.mse_loss(family.unpack_prediction(pred, lat).float(), target.float())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - t0)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"loss {loss.item()}")
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if cuda else 0.0
    n_lora = sum(p.numel() for p in params)
    detach_lora(model)
    model.disable_gradient_checkpointing()
    model.eval()
    del opt, params
    if cuda:
        torch.cuda.empty_cache()
    return {"step_s": statistics.median(times[warmup:]), "times": [round(t, 3) for t in times],
            "peak_gb": peak, "lora_params": n_lora}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--res", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--variants", nargs="+", default=["engine-like", "bf16-lora"],
                   choices=["engine-like", "bf16-lora", "fp32-nocast"])
    p.add_argument("--targets", nargs="+", default=["default"], choices=["default", "attention"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timed", type=int, default=5)
    p.add_argument("--model", default="flux1-dev", help="shipped config (flux1-tiny to check on CPU)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    model, family, _ = build_random_model(args.model, device, torch.bfloat16, 0.02, 0)
    lines = []
    for res in args.res:
        for targets in args.targets:
            for variant in args.variants:
                r = run_variant(model, family, variant, targets, res, args.warmup, args.timed, device)
                line = (f"diag {res:>5} {variant:<12} targets={targets:<9} {r['step_s']:.3f} s/step "
                        f"peak {r['peak_gb']:.2f} GB lora {r['lora_params'] / 1e6:.1f}M  steps {r['times']}")
                print(line, flush=True)
                lines.append(line)
    print("\n".join(["", "diag summary:"] + lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
