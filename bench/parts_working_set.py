"""A Wan block's recompute + backward working set on CPU, whole and per part (engine/families/wan/parts.py).

Why: the planner sizes a block's working set with Flux.1-fitted constants times the family's
``activation_scale``; blocks streamed in parts need the largest part's share (``parts_activation_scale``). Before a
GPU row exists, this estimates that share two ways, in B*T*D bf16 units, on one bf16 block at the variant's FFN
width (head dim 128, 5 heads, 2048 tokens, 64 text tokens; LoRA stood in by trainable attention q/k/v/o weights):

- ``saved``: bytes autograd saves for the backward (storages counted once, weights and RoPE tables excluded);
- ``peak``: the most bytes of tensors alive at once during forward + backward (a dispatch mode that counts every
  new storage until it is freed). CPU kernels (attention's backward) may hold more than CUDA's flash kernels.

    PYTHONPATH=... python bench/parts_working_set.py [--tokens 2048] [--chunks 1 8]
"""
from __future__ import annotations

import argparse

import torch

FFN_RATIOS = {"wan2.1-t2v-14b / A14B": 13824 / 5120, "wan2.2-ti2v-5b": 14336 / 3072, "wan2.1-t2v-1.3b": 8960 / 1536}


def build(ffn_ratio: float, tokens: int, text: int = 64, heads: int = 5):
    from lowvram_lora.engine.families.wan import FAMILY

    dim = heads * 128
    cfg = {**FAMILY.load_config("wan-tiny"), "num_attention_heads": heads, "attention_head_dim": 128,
           "ffn_dim": int(dim * ffn_ratio), "num_layers": 1, "text_dim": dim}
    torch.manual_seed(0)
    model = FAMILY.transformer_class().from_config(cfg)
    keep = set(model._keep_in_fp32_modules)
    for name, p in model.named_parameters():
        if not keep & set(name.split(".")):
            p.data = p.data.to(torch.bfloat16)
    model.requires_grad_(False)
    block = model.blocks[0]
    for name, p in block.named_parameters():
        if name.startswith(("attn1.to_", "attn2.to_")) and name.endswith("weight"):
            p.requires_grad_(True)
    inputs = (torch.randn(1, tokens, dim, dtype=torch.bfloat16), torch.randn(1, text, dim, dtype=torch.bfloat16),
              torch.randn(1, 6, dim, dtype=torch.bfloat16),
              (torch.randn(1, tokens, 1, 128), torch.randn(1, tokens, 1, 128)))
    return model, block, inputs, tokens * dim * 2


def measure(fn, inputs, skip: set[int]) -> tuple[int, int]:
    """(saved, peak) bytes of fn(*inputs)'s forward with grad + backward (what a checkpoint's backward runs)."""
    inputs = [x.detach().requires_grad_(True) if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 else x
              for x in inputs]
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        saved[s.data_ptr()] = s.nbytes()
        return t

    from lowvram_lora.engine.testing import LiveBytes

    live = LiveBytes()
    with live, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor) and o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        del out, outs
    return sum(n for k, n in saved.items() if k not in skip), live.peak


def main(argv=None) -> int:
    from lowvram_lora.engine.families.recompute import ChunkedRecompute
    from lowvram_lora.engine.families.wan import FAMILY

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 8])
    args = p.parse_args(argv)
    for label, ratio in FFN_RATIOS.items():
        model, block, inputs, unit = build(ratio, args.tokens)
        skip = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(inputs[3])}
        for chunks in args.chunks:
            undo = ChunkedRecompute()
            if chunks > 1:
                FAMILY.memory.install_chunked_recompute(model, chunks, undo)
            whole = measure(block, inputs, skip)
            parts, x = [], inputs
            for _, part in FAMILY.memory.block_parts(block):
                parts.append(measure(part, x, skip))
                with torch.no_grad():
                    x = part(*x)
                x = x if isinstance(x, tuple) else (x,)
            undo.remove()
            for k, what in enumerate(("saved", "peak")):
                share = max(q[k] for q in parts) / whole[k]
                print(f"{label:22s} chunks {chunks:2d} {what:5s}: whole {whole[k] / unit:5.2f} units, parts "
                      f"{', '.join(f'{q[k] / unit:.2f}' for q in parts)}; largest / whole {share:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
