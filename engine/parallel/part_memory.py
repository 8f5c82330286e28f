"""A split part's VRAM peak over the whole step, not only where the forward turns into the backward.

Why the parts need more than the one-GPU formula (engine/offload/plan.py). Without activation offload that formula
puts the peak at the turn: every block's checkpointed input is held, and the ring holds the last blocks (Flux: the
small single blocks). That is the peak of a whole model, whose large blocks come first and whose backward frees
inputs as it reaches them. A split part breaks both assumptions:

* Pipelined (1F1B, engine/parallel/one_f_one_b.py), the first part runs micro-batch k's backward while it still holds
  micro-batch k + 1's inputs for all its blocks. By the time k's backward reaches the large double blocks the ring is
  full of them, but the inputs held are k + 1's whole set plus k's up to that block: far more than a whole model
  holds there. Measured on 2x H200 (2026-11-27, bench/logs/parallel_flux*_pipeline_session5.log), the first part
  peaked 1.02 GB (Flux.2-dev int8, 12.31 GB) and 1.70 GB (Flux.1-dev bf16, 12.96 GB) above the turn's prediction,
  past its 12 GB budget; the ring's size at the double blocks against at the turn accounts for 0.83 and 1.44 GB of it.
* Interleaved (virtual stages), a part holds the inputs of every chunk pass in flight (``held_blocks`` over the
  interleaved schedule: at v = 2, M = 4 the first part five half-size passes, 2.5 micro-batches' worth) and, per
  further chunk, a crossing tensor and gradient (``CROSSING_UNITS_PER_CHUNK``).
* The first part also runs the head (the final norm and projection, with the embedders on the first GPU) for the
  micro-batch the second part has in flight, and holds the tensor at the cut and the gradient that crosses back:
  ``HEAD_AND_CROSSING_UNITS`` more while pipelined, and ``FIRST_PART_MEASURED_UNITS`` that GPUs measured and no
  model explains yet.
* One micro-batch at a time, a part that ends with small blocks and starts with large streamed ones has the same
  ring effect with its own inputs (the Flux.2 split's first part: +0.71 GB over its prediction, 12.14 GB of 12).

So the part's peak is the largest, over every visit of the step's block cycle (engine/offload/schedule.py, the same
scheduler the streamer runs), of what the ring holds after that visit plus the inputs held then plus one block's
working set; the one-GPU planner's own prediction stays the floor.
"""
from __future__ import annotations

from ..offload.plan import SAVED_INPUT_UNITS, Plan
from ..offload.schedule import BlockScheduler, RecordingCopyEngine

#: Held on the first GPU per pipelined step beside its own blocks' inputs, in B*T*D units of one micro-batch: the
#: in-flight micro-batch's tensor at the cut (1) and the gradient crossing back before the first part's backward
#: takes it (1), and the head's tensors of the micro-batch the second part runs, between its forward and its backward
#: (the final norm's input and output and the projection's input: 3; image tokens only, counted as a whole unit).
HEAD_AND_CROSSING_UNITS = 5.0
#: Measured on the first GPU of every pipelined Flux split beyond everything above, in the same units: Flux.2-dev int8
#: 1.0-1.4 GB over the plan (17-24 units of 56.6 MB, v = 1 to 4, M = 4 and 8), Flux.1-dev bf16 0.25-0.47 GB (9-17
#: units of 28 MB), 2x H200, 2026-11-28; the second GPU within -0.2/+0.4 GB. It came with the interleaved runner
#: (c9e577d: the same v = 1 plan measured 10.21 GB before it, 11.27 after) and does not grow with M or v. The part
#: the CPU shows (3-4 units of block outputs the runner kept) is fixed; the rest is not found (docs/multi-gpu.md).
#: Under each GPU's allocator cap it was an out-of-memory mid-step (v = 4, M = 8 at 12 GB), so the plan keeps room
#: for the largest measured until a GPU trace (bench_parallel.py --memory-history) names it.
FIRST_PART_MEASURED_UNITS = 25.0
#: ...and at most the largest measured (Flux.2-dev 1024², 1.38 GB): measured on Flux only, so a video model's far larger
#: units (Wan 832x480x81: 0.34 GB) are not multiplied by a count no GPU has shown for them.
FIRST_PART_MEASURED_MAX_BYTES = int(1.42e9)
#: Interleaved (virtual stages), per further chunk of a part: the tensor that crosses in before its chunk's forward
#: takes it and the gradient that crosses out before the earlier chunk's backward takes it (B*T*D units).
CROSSING_UNITS_PER_CHUNK = 2.0


def ring_by_visit(plan: Plan, steps: int = 3) -> list[tuple[int, bool, int]]:
    """(block, whether the visit runs a backward, bytes the ring holds after the visit) for each visit of one
    steady-state step, as the streamer's scheduler fills it (prefetches are allocated at the visit that starts them).
    The merged visit of block 0 is its backward (and the next forward's start); block N-1's is the turn (both)."""
    fp = plan.footprint
    n = fp.num_blocks
    streamed = sorted(plan.streamed)
    if not streamed:
        return [(b, True, 0) for b in range(n)]
    sched = BlockScheduler(n, streamed, plan.num_slots, plan.prefetch_depth, RecordingCopyEngine())
    sched.prime()
    for _ in range(steps - 1):
        for b in sched.cycle:
            sched.visit(b)
    out = []
    for i, b in enumerate(sched.cycle):
        sched.visit(b)
        held = sum(fp.block_bytes[s] for s in sched.slots if s is not None)
        out.append((b, i == 0 or i >= n - 1, held))
    return out


def part_peak(plan: Plan, held_micro_batches: float = 1, head: bool = False,
              crossings: int = 0) -> tuple[int, dict[str, int]]:
    """(the part's predicted peak bytes, what it adds to ``plan``'s own prediction by name). ``held_micro_batches``:
    how many micro-batches' block inputs the part holds at most (the 1F1B schedule's ``in_flight``; interleaved, the
    blocks ``held_blocks`` counts over the part's blocks, a fraction where a chunk pass holds part of them); ``head``:
    the part runs the head and receives the crossing gradient of a pipelined step (the first part, pipelined);
    ``crossings``: the part's further chunks (interleaved), each with its own tensors crossing in and out. ``plan``
    is the one-GPU planner's plan of the part (its breakdown without the pipelined inputs)."""
    fp, wl = plan.footprint, plan.workload
    unit = plan.micro_batch * wl.tokens * fp.hidden_size * fp.act_bytes_per_elem
    n = fp.num_blocks
    extra_inputs = int(max(0, held_micro_batches - 1) * n * SAVED_INPUT_UNITS * unit)
    added: dict[str, int] = {}
    if extra_inputs:
        added["pipelined inputs"] = extra_inputs
    if head:
        added["head and crossing"] = int(HEAD_AND_CROSSING_UNITS * unit)
        added["first GPU's measured excess"] = min(int(FIRST_PART_MEASURED_UNITS * unit), FIRST_PART_MEASURED_MAX_BYTES)
    if crossings:
        added["interleaved crossings"] = int(crossings * CROSSING_UNITS_PER_CHUNK * unit)
    floor = plan.predicted_peak_bytes + sum(added.values())
    if plan.mode != "stream" or plan.activation_offload:
        # Activation offload already counts the fullest ring with the inputs it keeps (the same all step);
        # a resident part has no ring.
        return floor, added
    # One block's working set: the activations term less the inputs it counts (one set per block).
    working = plan.breakdown["activations"] - int(n * SAVED_INPUT_UNITS * unit)
    weights = (fp.other_bytes - (fp.outer_bytes if plan.outer_on_host else 0)
               + sum(fp.block_bytes[i] for i in plan.resident))  # all but the ring
    over_step = max(ring + int((b + 1) * SAVED_INPUT_UNITS * unit) + (working if backward else 0)
                    for b, backward, ring in ring_by_visit(plan))
    peak = weights + plan.breakdown["lora+adam"] + sum(added.values()) + over_step  # the inputs, head, crossings
    if peak > floor:
        added["ring at the backward's large blocks"] = peak - floor
    return max(floor, peak), added
