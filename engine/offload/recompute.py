"""Finer recompute inside a block: the token-wise parts run in checkpointed token chunks.

With whole-block checkpointing, a block's backward first recomputes its whole forward, so
every intermediate of the block is alive at once: at 2048² one Flux.1 block needs ~4.8 GB
(bench/NOTES.md), more than everything else of a streamed run together. Most of it is the
MLP: a 4x-wide hidden state, its GELU, and in single blocks the 5x-wide concatenation that
feeds ``proj_out``. Those parts act on each token alone, so they can run over slices of
the tokens, each slice under its own (nested, non-reentrant) checkpoint: during the
block's backward only one slice's MLP intermediates exist at a time. Attention stays whole
(it mixes tokens, and PyTorch's flash/efficient kernels are already memory-lean).

The cost is one more forward of the chunked parts per step (they are recomputed inside
the block's recompute), about a tenth of a block's FLOPs for Flux.1.

A family says which parts are token-wise (``family.memory.install_chunked_recompute``, with the tools in
``engine/families/recompute.py``); this module installs them for a run.
"""
from __future__ import annotations

import torch

from ..errors import ConfigError
from ..families import ModelFamily
from ..families.recompute import ChunkedRecompute


def install_chunked_recompute(model: torch.nn.Module, family: ModelFamily, chunks: int) -> ChunkedRecompute:
    """How the family's blocks recompute while training: every block checkpointed
    (``family.memory.checkpoint_every_block``), and the token-wise block parts in ``chunks`` slices (1: whole)."""
    undo = ChunkedRecompute()
    family.memory.checkpoint_every_block(model, undo)
    if chunks > 1:
        if not family.memory.chunked_recompute:  # auto never plans chunks for such a family; an explicit setting can
            raise ConfigError(f"recompute_chunks={chunks}: {family.display_name} has no token-wise block parts to "
                              f"recompute in chunks; set recompute_chunks to 0 (auto) or 1")
        family.memory.install_chunked_recompute(model, chunks, undo)
    return undo
