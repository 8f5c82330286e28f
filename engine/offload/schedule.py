"""Which block to copy into which GPU slot, and when: pure Python, no torch.

A training step with gradient checkpointing visits the transformer blocks
0, 1, ..., N-1 (forward) and then N-1, N-2, ..., 0 (each block's recompute runs
right before its backward). Two visits of the same block in a row are one visit
(its weights are still loaded), so steps repeat the cycle

    0, 1, ..., N-1, N-2, ..., 1        (then 0 again: the next step, or the next micro-batch)

and every block except the two ends crosses PCIe twice per step. The scheduler
follows that cycle: each time a block is about to run (``visit``) it makes sure
the block is loaded, then starts copies for the next ``prefetch_depth`` streamed
blocks along the cycle into slots nobody needs soon (the slot whose block is used
farthest in the future is overwritten first, so blocks near the turnarounds stay
loaded and are not copied twice).

A forward without backward (sampling previews, under ``torch.no_grad``) visits
0, 1, ..., N-1 and then 0 again. The streamer says so at the model's forward
(``start_pass``), and the scheduler follows that cycle instead, so the end of one
pass prefetches the start of the next rather than a backward that never comes.

It never trusts its prediction: a block that is called out of order (an
interrupted step, accumulation) is loaded synchronously if needed and the position
resyncs to that block's next occurrence in the cycle.

The copy engine does the device work (``engine/offload/streamer.py`` for CUDA,
fakes in the tests). The contract it relies on:

* ``release(slot)`` is called when the visit of the slot's block has ended, that
  is at the start of the next visit: by then all compute that reads the slot has
  been enqueued (forward: the previous block returned; backward: autograd runs a
  later block's nodes before any node of an earlier block, and the earlier
  block's recompute starts only when its first node runs). The engine records an
  event there; a later copy into the slot waits for it.
* ``load(block, slot, evicted)`` is only ever called for a slot whose block is
  neither the one running nor one of the next ``prefetch_depth`` streamed blocks,
  and after that slot's ``release``.
* ``wait_ready(slot)`` is called before a block runs: compute waits for that
  block's copy only.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence


class CopyEngine(Protocol):
    def load(self, block: int, slot: int, evicted: Optional[int]) -> None:
        """Copy ``block`` into ``slot`` (after the slot's last release); point its tensors there.
        ``evicted`` is the block that was in the slot (its tensors go back to host memory)."""

    def wait_ready(self, slot: int) -> None:
        """Make the compute stream wait until the slot's copy has landed."""

    def release(self, slot: int) -> None:
        """Everything enqueued on the compute stream so far may read the slot; nothing after."""


def visit_cycle(num_blocks: int, forward_only: bool = False) -> list[int]:
    """Block order of one training step with the duplicate turnaround visits merged (``forward_only``: of one
    forward without backward)."""
    if num_blocks < 1:
        raise ValueError("num_blocks must be >= 1")
    if forward_only:
        return list(range(num_blocks))
    return list(range(num_blocks)) + list(range(num_blocks - 2, 0, -1))


@dataclass
class ScheduleStats:
    visits: int = 0  # pre-hook calls
    loads: int = 0  # copies started (prefetches and synchronous loads)
    sync_loads: int = 0  # a block was called while not loaded or in flight: compute waits for a cold copy
    resyncs: int = 0  # a block was called out of the predicted order

    def as_dict(self) -> dict:
        return dict(vars(self))


class BlockScheduler:
    """Ring-of-slots scheduling for ``num_blocks`` blocks of which ``streamed`` live on the host."""

    def __init__(self, num_blocks: int, streamed: Sequence[int], num_slots: int, prefetch_depth: int,
                 engine: CopyEngine):
        streamed = sorted(set(streamed))
        if streamed and (streamed[0] < 0 or streamed[-1] >= num_blocks):
            raise ValueError(f"streamed block ids must be in [0, {num_blocks})")
        if prefetch_depth < 1:
            raise ValueError("prefetch_depth must be >= 1")
        if streamed and num_slots < min(prefetch_depth + 1, len(streamed)):
            raise ValueError(f"{num_slots} slots cannot hold the running block and {prefetch_depth} prefetched ones")
        self.num_blocks = num_blocks
        self.streamed = frozenset(streamed)
        self.prefetch_depth = min(prefetch_depth, max(len(streamed) - 1, 1))
        self.engine = engine
        self.forward_only = False
        self._set_cycle(False)
        self.slots: list[Optional[int]] = [None] * (num_slots if streamed else 0)
        self.where: dict[int, int] = {}  # block -> slot
        self.position: Optional[int] = None  # index into cycle of the current visit
        self.current: Optional[int] = None
        self.stats = ScheduleStats()

    # -- the one entry point --------------------------------------------------

    def visit(self, block: int) -> None:
        """``block`` is about to run. Returns once its tensors point at loaded (or in-flight) memory."""
        self.stats.visits += 1
        if block == self.current:  # the merged turnaround visit, or a block called twice in a row
            if block in self.where:
                self.engine.wait_ready(self.where[block])
            return
        if self.current is not None and self.current in self.where:
            self.engine.release(self.where[self.current])
        self.position = self._advance(block)
        self.current = block
        if block in self.streamed:
            slot = self.where.get(block)
            if slot is None:
                self.stats.sync_loads += 1
                slot = self._victim(protect={block, *self._window()})
                self._load(block, slot)
            self.engine.wait_ready(slot)
        self._prefetch()

    def prime(self) -> None:
        """Start the copies for the first blocks of a step before it begins."""
        self.position, self.current = len(self.cycle) - 1, None
        self._prefetch()

    def start_pass(self, forward_only: bool) -> None:
        """The model's forward begins (its first block runs next): with a backward to follow (training), or
        without (``forward_only``: sampling). On a change the scheduler takes the other cycle, placed right
        before block 0 (or at it, when block 0 is the one still loaded from the last visit), and starts the
        copies that cycle wants next."""
        if forward_only == self.forward_only:
            return
        self._set_cycle(forward_only)
        self.position = 0 if self.current == self.cycle[0] else len(self.cycle) - 1
        if self.streamed:
            self._prefetch()

    def future_loads(self, count: int, wanted: Optional[frozenset] = None, cycles: int = 2) -> list[int]:
        """The next ``count`` loads (of ``wanted`` blocks only, when given) this scheduler will start if the
        visits follow its cycle from now on: a copy of its state replays the rest of the current visit's
        prefetch, then up to ``cycles`` cycles of visits. The disk tier reads ahead in this order
        (engine/offload/disk.py); called from inside a load, the block being loaded is already placed."""
        out: list[int] = []
        if self.position is None or not self.streamed:
            return out

        class _Record:
            def load(self, block, slot, evicted):
                if wanted is None or block in wanted:
                    out.append(block)

            def wait_ready(self, slot):
                pass

            def release(self, slot):
                pass

        sim = copy.copy(self)
        sim.engine, sim.slots, sim.where, sim.stats = _Record(), list(self.slots), dict(self.where), ScheduleStats()
        sim._prefetch()
        n = len(sim.cycle)
        for d in range(1, cycles * n + 1):
            if len(out) >= count:
                break
            sim.visit(sim.cycle[(self.position + d) % n])
        return out[:count]

    # -- internals ------------------------------------------------------------

    def _set_cycle(self, forward_only: bool) -> None:
        self.forward_only = forward_only
        self.cycle = visit_cycle(self.num_blocks, forward_only)
        self._occurrences = {b: [i for i, c in enumerate(self.cycle) if c == b] for b in range(self.num_blocks)}

    def _advance(self, block: int) -> int:
        n = len(self.cycle)
        start = 0 if self.position is None else (self.position + 1) % n
        if self.position is not None and self.cycle[start] == block:
            return start
        for d in range(n):  # out of order: resync to the block's next occurrence
            i = (start + d) % n
            if self.cycle[i] == block:
                if self.position is not None:
                    self.stats.resyncs += 1
                return i
        raise KeyError(f"block {block} is not one of the {self.num_blocks} scheduled blocks")

    def _window(self) -> list[int]:
        """The next ``prefetch_depth`` distinct streamed blocks after the current visit."""
        out: list[int] = []
        n = len(self.cycle)
        for d in range(1, n + 1):
            b = self.cycle[(self.position + d) % n]
            if b in self.streamed and b != self.current and b not in out:
                out.append(b)
                if len(out) == self.prefetch_depth:
                    break
        return out

    def _next_use(self, block: int) -> int:
        """Visits from now until ``block`` runs again."""
        n = len(self.cycle)
        return min((i - self.position) % n or n for i in self._occurrences[block])

    def _victim(self, protect: set[int]) -> int:
        free = [s for s, b in enumerate(self.slots) if b is None]
        if free:
            return free[0]
        candidates = [s for s, b in enumerate(self.slots) if b not in protect]
        if not candidates:
            raise RuntimeError("no slot free: the ring is smaller than prefetch depth + 1")
        return max(candidates, key=lambda s: self._next_use(self.slots[s]))

    def _load(self, block: int, slot: int) -> None:
        evicted = self.slots[slot]
        if evicted is not None:
            del self.where[evicted]
        self.slots[slot] = block
        self.where[block] = slot
        self.stats.loads += 1
        self.engine.load(block, slot, evicted)

    def _prefetch(self) -> None:
        window = self._window()
        protect = {self.current, *window}
        for b in window:
            if b not in self.where:
                self._load(b, self._victim(protect))


def simulate_step_loads(num_blocks: int, streamed: Sequence[int], prefetch_depth: int,
                        num_slots: Optional[int] = None, steps: int = 3) -> list[int]:
    """Blocks copied during one steady-state training step (for the planner's byte count)."""
    return list(simulate_step(num_blocks, streamed, prefetch_depth, num_slots, steps=steps)[0])


class RecordingCopyEngine:
    """A copy engine that moves nothing and records the blocks loaded, in order: the scheduler's decisions alone
    (the planner's simulation, tests)."""

    def __init__(self):
        self.loaded: list[int] = []

    def load(self, block, slot, evicted):
        self.loaded.append(block)

    def wait_ready(self, slot):
        pass

    def release(self, slot):
        pass


@functools.lru_cache(maxsize=4096)  # auto plans thousands of candidates over a few ring layouts
def _simulate(num_blocks: int, streamed: tuple, prefetch_depth: int, num_slots: int, sizes: tuple,
              steps: int) -> tuple[tuple, int, int]:
    eng = RecordingCopyEngine()
    sched = BlockScheduler(num_blocks, streamed, num_slots, prefetch_depth, eng)
    sched.prime()
    cycle = sched.cycle
    for _ in range(steps - 1):
        for b in cycle:
            sched.visit(b)
    eng.loaded.clear()
    held, at_turn = 0, 0
    for i, b in enumerate(cycle):
        sched.visit(b)
        now = sum(sizes[s] for s in sched.slots if s is not None)
        held = max(held, now)
        if i == num_blocks - 1:  # the last block's forward, right before the backward starts
            at_turn = now
    return tuple(eng.loaded), held, at_turn


def simulate_step(num_blocks: int, streamed: Sequence[int], prefetch_depth: int, num_slots: Optional[int] = None,
                  sizes: Optional[Sequence[int]] = None, steps: int = 3) -> tuple[tuple, int, int]:
    """(blocks copied during one steady-state training step, the most bytes the slots hold at once, the bytes
    they hold when the forward turns into the backward), for the planner. Slots are sized per block
    (``sizes``, bytes per block; all 0 when not given)."""
    if not streamed:
        return (), 0, 0
    sizes = tuple(sizes) if sizes is not None else (0,) * num_blocks
    return _simulate(num_blocks, tuple(sorted(set(streamed))), prefetch_depth, num_slots or prefetch_depth + 1,
                     sizes, steps)
