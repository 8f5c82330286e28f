"""The pipelined split: a step's micro-batches flow through the two parts in the 1F1B order
(engine/parallel/one_f_one_b.py), so both GPUs work at once.

The execution model, and why. diffusers runs a transformer's forward as one call (embedders, the block loop,
the final layers), so the two parts cannot be called separately; and a part's work is tens of thousands of
kernel launches per micro-batch, far more than the launch queue a device accepts ahead of the GPU (about a
thousand), so one Python thread enqueueing both parts' work in turn would block on the busier device's queue
while the other GPU drains and idles. Hence one thread per micro-batch, each running its micro-batch's whole
forward, loss and backward, and a turnstile per GPU (``_Lane``) that lets a thread run a part's operation only
when the schedule says it is that operation's turn. The forward's thread stops at the cut: the checkpoint
function that diffusers calls for the second part's first block (engine/parallel/split.py) ends the first
part's operation and waits for the second part's turn. At most one operation per GPU runs at a time, in the
schedule's order, so each part's streamer (engine/offload/streamer.py), whose hooks assume one sequence of
visits, sees its blocks in a well-defined order (forward, backward) as in a sequential run; each GPU's thread
enqueues while the other GPU's thread does, and CUDA runs both devices at once.

The backward is cut at the crossing: the forward crossing makes, on the second GPU, leaves (detached copies
that require grad) of the first part's tensors, so micro-batch k's backward runs as the head's backward (the
final layers, which live on the first GPU with the embedders, and the loss: ``loss.backward()`` stops at leaves
of the second part's outputs), then the second part's (to the crossing's leaves), then, in the first GPU's
turn, the first part's (``torch.autograd.backward`` of the crossed tensors with their leaves' gradients).
Gradients are those of the one-GPU run: the same operations, and each part's gradients accumulate in the same
micro-batch order.

Interleaved (virtual stages, ``chunks`` v > 1): the blocks are 2v chunks, chunk c on GPU c % 2, and the ops of the
interleaved schedule name their chunk. The same machinery, once per chunk boundary: a chunk's first block ends the
previous chunk's operation and waits for its own turn on its GPU's lane, and every tensor it takes from before
(the previous chunk's outputs, the embedders' tensors) enters as a leaf of the chunk, also where both chunks are
on one GPU, so that each chunk's graph ends at its own leaves. Which chunk made a tensor is recorded as it goes
(``_MicroBatch.made``). The backward then runs chunk by chunk from the last, each in its GPU's turn: the gradients
of the chunk's tensors that later chunks (or the head) took, summed per tensor, through the chunk down to its
leaves, whose gradients go to the chunks that made their tensors. With v = 1 this is the two-part pipeline above.
Each GPU's chunks are one part (one plan, one streamer: the part's blocks in execution order), so a micro-batch
visits the part's blocks forward and back as the streamer's cycle expects; the interleaved order between
micro-batches is one more out-of-order visit it resyncs to.

Copies between the GPUs run on a dedicated stream per device with events (``PeerCopy``): a plain ``.to()``
between devices makes both devices' current streams wait for each other, which would hold the first GPU's
work behind the second's. A consumer waits for a copy only once it holds its GPU's turn, so no stream waits
for work that is scheduled later. The head's work on the first GPU waits (on the CPU) for the second part's
forward to finish before it is enqueued, so it never holds back that GPU's own queue. It runs on that GPU's
compute stream, behind whatever the first part's thread has enqueued there, so that thread may run at most
``RUN_AHEAD_BLOCKS`` blocks ahead of the GPU (``throttle``): the head waits for two blocks, not for a whole
micro-batch of the first part. (A stream of its own for the head would not wait at all, but the first part's
tensors it reads, freed when the forward returns, could be handed to the first part's next kernels before the
head has read them.)

Not pipelined (refused by the split's plan): LoRA outside the blocks (its gradient would cross the cut in both
directions), activation offload on the first part, and interleaved on both (its buffers hold one micro-batch per
block; the first part holds two, an interleaved chunk as many as the schedule's warm-up), layers outside the blocks
held on the host (their hooks are not thread-safe).
"""
from __future__ import annotations

import collections
import copy
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .one_f_one_b import Op, runnable_schedule

#: How many blocks of the first part its thread may enqueue ahead of the GPU while a pipelined step runs.
RUN_AHEAD_BLOCKS = 2


class _Aborted(Exception):
    """Another micro-batch failed: this one stops at its next turn."""


class _Lane:
    """One GPU's turnstile: its operations run one at a time in the schedule's order."""

    def __init__(self, ops: Sequence[Op], cond: threading.Condition, runner: "PipelineRunner"):
        self.ops, self.cond, self.runner = tuple(ops), cond, runner
        self.position = 0
        self.ran: list[Op] = []  # the ops as they finished (tests compare it with the schedule)

    def acquire(self, op: Op) -> None:
        with self.cond:
            while self.position < len(self.ops) and self.ops[self.position] != op:
                if self.runner.failed is not None:
                    raise _Aborted()
                self.cond.wait()
            if self.runner.failed is not None:
                raise _Aborted()

    def release(self, op: Op) -> None:
        with self.cond:
            assert self.ops[self.position] == op, (self.ops[self.position], op)
            self.position += 1
            self.ran.append(op)
            self.cond.notify_all()


@dataclass
class _Moved:
    out: torch.Tensor
    done: Any = None  # CUDA event: the copy landed (None: no copy between GPUs)


class PeerCopy:
    """Tensors between the split's devices: on CUDA a peer copy (NVLink or PCIe) on a dedicated stream per device,
    after the producer's stream and before the consumer's; elsewhere a plain ``.to()``."""

    def __init__(self, devices: tuple[torch.device, torch.device]):
        self.cuda = all(d.type == "cuda" for d in devices) and devices[0] != devices[1]
        self.streams = {d: torch.cuda.Stream(d) for d in devices} if self.cuda else {}
        self.bytes = 0

    def start(self, t: torch.Tensor, dst: torch.device) -> _Moved:
        if t.device == dst:
            return _Moved(t.detach())
        self.bytes += t.numel() * t.element_size()
        if not self.cuda:
            return _Moved(t.detach().to(dst))
        src_stream, dst_stream = self.streams[t.device], self.streams[dst]
        src_stream.wait_stream(torch.cuda.current_stream(t.device))  # the producer's work so far
        with torch.cuda.stream(src_stream), torch.cuda.stream(dst_stream):  # both ends off the compute streams
            out = t.detach().to(dst, non_blocking=True)
        t.record_stream(src_stream)  # its memory is not reused before the copy has read it
        done = torch.cuda.Event()
        done.record(dst_stream)
        return _Moved(out, done)

    @staticmethod
    def finish(moved: _Moved) -> torch.Tensor:
        """The copy, for work enqueued from now on the consumer's current stream."""
        if moved.done is not None:
            consumer = torch.cuda.current_stream(moved.out.device)
            consumer.wait_event(moved.done)
            moved.out.record_stream(consumer)
        return moved.out


@dataclass
class _MicroBatch:
    """One micro-batch's crossing state (the thread running it holds it)."""

    index: int
    chunk: int = 0  # the chunk whose forward the thread runs (the first GPU's part, or chunk c of an interleaved split)
    # id(tensor) -> (a weak reference to it, the chunk whose operation made it): block arguments and outputs, and the
    # leaves made at each crossing; a chunk's are dropped after its backward. Weak, so that the runner keeps no tensor
    # alive that autograd has let go (a block output the model only concatenates, e.g. Flux's last double block's):
    # an entry counts only while its tensor is the one asked about (``_maker``, ``_leaf``), so a reused id is never mistaken.
    made: dict = field(default_factory=dict)
    # (id(tensor), chunk) -> (a weak reference to the tensor, its leaf (or copy) in that chunk)
    leaf_of: dict = field(default_factory=dict)
    entries: dict = field(default_factory=dict)  # chunk -> [(tensor, its leaf there, the chunk that made it)]
    returned: list = field(default_factory=list)  # (tensor, its leaf on the first device, maker) for the head


class _ThreadState(threading.local):
    micro: Optional[_MicroBatch] = None  # the micro-batch this thread runs (each thread starts with None)


class PipelineRunner:
    """Runs a step's micro-batches through a split's two parts in the 1F1B order, or through the chunks of an
    interleaved split in the interleaved order (see the module doc)."""

    #: The fewest pieces a batch is run through the pipeline with (one piece runs through the loop as unsplit).
    min_pieces = 2

    def __init__(self, devices: tuple[torch.device, torch.device], chunk_of_block: dict[int, int],
                 lane_of_module: Optional[dict[int, int]] = None, batches: int = 1, chunks: int = 1):
        self.devices = devices
        self.chunk_of_block = chunk_of_block  # id(block) -> its chunk (chunk c runs on devices[c % 2])
        self.lane_of_module = lane_of_module or {}  # id(module inside a block) -> its device's index
        self.chunks = chunks  # v: the chunks each device holds (1: one part each)
        self.last = 2 * chunks - 1  # the last chunk (on the second device), whose operation also runs the head
        self.copies = PeerCopy(devices)
        self._local = _ThreadState()
        self.failed: Optional[BaseException] = None
        self._lanes: tuple[_Lane, _Lane] = ()
        self.micro_batches_run = 0
        self.batches = batches  # accumulated batches one run spans (SplitPlan.batches_per_pipeline: the loop groups)
        self._active = False  # a pipelined step is running (the throttle applies)
        self._marks: collections.deque = collections.deque()
        self._marks_lock = threading.Lock()
        self.last_order: tuple[list[Op], list[Op]] = ([], [])  # each GPU's ops in the order the last step ran them

    @property
    def bytes_copied(self) -> int:
        """Bytes copied between the devices so far."""
        return self.copies.bytes

    def _op(self, kind: str, k: int, chunk: int) -> Op:
        """The schedule's name of an op (one_f_one_b.py: (kind, k) with one chunk per device)."""
        return (kind, k) if self.chunks == 1 else (kind, k, chunk)

    def _acquire(self, kind: str, k: int, chunk: int) -> None:
        """Wait for the turn of micro-batch k's ``kind`` on ``chunk`` (on its device's lane)."""
        self._lanes[chunk % 2].acquire(self._op(kind, k, chunk))

    def _release(self, kind: str, k: int, chunk: int) -> None:
        self._lanes[chunk % 2].release(self._op(kind, k, chunk))

    # -- what the split's hooks ask --------------------------------------------------------------------

    def current(self) -> Optional[_MicroBatch]:
        """The micro-batch this thread runs (None outside a pipelined step: previews, a one-micro-batch step)."""
        return self._local.micro

    @staticmethod
    def _maker(mb: _MicroBatch, x: torch.Tensor) -> Optional[int]:
        entry = mb.made.get(id(x))
        return entry[1] if entry is not None and entry[0]() is x else None

    @staticmethod
    def _leaf(mb: _MicroBatch, x: torch.Tensor, chunk: int) -> Optional[torch.Tensor]:
        entry = mb.leaf_of.get((id(x), chunk))
        return entry[1] if entry is not None and entry[0]() is x else None

    def _enter(self, mb: _MicroBatch, x: torch.Tensor, chunk: int, copy: torch.Tensor, maker: int) -> torch.Tensor:
        """``copy`` (``x`` on the chunk's device) becomes the chunk's leaf for ``x``: where ``x`` needs a gradient,
        the chunk's backward stops there and the leaf's gradient goes back to ``maker``'s backward."""
        if x.requires_grad:
            copy.requires_grad_(True)
            mb.entries.setdefault(chunk, []).append((x, copy, maker))
        mb.leaf_of[(id(x), chunk)] = (weakref.ref(x), copy)
        mb.made[id(copy)] = (weakref.ref(copy), chunk)
        return copy

    def block_arguments(self, block, args: tuple) -> tuple:
        """Before a block runs inside a pipelined forward: at a chunk's first block the previous chunk's operation ends
        and the arguments cross into this chunk (leaves where they need a gradient, on its device, after a copy
        between the GPUs); later blocks of the chunk get the same leaves for the same tensors (the rotary and
        modulation tensors every block takes), and a tensor an earlier chunk made that is first used here crosses
        then. Each chunk's graph so ends at its own leaves, and its backward is its own."""
        mb = self.current()
        if mb is None:
            return args
        c = self.chunk_of_block[id(block)]
        tensors = [x for x in tree_flatten(args)[0] if isinstance(x, torch.Tensor)]
        if c == 0:  # what the first chunk takes (the embedders' tensors, its blocks' outputs) is its own
            for x in tensors:
                if self._maker(mb, x) is None:
                    mb.made[id(x)] = (weakref.ref(x), 0)
            return args
        dev = self.devices[c % 2]
        if c != mb.chunk:
            if c != mb.chunk + 1:
                raise RuntimeError(f"the pipelined forward ran a block of chunk {c} after chunk {mb.chunk}: the blocks "
                                   f"must run in execution order; train this model with Dual-GPU Split "
                                   f"virtual_stages 1")
            moving = {}  # every argument made before this chunk: its copy starts before the turn is handed over
            for x in tensors:
                if id(x) not in moving:
                    made = self._maker(mb, x)
                    moving[id(x)] = (x, self.copies.start(x, dev), c - 1 if made is None else made)
            self._release("F", mb.index, c - 1)
            self._acquire("F", mb.index, c)
            mb.chunk = c
            for x, moved, maker in moving.values():
                self._enter(mb, x, c, self.copies.finish(moved), maker)

        def swap(x):
            if not isinstance(x, torch.Tensor):
                return x
            leaf = self._leaf(mb, x, c)
            if leaf is not None:
                return leaf
            made = self._maker(mb, x)
            if made is None:  # made inside this chunk's operation (between its blocks), or on another device before
                made = c if x.device == dev else c - 1
            if made == c or not (x.requires_grad or x.device != dev):
                return x
            return self._enter(mb, x, c, self.copies.finish(self.copies.start(x, dev)), made)

        return tree_map(swap, args)

    def micro_index(self, module) -> Optional[int]:
        """Which micro-batch a call of ``module`` belongs to (None outside a pipelined step): the modulation window
        serves each its own outputs (engine/train/step_window.py ``served``). In the forward, the calling thread's; in
        a checkpointed block's recompute, which autograd runs on a thread of its own (one per GPU), the micro-batch
        whose backward holds the module's device's lane: a device runs one operation at a time, and only a backward
        recomputes its blocks."""
        mb = self.current()
        if mb is not None:
            return mb.index
        if not self._lanes:
            return None
        lane = self._lanes[self.lane_of_module.get(id(module), 0)]
        return lane.ops[min(lane.position, len(lane.ops) - 1)][1]

    def block_outputs(self, block, out):
        """After a block: its outputs are its chunk's (a later chunk, or the head, takes them across)."""
        mb = self.current()
        if mb is not None:
            c = self.chunk_of_block[id(block)]
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    mb.made[id(t)] = (weakref.ref(t), c)
        return out

    def head_arguments(self, args, kwargs):
        """Before a layer after the blocks (on the first device) inside the last chunk's operation: the tensors of the
        chunks after the first (the last chunk's outputs) cross back as leaves, after the last chunk's forward has
        finished (so the first GPU's queue never waits on the second's)."""
        mb = self.current()
        if mb is None or mb.chunk != self.last:
            return args, kwargs
        dev0 = self.devices[0]
        waited = []

        def back(x):
            if not isinstance(x, torch.Tensor):
                return x
            made = self._maker(mb, x)
            if made is None and x.device != dev0:
                made = self.last
            if not made:  # the first chunk's (the embedders'), or made by the head itself
                return x
            if not waited and x.device.type == "cuda" and x.device != dev0:
                torch.cuda.current_stream(x.device).synchronize()
                waited.append(True)
            leaf = self.copies.finish(self.copies.start(x, dev0))
            if x.requires_grad:
                leaf.requires_grad_(True)
                mb.returned.append((x, leaf, made))
            return leaf

        return tree_map(back, args), tree_map(back, kwargs)

    def throttle(self, module, args):
        """Forward pre-hook of the first part's blocks (forward, and recompute in the backward): on a GPU, while a
        pipelined step runs, the enqueueing thread waits until the GPU has started the block ``RUN_AHEAD_BLOCKS``
        back. The first part's operations run one at a time (its lane), so the marks form one sequence."""
        if not self._active or not self.copies.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.devices[0]))
        with self._marks_lock:
            self._marks.append(ev)
            oldest = self._marks.popleft() if len(self._marks) > RUN_AHEAD_BLOCKS else None
        if oldest is not None:
            oldest.synchronize()
        return None

    # -- the step ---------------------------------------------------------------------------------------

    def run(self, pieces: Sequence[Callable[[], tuple[torch.Tensor, torch.Tensor]]]) -> list[torch.Tensor]:
        """Forward and backward of each micro-batch (``pieces[k]()`` runs its forward and returns (the loss to
        backpropagate, the loss to report)); returns the reported losses, detached, in order."""
        plan = runnable_schedule(len(pieces), 2, self.chunks)  # a smaller batch's odd count of pieces too
        cond = threading.Condition()
        self.failed = None
        self._lanes = (_Lane(plan[0], cond, self), _Lane(plan[1], cond, self))
        losses: list[Optional[torch.Tensor]] = [None] * len(pieces)
        errors: list[BaseException] = []
        cuda_device = torch.cuda.current_device() if self.devices[0].type == "cuda" else None
        grad_enabled = torch.is_grad_enabled()

        def work(k: int) -> None:
            try:
                if cuda_device is not None:
                    torch.cuda.set_device(cuda_device)
                with torch.set_grad_enabled(grad_enabled):
                    losses[k] = self._micro_batch(k, pieces[k])
            except _Aborted:
                pass
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread below
                with cond:
                    if self.failed is None:
                        self.failed = exc
                    errors.append(exc)
                    cond.notify_all()
            finally:
                self._local.micro = None

        threads = [threading.Thread(target=work, args=(k,), name=f"pipeline micro-batch {k}", daemon=True)
                   for k in range(len(pieces))]
        self._active = True
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        except BaseException as exc:  # Ctrl-C while waiting: the threads stop at their next turn, then it goes on
            with cond:
                self.failed = self.failed or exc
                cond.notify_all()
            for t in threads:
                t.join()
            raise
        finally:
            self._active = False
            self._marks.clear()
        self.last_order = (self._lanes[0].ran, self._lanes[1].ran)
        self._lanes = ()
        if errors:
            raise errors[0]
        self.micro_batches_run += len(pieces)
        return losses

    def _micro_batch(self, k: int, piece) -> torch.Tensor:
        last = self.last
        mb = self._local.micro = _MicroBatch(k)
        self._acquire("F", k, 0)
        backward, reported = piece()
        if mb.chunk != last:
            raise RuntimeError("the pipelined forward never reached the last part's blocks; train this model with "
                               "Dual-GPU Split micro_batches=1")
        self._local.micro = None  # the backward runs no pipeline hooks
        # The head's backward (first device), then the last chunk's, in the second GPU's turn.
        self._release("F", k, last)
        self._acquire("B", k, last)
        backward.backward()
        del backward
        routes: dict[int, list] = {}  # chunk -> [(tensor it made, its gradient on the way)]
        for x, leaf, made in mb.returned:
            if leaf.grad is not None:
                routes.setdefault(made, []).append((x, self.copies.start(leaf.grad, x.device)))
        mb.returned.clear()
        for c in range(last, -1, -1):
            if c != last:
                self._release("B", k, c + 1)
                self._acquire("B", k, c)
            self._chunk_backward(mb, c, routes)
        self._release("B", k, 0)
        return reported.detach()

    def _chunk_backward(self, mb: _MicroBatch, c: int, routes: dict) -> None:
        """Chunk ``c``'s backward, in its device's turn: from the gradients of its tensors that later chunks (or the
        head) took, summed per tensor, down to its own leaves, whose gradients then start back to the chunks that
        made their tensors."""
        pending = routes.pop(c, [])
        if pending:
            grads: dict[int, list] = {}
            for x, moved in pending:
                g = self.copies.finish(moved)
                if id(x) in grads:
                    grads[id(x)][1] = grads[id(x)][1] + g
                else:
                    grads[id(x)] = [x, g]
            torch.autograd.backward([x for x, _ in grads.values()], [g for _, g in grads.values()])
            del grads
        del pending
        for x, leaf, made in mb.entries.pop(c, []):
            if leaf.grad is not None:
                routes.setdefault(made, []).append((x, self.copies.start(leaf.grad, x.device)))
        mb.made = {key: entry for key, entry in mb.made.items() if entry[1] != c}
        mb.leaf_of = {key: leaf for key, leaf in mb.leaf_of.items() if key[1] != c}


def autocast_copy(autocast):
    """A fresh copy of the loop's autocast context per thread (a ``torch.autocast`` keeps its entry state on
    itself, so threads must not share one)."""
    return copy.copy(autocast)
