"""Token-wise block parts in checkpointed token chunks: the tools a family uses to declare them.

With whole-block checkpointing, a block's backward first recomputes its whole forward, so every
intermediate of the block is alive at once (at 2048² one Flux.1 block needs ~4.8 GB). Parts that act on
each token alone (MLPs) can run over slices of the tokens, each slice under its own (nested,
non-reentrant) checkpoint, so only one slice's intermediates exist during the block's backward. A family
wires its token-wise parts with these tools in ``install_chunked_recompute``; the engine decides how many
chunks (``engine/offload/recompute.py``).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint


@torch.compiler.disable  # nested checkpoints stay eager inside compiled blocks (engine/train/compile.py)
def run_in_token_chunks(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor, chunks: int,
                        dim: int = 1) -> torch.Tensor:
    """``fn(*tensors)`` for a token-wise ``fn``, as ``chunks`` checkpointed slices along ``dim``.

    Without autograd (an eval forward, or the forward half of a reentrant checkpoint) there is
    nothing to save, so it is one plain call."""
    if chunks <= 1 or not torch.is_grad_enabled() or tensors[0].shape[dim] < 2 * chunks:
        return fn(*tensors)
    pieces = zip(*(t.chunk(chunks, dim) for t in tensors))
    return torch.cat([checkpoint(fn, *p, use_reentrant=False) for p in pieces], dim)


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
