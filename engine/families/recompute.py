"""Token-wise block parts in checkpointed token chunks: the tools a family uses to declare them.

With whole-block checkpointing, a block's backward first recomputes its whole forward, so every
intermediate of the block is alive at once (at 2048² one Flux.1 block needs ~4.8 GB). Parts that act on
each token alone (MLPs) can run over slices of the tokens, each slice under its own (nested,
non-reentrant) checkpoint, so only one slice's intermediates exist during the block's backward. A family
wires its token-wise parts with these tools in ``install_chunked_recompute``; the engine decides how many
chunks (``engine/offload/recompute.py``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint


@torch.compiler.disable  # nested checkpoints stay eager inside compiled blocks (engine/train/compile.py)
def run_in_token_chunks(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor, chunks: int,
                        dim: int = 1) -> torch.Tensor:
    """``fn(*tensors)`` for a token-wise ``fn``, as ``chunks`` checkpointed slices along ``dim``.

    Without autograd (an eval forward, or the forward half of a reentrant checkpoint) there is
    nothing to save, so it is one plain call."""
    outputs = token_chunk_outputs(fn, *tensors, chunks=chunks, dim=dim)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim)


@torch.compiler.disable  # nested checkpoints stay eager inside compiled blocks (engine/train/compile.py)
def token_chunk_outputs(fn: Callable[..., Any], *tensors: torch.Tensor, chunks: int, dim: int = 1) -> list[Any]:
    """``fn`` over ``chunks`` slices of ``tensors`` along ``dim``, each under its own checkpoint: one output (a tensor
    or a tuple of them) per slice, not concatenated, so a caller can keep a slice's outputs apart (Flux.2's single
    blocks: q/k/v are joined for attention, the MLP activation goes to the matching slice of the output part). One
    plain call (a one-element list) when there is nothing to save or too few tokens, as ``run_in_token_chunks``."""
    if chunks <= 1 or not torch.is_grad_enabled() or tensors[0].shape[dim] < 2 * chunks:
        return [fn(*tensors)]
    pieces = zip(*(t.chunk(chunks, dim) for t in tensors))
    return [checkpoint(fn, *p, use_reentrant=False) for p in pieces]


class ChunkedRecompute:
    """What ``install`` changed (instance-level forwards), and how to put it back."""

    def __init__(self) -> None:
        self._patched: list[torch.nn.Module] = []

    def set_forward(self, module: torch.nn.Module, forward: Callable) -> None:
        module.forward = forward  # an instance attribute shadows the class's forward
        self._patched.append(module)

    def remove(self) -> None:
        for m in self._patched:
            if "forward" in vars(m):
                del m.forward
        self._patched.clear()


def chunk_token_wise(module: torch.nn.Module, chunks: int, undo: ChunkedRecompute) -> None:
    """A module that maps each token on its own (a feed-forward): its forward runs in token chunks."""
    inner = module.forward

    def forward(hidden_states, *args, **kwargs):
        return run_in_token_chunks(lambda h: inner(h, *args, **kwargs), hidden_states, chunks=chunks)

    undo.set_forward(module, forward)
