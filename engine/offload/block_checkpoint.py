"""A block's gradient checkpoint: the forward runs the block without recording a graph and keeps only its inputs; the
backward recomputes the block with grad and backpropagates through it (a reentrant checkpoint). Every checkpointed
block goes through ``BlockCheckpoint``: the model's checkpoint function (``checkpoint``, what diffusers calls for each
block while training), the split's (engine/parallel/split.py) and the activation offloader's, whose inputs wait on the
host in between (engine/offload/activations.py: its ``pack``/``unpack``).

Why ours, not torch.utils.checkpoint:

* torch's non-reentrant checkpoint (diffusers' default) records the forward's whole graph and runs a Python hook
  for every tensor the forward saves (a Flux.1 block saves about 65), then one per saved tensor again in backward.
  That is host time on every block: narrow Flux.1-dev (every operator, next to no GPU work) took 0.66 s a step
  checkpointed that way against 0.30 s without checkpointing (1x H200, bench/host_profile.py, session 18), and a
  pipelined split's step takes at least its micro-batches' host time (engine/parallel/split.py ``host_floor_s``).
* torch's reentrant checkpoint takes tensors only as direct arguments. A tensor inside a tuple (Flux.2's modulation
  parameters, rotary embeddings) is no input of its Function: its gradient is taken by the backward run inside the
  block's, which fails where two blocks share one that a trained layer made (Flux.2's modulation, computed once for
  every block, with LoRA on the modulation layers: "Trying to backward through the graph a second time"). And with
  no input that requires grad (the first block, whose inputs come from frozen embedders) its outputs require none,
  so that block's LoRA would get no gradient.

So the arguments are flattened (every tensor an input); where none needs a gradient but the block trains, one empty
leaf that requires grad goes in with them (``_needs_grad``), and where neither, the block runs plainly (recording
nothing, as torch's checkpoint would not either); RNG and autocast state are replayed as torch.utils.checkpoint does.
The gradients are those of torch's checkpoint: the same operations, recomputed under the same RNG state. Not handled
(no family here needs them): keyword arguments, and outputs nested deeper than one tuple.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..families.block_part import BlockPart


class InputStore(Protocol):
    """Where a checkpointed block's inputs wait between its forward and its backward."""

    def pack(self, block: nn.Module, tensors: list[torch.Tensor]): ...

    def unpack(self, packed) -> list[torch.Tensor]: ...


class KeepInputs:
    """The inputs stay where they are (the checkpoint of every block that is not activation-offloaded). Their versions
    are kept too: an input changed in place before the backward would be recomputed from the changed values (torch's
    ``save_for_backward`` refuses that as well)."""

    @staticmethod
    def pack(block: nn.Module, tensors: list[torch.Tensor]):
        return tensors, [None if t.is_inference() else t._version for t in tensors]

    @staticmethod
    def unpack(packed) -> list[torch.Tensor]:
        tensors, versions = packed
        for i, (t, v) in enumerate(zip(tensors, versions)):
            if v is not None and t._version != v:
                raise RuntimeError(f"input {i} of a checkpointed block (shape {tuple(t.shape)}) was changed in place "
                                   f"between the block's forward and its backward, so its recompute would not be the "
                                   f"forward that ran; change a copy instead (x = x.clone()) where it is changed")
        return tensors


KEEP = KeepInputs()
#: ``torch.autograd.backward`` takes gradient edges from torch 2.7 on (pytorch#144744); before, the outputs themselves.
BACKWARD_FROM_EDGES = torch.__version__ >= (2, 7)
_NEEDS_GRAD: dict[torch.device, torch.Tensor] = {}


def _needs_grad(device: torch.device) -> torch.Tensor:
    """An empty leaf that requires grad, one per device: an input of the checkpoint of a block that trains while none
    of its arguments needs a gradient (the first trained block), so that its outputs require grad and its backward
    runs."""
    t = _NEEDS_GRAD.get(device)
    if t is None:
        t = _NEEDS_GRAD[device] = torch.empty(0, device=device, requires_grad=True)
    return t


def checkpoint(block: nn.Module, *args, store: InputStore = KEEP):
    """``block(*args)``, checkpointed (diffusers' checkpoint function signature: ``fn(block, *args)``); without grad,
    or where nothing in it needs a gradient (no input does and the block trains nothing: the blocks before the first
    trained one), the plain call, which records nothing."""
    if not torch.is_grad_enabled():
        return block(*args)
    leaves, spec = tree_flatten(args)
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if any(t.requires_grad for t in tensors):
        needs_grad = None
    elif any(p.requires_grad for p in block.parameters()):
        needs_grad = True  # the first trained block: its inputs come from frozen layers
    else:
        return block(*args)
    others = [None if t else x for t, x in zip(is_tensor, leaves)]
    device = next((t.device for t in tensors if t.device.type != "cpu"), torch.device("cpu"))
    # A reentrant Function's outputs all require grad once any input does, even outputs that depend only on frozen
    # tensors. A block part may say which of its outputs carry no gradient (``constant_outputs(*args)``: Wan's
    # modulation vectors, handed from part to part, when the time embedding is frozen); they leave marked
    # non-differentiable, so the next part is not asked for a gradient nobody uses (and compiled parts do not compute
    # one: inductor returned it in the wrong shape).
    constant = tuple(block.constant_outputs(*args)) if isinstance(block, BlockPart) else ()
    return BlockCheckpoint.apply(store, block, (spec, is_tensor, others, constant, device),
                                 _needs_grad(device) if needs_grad else None, *tensors)


class BlockCheckpoint(torch.autograd.Function):
    """Reentrant checkpoint of one block (see the module doc); ``store`` keeps its inputs until the backward."""

    @staticmethod
    def forward(ctx, store: InputStore, block: nn.Module, layout, _needs_grad, *tensors):
        device = layout[4]
        ctx.store, ctx.block, ctx.layout = store, block, layout
        ctx.set_materialize_grads(False)  # an output nobody used gets no gradient, not zeros to backpropagate
        ctx.autocast = [_autocast_state(t) for t in dict.fromkeys([device.type, "cpu"])
                        if torch.amp.is_autocast_available(t)]
        ctx.cpu_rng = torch.get_rng_state()
        ctx.dev_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        ctx.packed = store.pack(block, list(tensors))
        outputs = block(*_rebuild(layout, tensors))  # grad mode is off inside Function.forward
        if layout[3]:
            ctx.mark_non_differentiable(*(outputs[i] for i in layout[3]))
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        restored = ctx.store.unpack(ctx.packed)
        ctx.packed = None
        device = ctx.layout[4]
        needs = ctx.needs_input_grad[4:]
        inputs = [t.detach().requires_grad_(bool(n)) for t, n in zip(restored, needs)]
        del restored
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.dev_rng is not None:
                torch.cuda.set_rng_state(ctx.dev_rng, device)
            with torch.enable_grad(), _autocast_stack(ctx.autocast):
                outputs = ctx.block(*_rebuild(ctx.layout, inputs))
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        # The backward starts from the outputs' gradient edges, not the outputs: their values are not needed, so they
        # are freed first (one block's output less at the block's backward peak than holding them through it; torch
        # before 2.7 takes only tensors, which then stay until the backward ends).
        edges = [(get_gradient_edge(o) if BACKWARD_FROM_EDGES else o, g) for o, g in zip(outputs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        del outputs, grads
        if edges:
            roots, root_grads = [e for e, _ in edges], [g for _, g in edges]
            del edges
            torch.autograd.backward(roots, root_grads)
        return (None, None, None, None) + tuple(t.grad if n else None for t, n in zip(inputs, needs))


def _rebuild(layout, tensors):
    spec, is_tensor, others = layout[:3]
    it = iter(tensors)
    leaves = [next(it) if t else o for t, o in zip(is_tensor, others)]
    return tree_unflatten(leaves, spec)


def _autocast_state(device_type: str) -> dict:
    return {"device_type": device_type, "enabled": torch.is_autocast_enabled(device_type),
            "dtype": torch.get_autocast_dtype(device_type), "cache_enabled": torch.is_autocast_cache_enabled()}


class _autocast_stack:
    def __init__(self, states: list[dict]):
        self.ctxs = [torch.autocast(**s) for s in states]

    def __enter__(self):
        for c in self.ctxs:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.ctxs):
            c.__exit__(*exc)
