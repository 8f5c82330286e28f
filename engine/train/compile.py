"""Compiled blocks: ``torch.compile`` of each transformer block's own forward (OffloadConfig ``compile``).

What is compiled is the compute inside a block (norms, modulation, projections with their LoRA,
attention, feed-forward), not what wraps it: the block streamer's forward pre-hooks, the
activation offloader and the checkpoint function stay eager, because ``compile`` replaces the
block's ``forward`` only and ``nn.Module.__call__`` still runs the hooks around it.

- One compile per block class, not per block: every block of a class runs the same code, and
  dynamo (with nn-module inlining, torch's default) passes each block's weights as graph inputs,
  so a streamed block whose weights were re-pointed into a GPU slot needs no recompile. Each class
  gets two graphs: the block checkpoint's forward runs without grad, its recompute with
  (engine/offload/block_checkpoint.py; Flux.1-dev 1024² on an H200 with cold caches: 7 graphs and
  44.7 s of first step, against 4 and 41.8 s under torch's checkpoint).
- Aspect-ratio buckets: the first new token count makes dynamo recompile with a dynamic
  sequence length (``dynamic=None``); later buckets reuse that graph. ``graphs()`` counts what
  was compiled, and training reports it.
- ``activation_memory_budget`` (0..1) is torch's knob for the compiled region's own forward/backward
  split: at 1 the partitioner keeps what eager would; below 1 it recomputes cheap (pointwise) ops
  in backward instead of saving them. Within a checkpointed block this shapes the working set of
  the block's backward.
- Random ops stay out of compiled regions (wrong gradients were reported for them at budgets
  below 1): dropout modules inside blocks (LoRA dropout) run eagerly, at the cost of a graph break.
- Token-chunked recompute (``recompute_chunks`` > 1) nests checkpoints inside a block; those chunk
  calls run eagerly too (``run_in_token_chunks`` is excluded from tracing), the rest is compiled.
- Threads: the pipelined split calls compiled blocks from one thread per micro-batch, and dynamo is not
  thread-safe there. While one thread compiles, torch.fx's process-wide tracing flag is set, and a compiled
  call on another thread fails on it ("Detected that you are using FX to symbolically trace a dynamo-optimized
  function": Flux.1-dev's split on CUDA, bench/logs/compiled_split_threads_session17_h200.log). So every
  compiled call holds the blocks' one lock: a first call, which compiles, never overlaps another. Not covered:
  inductor lowers a backward lazily, at its first run on autograd's thread, outside the lock; if that lowering
  traces with the flag set, another thread's call could still fail (not seen: Flux.1-dev's compiled split at 8
  micro-batches and the GPU test ran clean with the lock). Eager, the threads' host work did not overlap anyway
  (8 micro-batches took 8.09x one, bench/NOTES.md session 17); compiled, with the lock, they took 10-11x, so the
  lock may cost some of that: not measured without it on two GPUs.

Nothing here is ours that torch does: this module only decides where ``torch.compile`` applies and
puts the model back afterwards.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import torch
from torch import nn

#: The backend; tests use "aot_eager" (the same graph capture and autograd split, no code generation).
DEFAULT_BACKEND = "inductor"
#: compile='auto' compiles runs of at least this many steps: the first step's ~40-55 s of compiling
#: (H100, Flux.1-dev) is paid back by ~0.3 s saved per step at 1024 (bench/RESULTS.md).
AUTO_MIN_STEPS = 200


def triton_available() -> bool:
    """inductor generates Triton kernels for CUDA; without Triton (e.g. many Windows installs) it cannot."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def why_not_auto(device: torch.device, steps: int, split: bool) -> str | None:
    """compile='auto': None when the blocks should be compiled, else why not (logged)."""
    if device.type != "cuda":
        return "not on a CUDA GPU"
    if not triton_available():
        return "Triton is not installed"
    if split:
        return "Dual-GPU Split trains eager unless compile='blocks' (a compiled split is not yet timed on GPUs)"
    if steps < AUTO_MIN_STEPS:
        return f"fewer than {AUTO_MIN_STEPS} steps: the compile time would not pay back"
    return None


#: The activation-memory budget of the last compile in this process (see compile_blocks).
_last_budget: list[float] = []


def _one_at_a_time(compiled: Callable, lock) -> Callable:
    """``compiled`` called under ``lock`` (see the module's notes on threads)."""
    @functools.wraps(compiled, updated=())  # the name and signature, not dynamo's attributes
    def forward(*args, **kwargs):
        with lock:
            return compiled(*args, **kwargs)

    return forward


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompiledBlocks:
    """Blocks whose forward is compiled; ``remove()`` puts every forward and torch setting back."""

    def __init__(self, budget: float) -> None:
        self._patched: list[tuple[nn.Module, object]] = []
        self._graphs_at_start = _unique_graphs()
        self._saved_budget = torch._functorch.config.activation_memory_budget
        self.lock = threading.RLock()  # held by every call of these blocks' compiled forwards
        self.budget = budget

    def graphs(self) -> int:
        """Graphs dynamo compiled since these blocks were installed (forward and backward count once)."""
        return _unique_graphs() - self._graphs_at_start

    def set_forward(self, module: nn.Module, forward: Callable) -> None:
        self._patched.append((module, vars(module).get("forward")))
        module.forward = forward

    def remove(self) -> None:
        for module, previous in reversed(self._patched):
            if previous is None:
                vars(module).pop("forward", None)
            else:
                module.forward = previous
        self._patched.clear()
        torch._functorch.config.activation_memory_budget = self._saved_budget

    def describe(self) -> str:
        return (f"compiled blocks: {self.graphs()} graph(s)"
                + (f", activation_memory_budget {self.budget:g}" if self.budget < 1 else ""))


class NoCompile:
    """``compile='off'``: nothing to undo."""

    budget = 1.0

    def graphs(self) -> int:
        return 0

    def remove(self) -> None:
        pass


def _eager(fn: Callable) -> Callable:
    return torch.compiler.disable(fn, recursive=True)


def compile_blocks(model: nn.Module, family, budget: float = 1.0, backend: str | None = None) -> CompiledBlocks:
    """Compile the forward of every block in ``family.memory.block_lists_of(model)``, or of every streaming unit where
    blocks stream in parts (engine/offload/units.py).

    Call after LoRA is attached, chunked recompute installed and blocks are placed (the
    forward compiled is the one the block has then). ``budget`` is checked by OffloadConfig."""
    if _last_budget and _last_budget[0] != budget:
        # The partitioner reads the budget when it compiles; code compiled under another budget would be
        # reused silently (the budget is not guarded), so start over.
        torch._dynamo.reset()
    _last_budget[:] = [budget]
    handle = CompiledBlocks(budget)
    torch._functorch.config.activation_memory_budget = budget
    compiled: dict[object, Callable] = {}
    from ..offload.units import installed_units

    units = installed_units(model)  # blocks streamed in parts: compile the parts, the block only chains them
    for blocks in ([[u for _, u in units]] if units is not None else family.memory.block_lists_of(model)):
        for block in blocks:
            for sub in block.modules():
                if isinstance(sub, nn.Dropout) and sub.p > 0:
                    handle.set_forward(sub, _eager(sub.forward))
            forward = block.forward
            # The same function for every block of a class: dynamo compiles its code once and guards on
            # the tensors passed in, not on which block they belong to.
            fn = getattr(forward, "__func__", forward)
            if fn not in compiled:
                compiled[fn] = torch.compile(fn, backend=backend or DEFAULT_BACKEND, dynamic=None)
            call = compiled[fn].__get__(block) if hasattr(forward, "__func__") else compiled[fn]
            handle.set_forward(block, _one_at_a_time(call, handle.lock))
    return handle

