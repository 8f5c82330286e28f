"""The 1F1B schedule of a pipelined split, and its timing: pure Python, no torch.

A batch cut into M micro-batches flows through S stages (the split's parts, one per GPU). Each stage runs
its operations one at a time, in the order ``schedule`` gives: ``("F", k)`` is micro-batch k's forward
through the stage, ``("B", k)`` its backward. Stage s first runs ``S - 1 - s`` forwards (the warm-up that
fills the pipeline), then alternates one forward and one backward, then drains the remaining backwards
(PipeDream-Flush's "1F1B"). Compared with GPipe (every forward, then every backward) it computes the same
gradient, with the same bubble, but a stage holds at most ``S - s`` micro-batches' activations instead of M.

Dependencies: ``("F", k)`` on stage s needs ``("F", k)`` on stage s - 1 (its input crosses the cut);
``("B", k)`` on stage s needs ``("B", k)`` on stage s + 1 (the gradient crosses back), and the last stage's
``("B", k)`` follows its own ``("F", k)`` (the loss).

Interleaved (``chunks`` v > 1, Megatron-LM's interleaved 1F1B): the blocks are cut into S x v chunks, chunk c on
stage c % S, so each stage holds v chunks that are not next to each other (two GPUs, v = 2: chunks 0 and 2 on the
first, 1 and 3 on the second). An op is then ``(kind, k, chunk)``; a forward goes through chunks 0, 1, ..., S v - 1
(crossing between the stages S v - 1 times) and the backward back. Each stage runs its chunks' forwards in groups of
S micro-batches (chunk 0 for micro-batches 0..S-1, then its next chunk for the same ones, ...), after a warm-up of
``2 (S - 1 - s) + (v - 1) S`` forwards, then 1F1B, its backwards in the same grouping from the last chunk down;
M must be a multiple of S (Megatron's condition: the groups are whole). Same gradient, a smaller bubble: each op is
1/v of a stage's work, so the pipeline fills and drains in 1/v of the time.

``makespan`` plays a schedule with per-operation durations (what the split planner uses to place the cut for
balanced time); with S = 2 and equal stages of forward f and backward b per micro-batch it is
(M + 1)(f + b) against 2M(f + b) for the two parts one after the other: at most 2M / (M + 1) times faster
(1.6x at M = 4, 1.78x at 8), the bubble of a pipeline flushed every optimizer step. Interleaved over v chunks per
stage it is (M + 1/v)(f + b): 2M / (M + 1/v), 1.78x at v = 2 and 1.85x at v = 3 for M = 4 (``bound``).
"""
from __future__ import annotations

from typing import Callable, Sequence

Op = tuple  # ("F" | "B", micro-batch index), or ("F" | "B", micro-batch index, chunk) when interleaved


class ScheduleError(ValueError):
    """A schedule that cannot be built as asked (the message names the argument and the fix)."""


def schedule(micro_batches: int, stages: int = 2, chunks: int = 1) -> tuple[tuple[Op, ...], ...]:
    """Each stage's operations in the order it runs them (see the module doc); ``chunks``: v chunks per stage
    (interleaved; 1: today's ops ``(kind, k)``, each stage one chunk)."""
    if micro_batches < 1 or stages < 1 or chunks < 1:
        raise ScheduleError(f"micro_batches={micro_batches}, stages={stages} and chunks={chunks} must be >= 1")
    if chunks > 1:
        return _interleaved(micro_batches, stages, chunks)
    out = []
    for s in range(stages):
        warm = min(stages - 1 - s, micro_batches)
        ops: list[Op] = [("F", k) for k in range(warm)]
        for i in range(micro_batches - warm):
            ops += [("F", warm + i), ("B", i)]
        ops += [("B", k) for k in range(micro_batches - warm, micro_batches)]
        out.append(tuple(ops))
    return tuple(out)


def _interleaved(micro_batches: int, stages: int, chunks: int) -> tuple[tuple[Op, ...], ...]:
    """Megatron-LM's interleaved 1F1B (``forward_backward_pipelining_with_interleaving``): the i-th forward of a
    stage is micro-batch ``(i // (S v)) S + i % S`` through its ``(i % (S v)) // S``-th chunk; the i-th backward the
    same micro-batch through its chunks from the last."""
    if micro_batches % stages:
        raise ScheduleError(f"interleaved stages need micro_batches a multiple of the {stages} stages (micro-batches "
                            f"run through each chunk in groups of {stages}); micro_batches={micro_batches}: use "
                            f"{micro_batches + stages - micro_batches % stages}, or virtual_stages 1")
    total, group = micro_batches * chunks, stages * chunks

    def op(kind: str, i: int, s: int) -> Op:
        local = (i % group) // stages
        if kind == "B":
            local = chunks - 1 - local
        return (kind, (i // group) * stages + i % stages, local * stages + s)

    out = []
    for s in range(stages):
        # Megatron: with M == S every forward runs first (there is no steady state to interleave).
        warm = total if micro_batches == stages else min(total, 2 * (stages - 1 - s) + (chunks - 1) * stages)
        ops = [op("F", i, s) for i in range(warm)]
        for i in range(total - warm):
            ops += [op("F", warm + i, s), op("B", i, s)]
        ops += [op("B", i, s) for i in range(total - warm, total)]
        out.append(tuple(ops))
    return tuple(out)


def runnable_schedule(micro_batches: int, stages: int = 2, chunks: int = 1) -> tuple[tuple[Op, ...], ...]:
    """``schedule`` for any number of micro-batches: interleaved, the largest multiple of ``stages`` in the interleaved
    order, then each remaining micro-batch on its own (forward through every chunk, then its backward), after the
    rest. What the runner plays where a batch comes in fewer pieces than planned (a smaller last batch): the pieces
    still give the step's gradient; the rest start once the interleaved part has drained, so no stage holds more
    than the larger of that part's in-flight passes and one micro-batch's chunks."""
    if chunks == 1 or micro_batches % stages == 0:
        return schedule(micro_batches, stages, chunks)
    whole = micro_batches - micro_batches % stages
    head = schedule(whole, stages, chunks) if whole else ((),) * stages
    out = []
    for s in range(stages):
        mine = [l * stages + s for l in range(chunks)]
        tail = [op for k in range(whole, micro_batches)
                for op in [("F", k, c) for c in mine] + [("B", k, c) for c in reversed(mine)]]
        out.append(tuple(head[s]) + tuple(tail))
    return tuple(out)


def chunk_of(op: Op, stage: int) -> int:
    """The chunk an op runs: its third element, or (not interleaved) the stage's one chunk."""
    return op[2] if len(op) > 2 else stage


def dependencies(op: Op, stage: int, stages: int, chunks: int = 1) -> list[tuple[int, Op]]:
    """The (stage, op) pairs ``op`` on ``stage`` must wait for, besides the stage's previous op."""
    kind, k = op[0], op[1]
    c, last = chunk_of(op, stage), stages * chunks - 1

    def at(chunk: int, kind: str) -> tuple[int, Op]:
        return chunk % stages, ((kind, k, chunk) if len(op) > 2 else (kind, k))

    if kind == "F":
        return [at(c - 1, "F")] if c > 0 else []
    return [at(c + 1, "B")] if c < last else [at(c, "F")]


def in_flight(ops: Sequence[Op]) -> int:
    """The most forwards a stage holds at once (run, their backward not yet): micro-batches, or chunk passes."""
    live = peak = 0
    for op in ops:
        live += 1 if op[0] == "F" else -1
        peak = max(peak, live)
    return peak


def held_blocks(ops: Sequence[Op], blocks_of_chunk: dict[int, int], stage: int = 0) -> int:
    """The most blocks' inputs a stage holds at once: over its op sequence, the blocks of every chunk pass whose
    forward has run and backward not yet (``blocks_of_chunk``: each of the stage's chunks' block count)."""
    live = peak = 0
    for op in ops:
        n = blocks_of_chunk[chunk_of(op, stage)]
        live += n if op[0] == "F" else -n
        peak = max(peak, live)
    return peak


def bound(micro_batches: int, chunks: int = 1, stages: int = 2) -> float:
    """The most a flushed pipeline of equal stages can speed the stages up over running them one after the other:
    S M / (M + (S - 1) / v)."""
    return stages * micro_batches / (micro_batches + (stages - 1) / chunks)


def makespan(plan: Sequence[Sequence[Op]], duration: Callable[[int, Op], float],
             crossing_s: float = 0.0) -> float:
    """Seconds from the first op's start to the last op's end when each stage runs its ops in order, each as
    soon as its dependencies are done (``crossing_s``: the transfer between stages, forward and backward)."""
    stages = len(plan)
    chunks = max((chunk_of(op, s) for s, ops in enumerate(plan) for op in ops), default=0) // stages + 1
    done: dict[tuple[int, Op], float] = {}
    position = [0] * stages
    clock = [0.0] * stages
    remaining = sum(len(ops) for ops in plan)
    while remaining:
        progressed = False
        for s, ops in enumerate(plan):
            while position[s] < len(ops):
                op = ops[position[s]]
                deps = dependencies(op, s, stages, chunks)
                if any(d not in done for d in deps):
                    break
                ready = max([clock[s]] + [done[d] + (crossing_s if d[0] != s else 0.0) for d in deps])
                clock[s] = done[(s, op)] = ready + duration(s, op)
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError("the schedule deadlocks: an op waits for one that never runs first")
    return max(clock)
