"""Activation offload: a checkpointed block's inputs wait in pinned host memory
between its forward and its backward.

With gradient checkpointing the only activations kept across the step are each
block's inputs (the token states, B x T x D: 28 MB per block for Flux.1 at 1024²,
1.6 GB for the 57 blocks; 6 GB at 2048²). Here they leave the GPU right after the
block's forward starts (a device-to-host copy on its own stream) and come back one
block ahead of its backward (a host-to-device copy on another stream), so at most
two blocks' inputs are on the GPU at any time.

This needs its own checkpoint function: torch's non-reentrant checkpoint keeps the
inputs alive in a closure, where saved-tensor hooks never see them. So the model's
checkpoint function is replaced (``enable_gradient_checkpointing(fn)``, diffusers'
public hook) by ``_OffloadedCheckpoint``, a reentrant-style autograd Function:
forward runs the block without building a graph and packs the inputs away;
backward brings them back, recomputes the block with grad (the streamer's pre-hook
fires again, so its weights are loaded), and backpropagates through it. RNG and
autocast state are replayed as torch.utils.checkpoint does.

Which inputs move: the per-token states (tensors of 3 or more dims). Position
embeddings and the conditioning vector are shared by every block and stay: so does
any input the previous offloaded block of the forward had too (the same tensor: the
conditioning every block reads, however many dims it has, e.g. LTX-2's per-token
modulation with image-to-video, 0.45 GB at 960x544x89; a single-stream model's text
states). The forward holds those on the GPU anyway; a copy per block would only add
host RAM and link traffic. The first offloaded block cannot know yet: its copy of them
is dropped at the second block's pack (it keeps the tensor instead), so one copy-out
per forward remains.

Partial offload (the plan's ``offloaded_blocks``): only the units given as ``offloaded`` go
through the offloading checkpoint; the others are checkpointed by the function the model had
before (torch's non-reentrant checkpoint), keeping their inputs on the GPU, as without offload.
Both recompute the same block under the same RNG state, so the gradients are the same.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..families.block_part import BlockPart
from .host import ALIGN, PinnedBuffer
from .plan import Workload


@dataclass
class _Packed:
    block: int
    host: list[Optional[torch.Tensor]]  # host copy per tensor input, or None when kept
    kept: list[Optional[torch.Tensor]]  # the tensor itself when not offloaded
    done: Any = None  # event: device->host copy finished
    gpu: Optional[list[Optional[torch.Tensor]]] = None  # prefetched device copies
    ready: Any = None  # event: host->device copy finished
    devices: list = field(default_factory=list)
    leaving: list = field(default_factory=list)  # device inputs held until their copy-out has landed
    refs: list = field(default_factory=list)  # weak references to the inputs (``_shared``: the next block's)


class _Arena:
    """One pinned host buffer per block, reused every step (grows if a larger bucket shows up)."""

    def __init__(self, nbytes: int, pin: bool):
        self.pin = pin
        self._host = PinnedBuffer(0, torch.uint8, pin=False)
        self.grow(nbytes)

    @property
    def buffer(self) -> torch.Tensor:
        return self._host.tensor

    def grow(self, nbytes: int) -> None:
        if nbytes <= self.buffer.numel():
            return
        self._host.release()  # the old one unregistered before the new one is taken
        self._host = PinnedBuffer(nbytes, torch.uint8, pin=self.pin)

    def views(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors]
        self.grow(sum(sizes))
        out, off = [], 0
        for t, size in zip(tensors, sizes):
            nbytes = t.numel() * t.element_size()
            out.append(self.buffer[off:off + nbytes].view(t.dtype).view(t.shape))
            off += size
        return out


def _offloadable(t: torch.Tensor) -> bool:
    return t.dim() >= 3


def _shared(stack: list[_Packed], tensors: list[torch.Tensor]) -> list[bool]:
    """Which of a block's inputs the previous offloaded block of this forward (``stack[-1]``) had too: they stay on
    the GPU (the module doc). That block's host copies of them are dropped for the tensor itself (its copy-out is
    harmless; nothing reads it back). Weak references: a tensor freed since cannot be mistaken for a new one."""
    if not stack:
        return [False] * len(tensors)
    prev = stack[-1]
    before = [r() for r in prev.refs]
    out = []
    for t in tensors:
        hits = [j for j, b in enumerate(before) if b is t]
        for j in hits:
            prev.host[j], prev.kept[j] = None, t
        out.append(bool(hits))
    return out


class ActivationOffloader:
    """Installs itself as the model's checkpoint function; ``remove()`` restores torch's."""

    def __init__(self, model: nn.Module, blocks: list[tuple[str, nn.Module]], device: torch.device,
                 workload: Workload, hidden_size: int, inline: bool = False, passthrough=(),
                 offloaded: Optional[set] = None):
        self.model, self.device = model, device
        # Only these units' inputs leave the GPU (None: every unit); the rest use the model's own checkpoint.
        offloaded = set(range(len(blocks))) if offloaded is None else set(offloaded)
        self.index = {id(b): i for i, (_, b) in enumerate(blocks) if i in offloaded}
        # Blocks split into parts (engine/offload/units.py): they run uncheckpointed, their parts are checkpointed.
        self.passthrough = {id(b) for b in passthrough}
        self.cuda = device.type == "cuda" and not inline
        per_block = workload.batch * workload.tokens * hidden_size * 2 + 2 * ALIGN  # bf16 (hidden, encoder)
        self.arenas = [_Arena(per_block, pin=self.cuda) if i in offloaded else None for i in range(len(blocks))]
        if self.cuda:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)
            from .link import pacer_for

            # Benches only (LOWVRAM_EMULATE_LINK_GBPS): activation copies are paced like the block copies, so an
            # emulated slow link slows both directions of this traffic too.
            self.pacer = pacer_for(device)
        self.stack: list[_Packed] = []
        # A reentrant checkpoint's outputs require grad only if an input does. Block 0's inputs come from
        # frozen embedders, so without this its LoRA weights would get no gradient.
        self._needs_grad = torch.empty(0, device=device, requires_grad=True)
        self.bytes_out = 0
        self.bytes_in = 0
        self.sync_fetches = 0
        self._was_checkpointing = bool(getattr(model, "gradient_checkpointing", False))
        # What the units not offloaded are checkpointed with: the model's own function when it had one.
        self._recompute = model._gradient_checkpointing_func if self._was_checkpointing else None
        if self._recompute is None:
            self._recompute = partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        model.enable_gradient_checkpointing(gradient_checkpointing_func=self.checkpoint)

    # -- the checkpoint function diffusers calls: fn(block, *args) ---------------

    def checkpoint(self, block: nn.Module, *args):
        if id(block) in self.passthrough:
            return block(*args)
        if id(block) not in self.index:  # partial offload: this unit keeps its inputs on the GPU
            return self._recompute(block, *args)
        leaves, spec = tree_flatten(args)
        is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        others = [None if t else x for t, x in zip(is_tensor, leaves)]
        # A reentrant Function's outputs all require grad once any input does (``_needs_grad`` makes sure one
        # does), even outputs that depend only on frozen tensors. A block part may say which of its outputs carry
        # no gradient (``constant_outputs(*args)``: Wan's modulation vectors, handed from part to part, when the
        # time embedding is frozen); they leave marked non-differentiable, so the next part is not asked for a
        # gradient nobody uses (and compiled parts do not compute one: inductor returned it in the wrong shape).
        constant = tuple(block.constant_outputs(*args)) if isinstance(block, BlockPart) else ()
        return _OffloadedCheckpoint.apply(self, block, (spec, is_tensor, others, constant), self._needs_grad,
                                          *tensors)

    # -- moving the inputs ------------------------------------------------------

    def pack(self, block: nn.Module, tensors: list[torch.Tensor]) -> _Packed:
        i = self.index[id(block)]
        if any(p.block == i for p in self.stack):  # a forward without backward before: start over
            self.stack.clear()
        moves = [_offloadable(t) and not shared for t, shared in zip(tensors, _shared(self.stack, tensors))]
        hosts = iter(self.arenas[i].views([t for t, m in zip(tensors, moves) if m]))
        packed = _Packed(block=i, host=[], kept=[], devices=[t.device for t in tensors],
                         refs=[weakref.ref(t) for t in tensors])
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            if self.stack and self.stack[-1].leaving:
                # The previous block's inputs may be freed (and their memory reused by compute) only after
                # their copy-out has read them. Waiting here costs nothing in practice (a copy of one block's
                # inputs is far shorter than a block's forward) and, unlike record_stream, lets the caching
                # allocator reuse the memory at once, so reserved memory does not grow.
                compute.wait_event(self.stack[-1].done)
                self.stack[-1].leaving = []
            inputs_ready = torch.cuda.Event()
            inputs_ready.record(compute)
            with torch.cuda.stream(self.d2h):
                # The inputs exist once the compute stream reaches this point; not before.
                self.d2h.wait_event(inputs_ready)
                for t, move in zip(tensors, moves):
                    if move:
                        h = next(hosts)
                        h.copy_(t, non_blocking=True)
                        if self.pacer is not None:
                            self.pacer.after_copy(h.numel() * h.element_size())
                        packed.leaving.append(t)  # released at the next pack (or unpack), see above
                        packed.host.append(h)
                        packed.kept.append(None)
                    else:
                        packed.host.append(None)
                        packed.kept.append(t)
                packed.done = torch.cuda.Event()
                packed.done.record(self.d2h)
        else:
            for t, move in zip(tensors, moves):
                if move:
                    h = next(hosts)
                    h.copy_(t)
                    packed.host.append(h)
                    packed.kept.append(None)
                else:
                    packed.host.append(None)
                    packed.kept.append(t)
        self.bytes_out += sum(h.numel() * h.element_size() for h in packed.host if h is not None)
        self.stack.append(packed)
        return packed

    def _fetch(self, p: _Packed) -> None:
        """Start the host->device copies of ``p`` (prefetch); a no-op when started already."""
        if p.gpu is not None:
            return
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            gpu = [torch.empty(h.shape, dtype=h.dtype, device=self.device) if h is not None else None for h in p.host]
            allocated = torch.cuda.Event()
            allocated.record(compute)
            with torch.cuda.stream(self.h2d):
                # The new buffers are free only once the compute stream is past their previous use.
                self.h2d.wait_event(allocated)
                # And the host copy must have landed before it is read back.
                self.h2d.wait_event(p.done)
                for g, h in zip(gpu, p.host):
                    if h is not None:
                        g.copy_(h, non_blocking=True)
                        if self.pacer is not None:
                            self.pacer.after_copy(h.numel() * h.element_size())
                p.ready = torch.cuda.Event()
                p.ready.record(self.h2d)
        else:
            gpu = [h.clone().to(d) if h is not None else None for h, d in zip(p.host, p.devices)]
        self.bytes_in += sum(h.numel() * h.element_size() for h in p.host if h is not None)
        p.gpu = gpu

    def unpack(self, p: _Packed) -> list[torch.Tensor]:
        if self.cuda:
            for q in self.stack:  # the last forward's inputs: done with them once their copies landed
                if q.leaving:
                    torch.cuda.current_stream(self.device).wait_event(q.done)
                    q.leaving = []
        if p.gpu is None:
            self.sync_fetches += 1
        self._fetch(p)
        # Prefetch the block that runs backward next (the one packed before this one).
        if p in self.stack:
            k = self.stack.index(p)
            del self.stack[k]
            if k > 0:
                self._fetch(self.stack[k - 1])
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(p.ready)
        out = [g if g is not None else kept for g, kept in zip(p.gpu, p.kept)]
        p.gpu = None
        return out

    def stats(self) -> dict:
        return {"activation_bytes_out": self.bytes_out, "activation_bytes_in": self.bytes_in,
                "activation_sync_fetches": self.sync_fetches}

    def remove(self) -> None:
        self.stack.clear()
        if self._was_checkpointing:
            self.model.enable_gradient_checkpointing()  # torch's non-reentrant checkpoint again
        else:
            self.model.disable_gradient_checkpointing()
        for a in self.arenas:
            if a is not None:
                a._host.release()
        self.arenas = []


def _autocast_state(device_type: str) -> dict:
    return {"device_type": device_type, "enabled": torch.is_autocast_enabled(device_type),
            "dtype": torch.get_autocast_dtype(device_type), "cache_enabled": torch.is_autocast_cache_enabled()}


class _OffloadedCheckpoint(torch.autograd.Function):
    """Reentrant checkpoint whose saved inputs live on the host between forward and backward."""

    @staticmethod
    def forward(ctx, off: ActivationOffloader, block: nn.Module, layout, _needs_grad, *tensors):
        ctx.off, ctx.block, ctx.layout = off, block, layout
        ctx.autocast = [_autocast_state(off.device.type)] + ([_autocast_state("cpu")] if off.device.type != "cpu" else [])
        ctx.cpu_rng = torch.get_rng_state()
        ctx.dev_rng = torch.cuda.get_rng_state(off.device) if off.device.type == "cuda" else None
        ctx.packed = off.pack(block, list(tensors))
        outputs = block(*_rebuild(layout, tensors))  # grad mode is off inside Function.forward
        if layout[3]:
            ctx.mark_non_differentiable(*(outputs[i] for i in layout[3]))
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        off = ctx.off
        restored = off.unpack(ctx.packed)
        ctx.packed = None
        needs = ctx.needs_input_grad[4:]
        inputs = [t.detach().requires_grad_(bool(n)) for t, n in zip(restored, needs)]
        devices = [off.device] if off.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.dev_rng is not None:
                torch.cuda.set_rng_state(ctx.dev_rng, off.device)
            with torch.enable_grad(), _autocast_stack(ctx.autocast):
                outputs = ctx.block(*_rebuild(ctx.layout, inputs))
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None, None) + tuple(t.grad if n else None for t, n in zip(inputs, needs))


def _rebuild(layout, tensors):
    spec, is_tensor, others, _constant = layout
    it = iter(tensors)
    leaves = [next(it) if t else o for t, o in zip(is_tensor, others)]
    return tree_unflatten(leaves, spec)


class _autocast_stack:
    def __init__(self, states: list[dict]):
        self.ctxs = [torch.autocast(**s) for s in states]

    def __enter__(self):
        for c in self.ctxs:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.ctxs):
            c.__exit__(*exc)
