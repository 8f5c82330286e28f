"""Activation offload: a checkpointed block's inputs wait in pinned host memory
between its forward and its backward.

With gradient checkpointing the only activations kept across the step are each
block's inputs (the token states, B x T x D: 28 MB per block for Flux.1 at 1024²,
1.6 GB for the 57 blocks; 6 GB at 2048²). Here they leave the GPU right after the
block's forward starts (a device-to-host copy on its own stream) and come back one
block ahead of its backward (a host-to-device copy on another stream), so at most
two blocks' inputs are on the GPU at any time.

The model's checkpoint function is replaced (``enable_gradient_checkpointing(fn)``,
diffusers' public hook) by the engine's block checkpoint (engine/offload/block_checkpoint.py)
with this offloader as the place its inputs wait: forward runs the block without building
a graph and packs the inputs away (``pack``); backward brings them back (``unpack``),
recomputes the block with grad (the streamer's pre-hook fires again, so its weights are
loaded), and backpropagates through it.

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
before (the block checkpoint), keeping their inputs on the GPU, as without offload.
Both recompute the same block under the same RNG state, so the gradients are the same.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from .block_checkpoint import checkpoint
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
        self.bytes_out = 0
        self.bytes_in = 0
        self.sync_fetches = 0
        self._was_checkpointing = bool(getattr(model, "gradient_checkpointing", False))
        # What the units not offloaded are checkpointed with: the model's own function when it had one.
        self._recompute = model._gradient_checkpointing_func if self._was_checkpointing else None
        if self._recompute is None:
            self._recompute = checkpoint
        model.enable_gradient_checkpointing(gradient_checkpointing_func=self.checkpoint)

    # -- the checkpoint function diffusers calls: fn(block, *args) ---------------

    def checkpoint(self, block: nn.Module, *args):
        if id(block) in self.passthrough:
            return block(*args)
        if id(block) not in self.index:  # partial offload: this unit keeps its inputs on the GPU
            return self._recompute(block, *args)
        return checkpoint(block, *args, store=self)  # its inputs wait on the host (pack, unpack)

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
            self.model.enable_gradient_checkpointing(gradient_checkpointing_func=self._recompute)  # the one before
        else:
            self.model.disable_gradient_checkpointing()
        for a in self.arenas:
            if a is not None:
                a._host.release()
        self.arenas = []
