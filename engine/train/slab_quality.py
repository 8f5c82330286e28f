"""The slab quality gate (issue 37): does a LoRA trained on a quantized base still work on the full-precision one?

    row = lora_recovery("tiny-pipeline/", bits=4, workdir=tmp)   # -> QualityRow

For a checkpoint (any form the one checkpoint reader takes), on the CPU in fp32:

1. the full-precision base as the reader loads it, and its slab (``build_slab(..., bits)``, loaded as a slab is);
2. forward error: ``|quantized(x) - full(x)| / |full(x)|`` of the whole transformer on fixed inputs;
3. the same LoRA (same init seed) trained twice, on the full base and on the quantized base: same data (a few fixed
   latents and text embeddings), same noise and timesteps (one generator seed), same steps and AdamW settings;
4. both LoRAs applied to the FULL base; the flow loss on fixed noise and timesteps of the same latents, against the
   base without a LoRA: ``recovery = (L_base - L_quantized_lora) / (L_base - L_full_lora)``.

The gate: int4 >= 0.90, int8 >= 0.97 (``RECOVERY_GATE``). tests/test_slab_int4.py runs it on every family's tiny
model; docs/int4.md has the table, the demo's pretrained model included
(``python -m lowvram_lora.engine.train.slab_quality CHECKPOINT...`` prints it).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

#: bits -> the smallest share of the full-precision LoRA's loss reduction a LoRA trained on that slab must keep.
RECOVERY_GATE = {8: 0.97, 4: 0.90}


@dataclass
class QualityRow:
    family: str
    variant: str
    bits: int
    weight_rel_error: float  # mean over the quantized Linears (manifest)
    forward_rel_error: float
    loss_base: float
    loss_full_lora: float
    loss_quantized_lora: float
    recovery: float
    steps: int

    def as_dict(self) -> dict:
        return asdict(self)


def synthetic_batch(model, family, count: int, seed: int, width: int = 32, height: int = 32, length: int = 8):
    """``count`` fixed (latents, text embeddings) pairs for ``model``: every cached embedding the family takes
    (``text_widths``), variable-length ones with a mask that leaves 2 tokens out."""
    from ..caching.encoders import encoder_kind

    g = torch.Generator().manual_seed(seed)
    config = dict(model.config)
    variant = family.variant_for_config(config)
    specs = {s.cache_key: s for s in family.text_encoder_specs(family.tiny_variant if variant == "custom" else variant)}
    items = []
    for _ in range(count):
        latents = torch.randn(1, *family.latent_shape(model, width, height), generator=g)
        embeds = {}
        for key, w in family.text_widths(config).items():
            if encoder_kind(specs[key].kind).output == "pooled":
                embeds[key] = torch.randn(1, w, generator=g)
                continue
            embeds[key] = torch.randn(1, length, w, generator=g)
            if specs[key].length == "variable":
                embeds[specs[key].mask_key] = torch.tensor([[1] * (length - 2) + [0, 0]])
        items.append((latents, embeds))
    return items


def _flow_loss(model, family, item, noise, sigma) -> torch.Tensor:
    from ..families import predict_velocity
    from .flow_matching import noisy_latents_and_target

    latents, embeds = item
    noisy, target = noisy_latents_and_target(latents, noise, sigma)
    return torch.nn.functional.mse_loss(predict_velocity(family, model, noisy, embeds, sigma, 1.0), target)


def _draws(items, count: int, seed: int):
    """(item index, noise, sigma) ``count`` times from one generator: the same for every model."""
    from .flow_matching import sample_sigmas

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        latents = items[i % len(items)][0]
        out.append((i % len(items), torch.randn(latents.shape, generator=g), sample_sigmas(1, g)))
    return out


def _train_lora(model, family, items, draws, rank: int, lr: float, seed: int) -> dict[str, torch.Tensor]:
    from ..config import LoraSettings
    from .lora_attach import attach_lora, detach_lora

    params = attach_lora(model, family, LoraSettings(rank=rank, alpha=rank), seed=seed)
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    try:
        for index, noise, sigma in draws:
            _flow_loss(model, family, items[index], noise, sigma).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return {names[id(p)]: p.detach().clone() for p in params}
    finally:
        detach_lora(model)
        model.eval()


def _eval_loss(model, family, items, draws, lora: dict | None, rank: int, seed: int) -> float:
    from ..config import LoraSettings
    from .lora_attach import attach_lora, detach_lora

    if lora is not None:
        attach_lora(model, family, LoraSettings(rank=rank, alpha=rank), seed=seed)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in lora.items():
                params[name].copy_(value)
    try:
        with torch.no_grad():
            return sum(_flow_loss(model, family, items[i], n, s).item() for i, n, s in draws) / len(draws)
    finally:
        if lora is not None:
            detach_lora(model)


def _forward_error(full, quant, family, items, draws) -> float:
    from ..families import predict_velocity
    from .flow_matching import noisy_latents_and_target

    num = den = 0.0
    with torch.no_grad():
        for i, noise, sigma in draws:
            latents, embeds = items[i]
            noisy, _ = noisy_latents_and_target(latents, noise, sigma)
            a = predict_velocity(family, full, noisy, embeds, sigma, 1.0)
            b = predict_velocity(family, quant, noisy, embeds, sigma, 1.0)
            num += float((b - a).norm()) ** 2
            den += float(a.norm()) ** 2
    return (num / den) ** 0.5


def lora_recovery(checkpoint: str | Path, workdir: str | Path, bits=(4, 8), family_id: str = "auto",
                  steps: int = 40, rank: int = 4, lr: float = 3e-3, seed: int = 0, samples: int = 2,
                  eval_draws: int = 16) -> list[QualityRow]:
    """One ``QualityRow`` per entry of ``bits`` (the full-precision LoRA is trained once and shared)."""
    with _one_thread():
        return _lora_recovery(checkpoint, workdir, bits, family_id, steps, rank, lr, seed, samples, eval_draws)


class _one_thread:
    """torch on one CPU thread for the duration, then as it was. Why: these models are a few hundred kB; their ops
    are far too small to split, and on a shared machine every op's thread handoff waits for busy cores (z-image-tiny:
    471 s with the default threads on 2 loaded cores, 32 s on one)."""

    def __enter__(self):
        self.before = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


def _lora_recovery(checkpoint, workdir, bits, family_id, steps, rank, lr, seed, samples, eval_draws):
    from ..models import load_transformer
    from ..slab.build import build_slab
    from ..slab.load import load_slab_transformer

    full, family, _, variant = load_transformer(checkpoint, family_id, dtype=torch.float32)
    full.requires_grad_(False).eval()
    items = synthetic_batch(full, family, samples, seed)
    train_draws, eval_set = _draws(items, steps, seed + 1), _draws(items, eval_draws, seed + 2)
    full_lora = _train_lora(full, family, items, train_draws, rank, lr, seed)
    loss_base = _eval_loss(full, family, items, eval_set, None, rank, seed)
    loss_full = _eval_loss(full, family, items, eval_set, full_lora, rank, seed)
    rows = []
    for b in bits:
        slab = build_slab(checkpoint, Path(workdir) / f"quality-int{b}.slab.safetensors", family=family.id,
                          progress=False, overwrite=True, bits=b)
        quant, _, _ = load_slab_transformer(slab, torch.float32, verify="quick")
        quant.requires_grad_(False).eval()
        from ..slab.load import read_manifest

        weight_error = read_manifest(slab)["summary"]["mean_rel_error"]
        forward = _forward_error(full, quant, family, items, eval_set)
        lora = _train_lora(quant, family, items, train_draws, rank, lr, seed)
        loss_q = _eval_loss(full, family, items, eval_set, lora, rank, seed)
        recovery = (loss_base - loss_q) / (loss_base - loss_full) if loss_base > loss_full else float("nan")
        rows.append(QualityRow(family.id, variant, b, weight_error, forward, loss_base, loss_full, loss_q, recovery,
                               steps))
    return rows


def markdown_table(rows: list[QualityRow]) -> str:
    lines = ["| model | bits | weight error | forward error | flow loss: base | + bf16-trained LoRA | "
             "+ slab-trained LoRA | recovery | gate |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gate = RECOVERY_GATE[r.bits]
        lines.append(f"| {r.variant} | int{r.bits} | {r.weight_rel_error:.2%} | {r.forward_rel_error:.2%} | "
                     f"{r.loss_base:.4f} | {r.loss_full_lora:.4f} | {r.loss_quantized_lora:.4f} | "
                     f"{r.recovery:.1%} | {'pass' if r.recovery >= gate else 'FAIL'} (>= {gate:.0%}) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """``python -m lowvram_lora.engine.train.slab_quality CHECKPOINT...``: the table docs/int4.md shows."""
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description="LoRA recovery of int4 and int8 slabs against the full base")
    parser.add_argument("checkpoints", nargs="+", help="checkpoints (any form the checkpoint reader takes)")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="slab-quality-") as tmp:
        for path in args.checkpoints:
            rows += lora_recovery(path, tmp, steps=args.steps)
            print(markdown_table(rows[-2:]).splitlines()[-2:], flush=True)
    print(markdown_table(rows))
    return 0 if all(r.recovery >= RECOVERY_GATE[r.bits] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
