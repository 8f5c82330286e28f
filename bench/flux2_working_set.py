"""Flux.2 blocks' recompute + backward working set on CPU: single blocks whole and in token chunks
(engine/families/flux2/parts.py ``single_block_forward_chunked``), double blocks per streaming part.

Why: the planner sizes a block's working set with Flux.1-fitted constants times the family's ``activation_scale``
(Flux.2: 1.37, fitted on a GPU row whose single blocks ran whole). With the single blocks in chunks the chunked plans
need their own factor (``MemoryProfile.chunked_activation_scale``); before a GPU row exists, this estimates it from
the tensors the code keeps alive: the most bytes of tensors alive at once during one block's forward with grad +
backward (``parts_working_set.LiveBytes``: every new storage counted until freed), in B*T*D bf16 units, on a bf16
model at klein 9B's proportions (head dim 128, mlp_ratio 3; 4 heads, so width 512 on a CPU) with peft LoRA r16 on the
default targets. CPU attention kernels may hold more than CUDA's flash kernels; the same attention runs whole and
chunked, so the ratio between them is what is used.

    PYTHONPATH=... python bench/flux2_working_set.py [--tokens 2048] [--chunks 1 2 3 4 8]
"""
from __future__ import annotations

import argparse

import torch

from parts_working_set import LiveBytes


def build(family_id: str, tokens: int, text: int, heads: int = 4):
    """A 1 double + 1 single block model of ``family_id`` at its full-size proportions (head dim 128; Flux.2:
    mlp_ratio 3, Flux.1: 4), bf16, LoRA r16 on the default targets; each block's captured inputs and the B*T*D bf16
    unit (image + text tokens)."""
    from lowvram_lora.engine.config import LoraSettings
    from lowvram_lora.engine.families import get_family
    from lowvram_lora.engine.families.tiny import randomize_zero_inits
    from lowvram_lora.engine.train.lora_attach import attach_lora

    family = get_family(family_id)
    rope = [32, 32, 32, 32] if family_id == "flux2" else [16, 56, 56]
    cfg = {**family.load_config(f"{family_id}-tiny"), "num_attention_heads": heads, "attention_head_dim": 128,
           "axes_dims_rope": rope, "num_layers": 1, "num_single_layers": 1}
    torch.manual_seed(0)
    model = family.transformer_class().from_config(cfg)
    randomize_zero_inits(model, 0)
    model.requires_grad_(False)
    attach_lora(model, family, LoraSettings(rank=16, alpha=16), 0)
    model.to(torch.bfloat16)
    side = int(tokens ** 0.5)
    g = torch.Generator().manual_seed(0)
    embeds = {"prompt_embeds": torch.randn(1, text, cfg["joint_attention_dim"], generator=g, dtype=torch.bfloat16)}
    if family_id == "flux1":  # 16-channel latents packed 2x2 into tokens
        latents = torch.randn(1, cfg["in_channels"] // 4, 2 * side, 2 * (tokens // side), generator=g,
                              dtype=torch.bfloat16)
        embeds["pooled_prompt_embeds"] = torch.randn(1, cfg["pooled_projection_dim"], generator=g, dtype=torch.bfloat16)
    else:
        latents = torch.randn(1, cfg["in_channels"], side, tokens // side, generator=g, dtype=torch.bfloat16)
    inputs = family.model_inputs(model, latents, embeds, torch.tensor([0.4]), 1.0)
    captured = {}

    def keep(name):
        def hook(module, args, kwargs):
            captured[name] = (args, kwargs)
        return hook

    handles = [model.transformer_blocks[0].register_forward_pre_hook(keep("double"), with_kwargs=True),
               model.single_transformer_blocks[0].register_forward_pre_hook(keep("single"), with_kwargs=True)]
    with torch.no_grad():
        model(**inputs)
    for h in handles:
        h.remove()
    return family, model, captured, (side * (tokens // side) + text) * heads * 128 * 2


def peak(fn, args, kwargs) -> int:
    """The most bytes alive at once in fn's forward with grad + backward (what a checkpoint's backward runs), from
    the inputs on (inputs themselves and weights excluded: they exist before)."""
    def grad_input(x):  # the hidden states (B, T, D) carry gradients; the modulation and RoPE tables do not
        return x.detach().requires_grad_(True) if isinstance(x, torch.Tensor) and x.dim() == 3 else x

    args = [grad_input(a) for a in args]
    kwargs = {k: grad_input(v) for k, v in kwargs.items()}
    live = LiveBytes()
    with live:
        out = fn(*args, **kwargs)
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor) and o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        del out, outs
    return live.peak


def main(argv=None) -> int:
    from lowvram_lora.engine.families.recompute import ChunkedRecompute

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", nargs="+", default=["flux2", "flux1"])
    p.add_argument("--tokens", type=int, default=2048, help="image tokens")
    p.add_argument("--text", type=int, default=128)
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    args = p.parse_args(argv)
    for family_id in args.family:
        family, model, captured, unit = build(family_id, args.tokens, args.text)
        single, double = model.single_transformer_blocks[0], model.transformer_blocks[0]
        whole_single = None
        for chunks in args.chunks:
            undo = ChunkedRecompute()
            if chunks > 1:
                family.memory.install_chunked_recompute(model, chunks, undo)
            s = peak(single, *captured["single"]) / unit
            whole_single = whole_single or s
            parts, (args_in, kwargs_in) = [], captured["double"]
            kwargs_in = {k: v for k, v in kwargs_in.items() if k != "joint_attention_kwargs"}
            parts.append(f"whole {peak(double, args_in, kwargs_in) / unit:5.2f}")
            for name, part in family.memory.block_parts(double):
                parts.append(f"{name} {peak(part, args_in, kwargs_in) / unit:5.2f}")
                with torch.no_grad():
                    out = part(*args_in, **kwargs_in)
                args_in, kwargs_in = (out if isinstance(out, tuple) else (out,)), {}
            undo.remove()
            print(f"{family_id} chunks {chunks}: single block {s:5.2f} units ({s / whole_single:.3f} of whole); "
                  f"double block {', '.join(parts)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
