"""One rank of data-parallel training: what ``train_lora`` asks of torch.distributed.

Each process trains the whole (streamed) model on its own share of the batches; after
every optimizer step's backward the LoRA gradients are averaged across ranks, so every
rank takes the same optimizer step and the weights stay identical.

Why one flat all-reduce after backward instead of torch's DDP: DDP broadcasts every
parameter and buffer of the module at construction and registers its reducer on the
model, which collides with block streaming (frozen block tensors are re-pointed into
GPU slots every step). A LoRA's gradients are small: measured on 2x H200 over NVLink,
one all-reduce of all Flux.1 r16 LoRA gradients takes 0.64 ms (Flux.2 r16: 1.10 ms)
against a ~1-2 s step, so overlapping it with backward would save nothing measurable.
We flatten with torch's own helpers and reduce in buckets of ``BUCKET_BYTES``.

The batch order: every rank builds the same seed-determined stream of aspect-ratio
bucketed batches (engine/train/batching.py) and rank r takes batches r, r+W, r+2W, ...
so micro-batch a of step s on rank r is global micro-batch (s-1)*W*A + a*W + r: exactly
the one a single process with gradient_accumulation = W*A would draw at that point. The
noise/timestep/flip draws are keyed by that global index (engine/train/batching.micro_generator), so
data-parallel training equals that single-process run up to float summation order.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

BUCKET_BYTES = 64 << 20

#: NVLink multicast (NVLS) stays off in every process we start: the lent multi-GPU machines
#: require it, and LoRA-sized all-reduces gain nothing from it.
NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class Ranks:
    """This process's place among ``world_size`` training processes (1 = not distributed)."""

    rank: int = 0
    world_size: int = 1
    #: The key of what the run records about its ranks (``_check_ranks_agree`` in engine/train/loop.py).
    kind = "data_parallel"

    @property
    def stage(self):
        """The split part this process runs (engine/parallel/process_split.py), None where each rank runs the whole
        model."""
        return None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def shard(self, batches: Iterator[list]) -> Iterator[list]:
        """This rank's batches: r, r+W, r+2W, ... of the shared stream."""
        while True:
            group = [next(batches) for _ in range(self.world_size)]
            yield group[self.rank]

    def global_micro_index(self, local_drawn: int) -> int:
        """The global index of this rank's ``local_drawn``-th micro-batch (0-based)."""
        return local_drawn * self.world_size + self.rank

    # -- collectives (no-ops in one process) -------------------------------------------------

    def average_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        if not self.distributed:
            return
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [p.grad for p in params if p.grad is not None]
        if len(grads) != len(params):
            # Every rank must reduce the same tensors in the same order, or NCCL hangs.
            raise RuntimeError(f"rank {self.rank}: {len(params) - len(grads)} LoRA parameters got no gradient")
        for bucket in _buckets(grads, BUCKET_BYTES):
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat.div_(self.world_size)
            for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                g.copy_(reduced)

    def clip(self, params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
        """The gradients' norm, clipped to ``max_norm`` first where it is > 0."""
        if max_norm and max_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        norms = [p.grad.norm().to("cpu") for p in params if p.grad is not None]  # split: grads on two devices
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    def after_step(self, params: Sequence[torch.nn.Parameter]) -> None:
        """After the optimizer's step: every rank stepped the same weights already."""

    def mean(self, value: float, device: torch.device) -> float:
        if not self.distributed:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t.item()) / self.world_size

    def any(self, flag: bool, device: torch.device) -> bool:
        """True on every rank when any rank's flag is set (stop requests are decided together)."""
        if not self.distributed:
            return flag
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def gather(self, value: float, device: torch.device) -> list[float]:
        """Every rank's value, in rank order (peak VRAM per GPU)."""
        if not self.distributed:
            return [value]
        import torch.distributed as dist

        t = torch.zeros(self.world_size, dtype=torch.float64, device=device)
        t[self.rank] = value
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return [float(v) for v in t.tolist()]


def _buckets(tensors: list[torch.Tensor], limit: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive groups of one device and dtype, each at most ``limit`` bytes (or one tensor)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if bucket and (size + n > limit or t.dtype != bucket[0].dtype or t.device != bucket[0].device):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += n
    if bucket:
        yield bucket


def ranks_from_env() -> Ranks:
    """RANK / WORLD_SIZE as set by our launcher or by torchrun."""
    return Ranks(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))


def init_from_env(device: torch.device) -> Ranks:
    """Join the process group described by the environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE):
    NCCL between GPUs, gloo on the CPU."""
    for k, v in NCCL_SAFE_ENV.items():
        os.environ.setdefault(k, v)
    ranks = ranks_from_env()
    if ranks.distributed:
        import datetime

        import torch.distributed as dist

        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            kwargs = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(backend, rank=ranks.rank, world_size=ranks.world_size,
                                    timeout=datetime.timedelta(minutes=30), **kwargs)
    return ranks


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
