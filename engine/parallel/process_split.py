"""One process per GPU for the pipelined split: each part's blocks run in a process of their own, so each GPU's host
work has its own interpreter.

Why. The threaded runner (pipeline.py) runs both parts' micro-batches under one interpreter lock, which the threads
hand to each other at every operator: eight micro-batches of narrow Flux.1-dev (next to no GPU time) took 4.6 s on one
GPU whatever the GPUs did, while two training processes side by side on one GPU each ran at their own speed
(docs/multi-gpu.md, session 18).

How. Both processes run the same training loop on the same batches and noise (``SplitRanks``: nothing is sharded), so
each computes the model's code outside the blocks itself: the embedders are frozen (LoRA outside the blocks is
refused). The model's checkpoint function (split.py ``_install_checkpoint``) runs only the blocks this process holds;
the other part's blocks are ``RankPipeline.remote_block``:

- stage 0 runs its part's blocks, recording the shapes of their outputs; at the first block of the second part it
  sends what that block takes (every tensor argument, after a header of integers: its blocks' output shapes and the
  arguments' shapes) to stage 1 and stops the forward there, keeping the tensors that need a gradient;
- stage 1 answers the first part's blocks with placeholders of those shapes, NaN where floating: anything the model
  read from one other than through the crossing would make the loss non-finite, never a quietly wrong gradient. At
  the first block of its part it swaps in the received arguments (leaves where they need a gradient), then runs its
  blocks, the layers after them and the loss.

Backward: stage 1's ``loss.backward()`` stops at those leaves and their gradients go back; stage 0 runs
``torch.autograd.backward`` of the tensors it sent with them. Each process plays its own lane of the 1F1B schedule
(one_f_one_b.schedule) in order, without threads. Tensors go by torch.distributed point-to-point, forward and backward
on a process group each, so that a send one way never waits behind a receive the other way (NCCL runs a group's
operations in order). Over gloo (the CPU, or both stages on one GPU) CUDA tensors go through host memory. Everything
crosses as bytes (a uint8 view of the tensor): nothing is pickled.

Around the step (``SplitRanks``): the losses come from stage 1 (one broadcast per pipeline), the clip uses the global
norm (one all-reduce), each process's optimizer steps its own part's LoRA (the other part's gets no gradient there),
and then each part's LoRA goes to the other process (one all-reduce), so both hold the whole LoRA after every step.

The placement of this process's part is split.py's (``apply_split`` with ``ranks``). Dual-GPU Split's
``one_process_per_gpu`` starts the two processes (engine/runs/launch.py, worker.py: as data parallel's workers);
``bench/bench_parallel.py --modes procs`` runs them under torchrun. Not yet: interleaved stages (a forward paused
between chunks needs a thread per micro-batch, as pipeline.py has), previews, validation and preservation's passes
(their forwards run outside the pipeline), resuming. Each process still holds the other part's frozen weights where
the model was loaded (on the host for a real checkpoint).
"""
from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import ConfigError
from .data_parallel import BUCKET_BYTES, NCCL_SAFE_ENV, Ranks, _buckets
from .one_f_one_b import runnable_schedule

#: The dtypes that cross, by their index in the header.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)


class _Crossed(Exception):
    """Stage 0's forward reached the second part: its share of the micro-batch is done (the runner catches it)."""


def _wire_device(group, device: torch.device) -> torch.device:
    """Where a tensor must be to cross through ``group``: NCCL takes CUDA tensors, gloo host ones."""
    import torch.distributed as dist

    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


@dataclass
class SplitRanks(Ranks):
    """The two processes of a process split, rank r running part r. Both draw every batch and every noise."""

    world_size: int = 2
    owned: set = field(default_factory=set)  # ids of this part's LoRA parameters (the split's placement fills it)
    device: torch.device = torch.device("cpu")  # this part's device (the placement sets it)
    kind = "process_split"

    @property
    def stage(self) -> int:
        return self.rank

    def shard(self, batches):
        return batches  # both parts see every batch

    def global_micro_index(self, local_drawn: int) -> int:
        return local_drawn

    def average_gradients(self, params) -> None:
        return None  # each process's gradients are its own part's

    def mean(self, value: float, device: torch.device) -> float:
        return value  # both processes hold the step's losses (RankPipeline.run broadcasts them)

    def any(self, flag: bool, device: torch.device) -> bool:
        return super().any(flag, _wire_device(None, device))

    def gather(self, value: float, device: torch.device) -> list[float]:
        return super().gather(value, _wire_device(None, device))

    def clip(self, params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
        """The norm of both parts' gradients together (one all-reduce), and each part's clipped by it."""
        import torch.distributed as dist

        grads = [p.grad for p in params if p.grad is not None and id(p) in self.owned]
        wire = _wire_device(None, self.device)
        total = torch.zeros(1, dtype=torch.float64, device=wire)
        if grads:  # one transfer: the squared norms summed where the gradients are
            norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads])
            total += norms.pow(2).sum().to(wire)
        dist.all_reduce(total)
        norm = math.sqrt(float(total.item()))
        if max_norm and max_norm > 0:
            coef = min(1.0, max_norm / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s factor
            for g in grads:
                g.mul_(coef)
        return norm

    def after_step(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Each part's LoRA to the other process: one all-reduce per bucket of the whole LoRA, each process giving its
        own part's weights and zeros for the other's (exact: x + 0)."""
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        for ps in _buckets(list(params), BUCKET_BYTES):  # runs of one device and dtype
            flat = _flatten_dense_tensors([p.data if id(p) in self.owned else torch.zeros_like(p.data) for p in ps])
            wire = flat.to(_wire_device(None, self.device))
            dist.all_reduce(wire)
            for p, value in zip(ps, _unflatten_dense_tensors(wire.to(flat.device), [p.data for p in ps])):
                if id(p) not in self.owned:
                    p.data.copy_(value)


def init_process_split(devices: Sequence[str]) -> SplitRanks:
    """Join the two processes' group from the environment (RANK, WORLD_SIZE 2, MASTER_ADDR/PORT, as torchrun sets
    them): NCCL between two GPUs, gloo on the CPU or where both parts share one GPU (a test of the runner)."""
    import torch.distributed as dist

    for k, v in NCCL_SAFE_ENV.items():
        os.environ.setdefault(k, v)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world != 2:
        raise ConfigError(f"a process split runs as exactly two processes (WORLD_SIZE={world}): start it with "
                          f"torchrun --nproc-per-node 2")
    cuda = [torch.device(d) for d in devices if str(d).startswith("cuda")]
    nccl = len(cuda) == 2 and cuda[0] != cuda[1]
    if nccl or cuda:
        torch.cuda.set_device(torch.device(devices[rank]))
    if not dist.is_initialized():
        kwargs = {"device_id": torch.device(devices[rank])} if nccl else {}
        dist.init_process_group("nccl" if nccl else "gloo", rank=rank, world_size=2,
                                timeout=datetime.timedelta(minutes=30), **kwargs)
    return SplitRanks(rank)


class RankPipeline:
    """This process's lane of a process split's 1F1B schedule (see the module doc): the runner ``apply_stage`` hands
    the training loop (``run``, as pipeline.PipelineRunner's) and the checkpoint function (``remote_block``,
    ``block_arguments``, ``block_outputs``)."""

    min_pieces = 1  # a batch of one piece crosses too: the other part's blocks are only here

    def __init__(self, stage: int, device: torch.device, first_remote: int, batches: int = 1):
        import torch.distributed as dist

        self.stage, self.device = stage, device  # this process's part and its device
        self.first_local_of_stage1 = first_remote  # id of the second part's first block (the crossing)
        self.batches = batches  # accumulated batches one run spans (SplitPlan.batches_per_pipeline)
        self.peer = 1 - stage
        # Forward and backward tensors on groups of their own (every process creates them, in this order).
        self.forward_group, self.backward_group = dist.new_group([0, 1]), dist.new_group([0, 1])
        self.micro_batches_run = 0
        self.bytes_copied = 0
        self._k: Optional[int] = None  # the micro-batch whose forward runs now
        self._at: Optional[int] = None  # the micro-batch whose forward or backward runs now
        self._shapes: list = []  # stage 0: its blocks' outputs this forward; stage 1: the header's, served in order
        self._arguments: Optional[list] = None  # stage 1: the crossing's (dtype, needs grad, shape), once received
        self._crossed = False
        self._held: dict[int, list] = {}  # k -> stage 0: the sent tensors that need a gradient; stage 1: their leaves
        self._sends: list = []  # (work, buffer) until the run's end

    # -- crossing ---------------------------------------------------------------------------------------

    def _send(self, tensors: Sequence[torch.Tensor], group) -> None:
        import torch.distributed as dist

        for t in tensors:
            wire = t.detach().contiguous().reshape(-1).view(torch.uint8).to(_wire_device(group, self.device))
            self.bytes_copied += wire.numel()
            self._sends.append((dist.isend(wire, self.peer, group=group), wire))

    def _recv(self, dtype: torch.dtype, shape: Sequence[int], group) -> torch.Tensor:
        import torch.distributed as dist

        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        wire = torch.empty(n, dtype=torch.uint8, device=_wire_device(group, self.device))
        dist.recv(wire, self.peer, group=group)
        return wire.view(dtype).reshape(tuple(shape)).to(self.device)

    def _send_ints(self, values: list[int]) -> None:
        t = torch.tensor(values, dtype=torch.int64)
        self._send([torch.tensor([len(values)], dtype=torch.int64), t], self.forward_group)

    def _recv_ints(self) -> list[int]:
        n = int(self._recv(torch.int64, (1,), self.forward_group).item())
        return self._recv(torch.int64, (n,), self.forward_group).tolist()

    @staticmethod
    def _spec(t: torch.Tensor, needs_grad: bool = False) -> list[int]:
        if t.dtype not in _DTYPES:
            raise ConfigError(f"a tensor of dtype {t.dtype} crosses between the split's processes; train this model "
                              f"with the threaded split (one process)")
        return [_DTYPES.index(t.dtype), int(needs_grad), t.dim(), *t.shape]

    @staticmethod
    def _read_spec(ints: list[int], at: int) -> tuple[tuple, int]:
        dtype, grad, ndim = ints[at:at + 3]
        shape = tuple(ints[at + 3:at + 3 + ndim])
        return (_DTYPES[dtype], bool(grad), shape), at + 3 + ndim

    # -- what the checkpoint function asks (split.py) --------------------------------------------------

    def block_outputs(self, block, out):
        """Stage 0: the shapes of its blocks' outputs, in order, for stage 1's placeholders."""
        if self.stage == 0 and self._k is not None:
            many = isinstance(out, (tuple, list))
            outs = list(out) if many else [out]
            if not all(isinstance(t, torch.Tensor) for t in outs):
                raise ConfigError(f"{type(block).__name__} returns {type(out).__name__} with values that are not "
                                  f"tensors; train this model with the threaded split (one process)")
            self._shapes.append([len(outs) if many else -1, *[v for t in outs for v in self._spec(t)]])
        return out

    def remote_block(self, block, args: tuple):
        """A block of the other part. Stage 0 (the second part's first block): its arguments cross, and the forward
        stops. Stage 1 (the first part's blocks): placeholders of the shapes stage 0's blocks gave."""
        if self._k is None:
            raise RuntimeError(f"a block of the other process's part ({type(block).__name__}) ran outside a pipelined "
                               f"step; previews, validation and preservation's passes do not run with one process "
                               f"per GPU yet")
        if self.stage == 0:
            if id(block) != self.first_local_of_stage1:
                raise RuntimeError("the forward skipped the second part's first block; train this model with the "
                                   "threaded split (one process)")
            flat, _ = tree_flatten(args)
            tensors = [x for x in flat if isinstance(x, torch.Tensor)]
            header = [len(self._shapes), *[v for s in self._shapes for v in s], len(tensors),
                      *[v for t in tensors for v in self._spec(t, t.requires_grad)]]
            self._send_ints(header)
            self._send(tensors, self.forward_group)
            self._held[self._k] = [t for t in tensors if t.requires_grad]
            self._crossed = True
            raise _Crossed()
        if self._arguments is None:
            self._receive_header()
        if not self._shapes:
            raise RuntimeError("stage 1 ran more of the first part's blocks than stage 0 did; the two processes must "
                               "run the same model on the same batch")
        kind, specs = self._shapes.pop(0)
        outs = [torch.full((), math.nan, dtype=dtype, device=self.device).expand(shape) if dtype.is_floating_point
                else torch.zeros((), dtype=dtype, device=self.device).expand(shape) for dtype, _, shape in specs]
        return outs[0] if kind == -1 else tuple(outs)

    def _receive_header(self) -> None:
        ints, at = self._recv_ints(), 1
        self._shapes = []
        for _ in range(ints[0]):
            kind = ints[at]
            at += 1
            specs = []
            for _ in range(1 if kind == -1 else kind):
                spec, at = self._read_spec(ints, at)
                specs.append(spec)
            self._shapes.append((kind, specs))
        n, at = ints[at], at + 1
        self._arguments = []
        for _ in range(n):
            spec, at = self._read_spec(ints, at)
            self._arguments.append(spec)

    def block_arguments(self, block, args: tuple) -> tuple:
        """Stage 1, at its part's first block: the arguments stage 0 sent stand in for the ones this process made
        from placeholders (leaves where they need a gradient)."""
        if self.stage == 0 or self._k is None or id(block) != self.first_local_of_stage1:
            return args
        flat, spec = tree_flatten(args)
        at = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        if len(at) != len(self._arguments):
            raise RuntimeError(f"the second part's first block takes {len(at)} tensors here and {len(self._arguments)} "
                               f"in stage 0; the two processes must run the same model on the same batch")
        leaves = []
        for i, (dtype, needs_grad, shape) in zip(at, self._arguments):
            if tuple(flat[i].shape) != shape:
                raise RuntimeError(f"a tensor crossing the cut is {tuple(flat[i].shape)} here and {shape} in stage 0")
            x = self._recv(dtype, shape, self.forward_group)
            if needs_grad:
                x.requires_grad_(True)
                leaves.append(x)
            flat[i] = x
        self._held[self._k] = leaves
        self._crossed = True
        return tree_unflatten(flat, spec)

    def micro_index(self, module) -> Optional[int]:
        """The micro-batch whose forward or backward (the blocks' recompute) runs now: the modulation window serves
        its outputs."""
        return self._at

    # -- the step ---------------------------------------------------------------------------------------

    def run(self, pieces: Sequence[Callable[[], tuple[torch.Tensor, torch.Tensor]]]) -> list[torch.Tensor]:
        """This lane of the 1F1B schedule over ``pieces`` (``pieces[k]()`` runs micro-batch k's forward and returns
        (the loss to backpropagate, the loss to report)); returns the reported losses, which stage 1 computed."""
        import torch.distributed as dist

        ops = runnable_schedule(len(pieces), 2, 1)[self.stage]
        held: dict[int, tuple] = {}
        losses: list = [None] * len(pieces)  # stage 1's, not read until the end (no wait for the GPU between ops)
        try:
            for kind, k in ops:
                self._at = k
                if kind == "F":
                    held[k] = self._forward(k, pieces[k])
                else:
                    losses[k] = self._backward(k, held.pop(k))
        finally:
            self._k = self._at = None
            for work, _ in self._sends:
                work.wait()
            self._sends.clear()
            self._held.clear()
        if self.stage == 1:
            wire = torch.stack([loss.detach().double().reshape(()) for loss in losses])
            if not torch.isfinite(wire).all():
                raise RuntimeError(
                    f"the losses are {wire.tolist()}: the training diverged, or the model uses a tensor of the first "
                    f"part other than through the second part's first block's arguments (the process split gives "
                    f"that NaN); lower learning_rate, or train this model with the threaded split")
            wire = wire.to(_wire_device(None, self.device))
        else:
            wire = torch.zeros(len(pieces), dtype=torch.float64, device=_wire_device(None, self.device))
        dist.broadcast(wire, src=1)
        self.micro_batches_run += len(pieces)
        return list(wire.cpu().unbind())

    def _forward(self, k: int, piece) -> Optional[tuple]:
        self._k, self._shapes, self._arguments, self._crossed = k, [], None, False
        try:
            out = piece()
        except _Crossed:
            out = None
        finally:
            self._k = None
        if not self._crossed:
            raise RuntimeError("the forward never reached the second part's first block; train this model with the "
                               "threaded split (one process)")
        if self.stage == 1 and self._shapes:
            raise RuntimeError(f"stage 0 ran {len(self._shapes)} more of the first part's blocks than this process")
        return out

    def _backward(self, k: int, out: Optional[tuple]) -> Optional[torch.Tensor]:
        """Micro-batch k's backward through this part; stage 1 returns its reported loss."""
        if self.stage == 1:
            backward, reported = out
            backward.backward()
            del backward
            leaves = self._held.pop(k)
            self._send([x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves], self.backward_group)
            return reported
        sent = self._held.pop(k)
        grads = [self._recv(t.dtype, t.shape, self.backward_group) for t in sent]
        if sent:
            torch.autograd.backward(sent, grads)
        return None


def check_stage_run(sampling, validation_items, resume, loss) -> None:
    """What a process split does not run yet, refused before anything loads (see the module doc)."""
    why = [what for what, on in (
        ("previews (sample_every)", sampling is not None and sampling.enabled),
        ("validation images", bool(validation_items)),
        ("resuming (Resume)", resume is not None and resume.enabled),
        ("differential output preservation", loss is not None and loss.preservation_weight > 0)) if on]
    if why:
        raise ConfigError(f"one process per GPU does not run {', '.join(why)} yet; turn them off, or use the threaded "
                          f"split (one process)")
