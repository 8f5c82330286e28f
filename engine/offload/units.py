"""Streaming units smaller than a block: a large block streams and recomputes as parts.

Why: with one block of lookahead, the ring holds the running block and the next one. Flux.1's
double blocks are 0.68 GB in bf16 (Flux.2's 1.96 GB), so while they run the ring alone is
1.36 GB (3.9 GB), a third of a 4 GB budget. A family may cut such a block into parts that run
one after the other (attention, then feed-forward): each part is streamed, checkpointed and
recomputed on its own, so during a part's backward only that part's weights and the next
part's are on the GPU, and only that part's activations exist.

How: each part is a small ``nn.Module`` holding references to some of the block's
submodules (it is not registered in the model, so names, state dicts and LoRA targets are
unchanged) with a forward whose outputs are the next part's positional inputs; the last
part returns what the block returns. The block's own forward is replaced by one that runs the
parts in turn, each through the model's checkpoint function (the activation offloader's), which
passes the whole block through uncheckpointed. The parts are made once per block and kept on it,
so a later run reuses their pinned host buffers.

This only works where each part is checkpointed on its own, so parts are used with activation
offload only (engine/offload/streamer.py). A family opts in with ``block_parts(block)``.
"""
from __future__ import annotations

import inspect
from typing import Callable, Optional

import torch
from torch import nn

_PARTS = "_lowvram_parts"  # attribute of a split block: its parts, [(name, module)]
_UNITS = "_lowvram_stream_units"  # attribute of the model while installed: [(name, module)], in run order


def parts_of(family, block: nn.Module) -> Optional[list[tuple[str, nn.Module]]]:
    """The block's parts (made once and kept on the block), or None when the family streams it whole."""
    parts = block.__dict__.get(_PARTS)
    if parts is None:
        parts = family.memory.block_parts(block)
        if parts is None:
            return None
        _check_partition(block, parts)
        block.__dict__[_PARTS] = parts  # not a submodule: the model's module tree stays as it is
    return parts


def _check_partition(block: nn.Module, parts: list[tuple[str, nn.Module]]) -> None:
    """Every parameter and buffer of the block is in exactly one part (else a weight would not stream)."""
    def tensors(m: nn.Module) -> list[int]:
        return [id(t) for t in list(m.parameters()) + list(m.buffers())]

    seen: list[int] = []
    for _, part in parts:
        seen += tensors(part)
    if sorted(seen) != sorted(tensors(block)) or len(set(seen)) != len(seen):
        raise RuntimeError(f"{type(block).__name__}: its parts do not hold each of its tensors exactly once")


def unit_bytes(family, block: nn.Module, frozen_bytes: Callable[[nn.Module], int]) -> Optional[list[int]]:
    """Frozen bytes of each part of ``block``, or None when it streams whole (the planner's input)."""
    parts = parts_of(family, block)
    return None if parts is None else [frozen_bytes(p) for _, p in parts]


def installed_units(model: nn.Module) -> Optional[list[tuple[str, nn.Module]]]:
    return model.__dict__.get(_UNITS)


class StreamUnits:
    """The units of an installed split, in run order, and how to undo it."""

    def __init__(self, model: nn.Module, units: list[tuple[str, nn.Module]], groups: list[list[int]],
                 split: list[nn.Module]):
        self.model, self.units, self.split = model, units, split
        self.groups = groups  # per block (in the order given): the indexes of its units

    def remove(self) -> None:
        for block in self.split:
            if "forward" in vars(block):
                del block.forward
        self.model.__dict__.pop(_UNITS, None)
        self.split = []


def install_units(model: nn.Module, family, blocks: list[tuple[str, nn.Module]],
                  only: Optional[set] = None) -> StreamUnits:
    """Split every block of ``blocks`` the family cuts into parts (``only``: just the blocks of these indexes, those
    whose activations are offloaded; the rest run whole); returns the units in run order."""
    units, groups, split = [], [], []
    for i, (name, block) in enumerate(blocks):
        parts = parts_of(family, block) if only is None or i in only else None
        if parts is None:
            groups.append([len(units)])
            units.append((name, block))
            continue
        groups.append(list(range(len(units), len(units) + len(parts))))
        units += [(f"{name}.{p}", m) for p, m in parts]
        block.forward = _chained_forward(model, block, [m for _, m in parts])
        split.append(block)
    model.__dict__[_UNITS] = units
    return StreamUnits(model, units, groups, split)


def _chained_forward(model: nn.Module, block: nn.Module, parts: list[nn.Module]) -> Callable:
    signature = inspect.signature(type(block).forward)

    def forward(*args, **kwargs):
        bound = signature.bind(block, *args, **kwargs)  # diffusers passes keywords when not checkpointing
        bound.apply_defaults()
        inputs = tuple(bound.arguments.values())[1:]
        checkpoint = model._gradient_checkpointing_func if (
            torch.is_grad_enabled() and getattr(model, "gradient_checkpointing", False)) else None
        out = inputs
        for part in parts:
            out = checkpoint(part, *out) if checkpoint is not None else part(*out)
        return out

    return forward
