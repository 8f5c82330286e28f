"""Split mode: the transformer's blocks cut in two, the first part on one GPU, the rest on another.

Each part is planned and streamed on its own device exactly as a whole model would be
(engine/offload: resident blocks, a ring of slots, activation offload, int8 slab layers),
from its own VRAM budget; everything outside the blocks (embedders, final norm and
projection) lives on the first device. LoRA parameters live with their base layers, so
one AdamW steps each device's parameters in place (torch groups them by device).

Crossing the cut: the block loop passes loop-level tensors (rotary embeddings, the
timestep embedding or Flux.2's modulation) to every block, so a block on the second GPU
gets its tensor arguments moved there by a forward pre-hook, and the modules after the
blocks get theirs moved back. While training, diffusers calls the blocks through the
model's checkpoint function; ours moves the arguments first, so what the checkpoint saves
(or activation offload ships to the host) is already on the block's own device.
Autograd carries the gradients back across ``.to()``.

The cut: every cut point is planned (pure arithmetic, engine/offload/plan.py), and the
one kept streams the fewest bytes per step with both parts inside their budgets; ties
go to the cut whose predicted peaks are closest, so both GPUs peak at about the same level.

The step time: with one micro-batch the parts run one after the other (forward through part
one, then part two; backward the other way), so a step is the sum of the parts' steps, each
predicted on its own device's measured link and GPU (engine/offload/steptime.py), plus the
hidden states crossing the cut (forward) and their gradient (backward) at the peer link's rate.

Pipelined (``micro_batches`` > 1, engine/parallel/pipeline.py): the batch's micro-batches flow
through the parts in the 1F1B order, so both GPUs work at once. The step is then the schedule's
makespan (engine/parallel/one_f_one_b.py) over each part's per-micro-batch time (forward a
quarter of it: checkpointing recomputes the forward inside the backward), and the cut is the
one with the shortest predicted step (balanced time: compute and streaming per part), not the
fewest bytes. The first part holds two micro-batches' block inputs at once (the warm-up
forward and the one in flight), planned inside its budget, and keeps them on the GPU.

Interleaved (``virtual_stages`` v > 1): the blocks in 2v chunks, chunk c on device c % 2, each device's part its
chunks' blocks (one plan and one streamer per device, under its budget); the step is the interleaved schedule's
makespan, each chunk's op its share of its part's time by FLOPs, one crossing per cut; the cuts are swept over the
first device's share of the FLOPs for the shortest predicted step; the chunk passes each device holds at once
(Megatron's warm-up: more than two micro-batches' worth on the first) are counted in its peak.

Each part's peak is counted over the whole step (engine/parallel/part_memory.py: the ring at its
large blocks with the inputs held then, the head and the crossing), and a part whose whole-step
peak passes its budget is planned again inside it: the one-GPU formula's peak at the turn put the
pipelined first part at 11.3 GB where it measured 12.3 (Flux.2) and 13.0 GB (Flux.1) of 12.
Before issue 42 the parts were planned on the default machine (a 25 GB/s link and an
unknown GPU's peak): 8.9 s + 17.4 s predicted against 2.27 s measured on 2x H200.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..errors import ConfigError
from ..offload.block_checkpoint import checkpoint as checkpoint_block
from ..offload.config import OffloadConfig
from ..offload.footprint import named_blocks
from ..offload.plan import GB, ModelFootprint, Plan, Workload, make_plan
from ..offload.steptime import ATTENTION_PASSES, LINEAR_PASSES, Machine, block_flops, host_s_per_piece
from .config import check_virtual_stages
from .one_f_one_b import bound, chunk_of, held_blocks, in_flight, makespan, schedule
from .part_memory import part_peak

#: Times a part is planned again when its whole-step peak passes its budget (each lowers the budget it plans in).
REPLANS = 6

#: Share of a part's per-micro-batch time spent in the forward: with gradient checkpointing the backward
#: recomputes the forward and then runs the backward proper (about twice the forward's FLOPs).
FORWARD_SHARE = 0.25

#: Peer bandwidth assumed for the hidden states crossing the cut (bytes/s) when it was not measured: PCIe 4.0 x16's
#: practical rate, the slow end of what two GPUs of one host share (NVLink is ~10x that). The crossing is a few MB
#: per micro-batch, so the assumption moves a step by milliseconds.
DEFAULT_PEER_BYTES_PER_S = 20 * GB

#: Interleaved cuts tried per chunk count: the first device's share of the blocks' FLOPs swept from 25% to 75% in this
#: many steps (each a plan of both parts; neighbouring steps often give the same cuts and are planned once).
INTERLEAVE_SWEEP = 24
#: The chunk counts virtual_stages 0 (auto) compares.
AUTO_VIRTUAL_STAGES = (1, 2, 3)


@dataclass
class SplitPlan:
    cut: int  # index (execution order) of the first block on the second device
    devices: tuple[torch.device, torch.device]
    plans: tuple[Plan, Plan]
    reason: str = ""
    crossing_bytes: int = 0  # hidden states crossing the cut per micro-step, each way
    peer_bytes_per_s: float = DEFAULT_PEER_BYTES_PER_S
    micro_batches: int = 1  # > 1: pipelined, the batch's micro-batches in the 1F1B order (pipeline.py)
    # Accumulated batches one pipeline spans: 1, or micro_batches / batch_size where the batch is smaller than
    # micro_batches (each sample a micro-batch, the pipeline filled from gradient accumulation's batches).
    batches_per_pipeline: int = 1
    host_extra_bytes: int = 0  # host RAM the run holds beside the parts (the modulation window's weights)
    # Interleaved (virtual_stages v > 1): every cut (2v - 1 of them; ``cut`` is the first), the blocks in 2v chunks,
    # chunk c on device c % 2; each device's part holds its chunks' blocks in order. Empty: the one cut.
    cuts: tuple[int, ...] = ()
    chunk_shares: tuple[float, ...] = ()  # each chunk's share of its device's part time (FLOPs); empty: one chunk each
    host_s_per_piece: float = 0.0  # Python seconds of one micro-batch through every block (steptime.host_s_per_piece)
    fewer_pieces: Optional[tuple[int, float]] = None  # host-bound: (micro_batches M / 2, its predicted step) if shorter
    processes: bool = False  # one process per part (engine/parallel/process_split.py): each part's Python its own

    @property
    def chunks(self) -> int:
        """v: the chunks each device holds (1: one part each, not interleaved)."""
        return (len(self.cuts) + 1) // 2 if self.cuts else 1

    @property
    def chunk_ranges(self) -> list[range]:
        """Each chunk's blocks (execution order): chunk c runs on ``devices[c % 2]``."""
        n = self.plans[0].footprint.num_blocks + self.plans[1].footprint.num_blocks
        edges = [0, *(self.cuts or (self.cut,)), n]
        return [range(a, b) for a, b in zip(edges, edges[1:])]

    @property
    def predicted_peak_bytes(self) -> int:
        return max(p.predicted_peak_bytes for p in self.plans)

    @property
    def predicted_host_peak_bytes(self) -> int:
        """Host RAM of the one process that holds both parts: its base once, each part's own host bytes."""
        from ..offload.plan import PROCESS_BASE_BYTES

        return (sum(p.predicted_host_peak_bytes for p in self.plans) - (len(self.plans) - 1) * PROCESS_BASE_BYTES
                + self.host_extra_bytes)

    @property
    def crossing_s(self) -> float:
        """The cut's hidden states forward and their gradient backward, over the peer link."""
        return 2 * self.crossing_bytes / self.peer_bytes_per_s

    @property
    def gpu_step_s(self) -> Optional[float]:
        """One micro-step of the GPUs (as a part's ``step_time``): the parts one after the other, plus the crossing;
        pipelined, the 1F1B schedule's makespan (None: a part has no step time). The cuts are placed by it."""
        if any(p.step_time is None for p in self.plans):
            return None
        return pipelined_step_s([p.step_time.seconds for p in self.plans], self.micro_batches, self.crossing_s,
                                self.batches_per_pipeline, self.chunks, self.chunk_shares)

    @property
    def host_floor_s(self) -> float:
        """Pipelined, the micro-step's Python: both parts run in this one process, and their threads share its
        interpreter lock, so every micro-batch's operator calls are made one after the other, whichever GPU runs them
        (measured on one GPU: eight micro-batches took 8.09x one alone, bench/NOTES.md session 17). With one process
        per part, each process's calls are its part's, in the 1F1B order (measured on one GPU at M = 8, compiled:
        2.26 s against 2.44 s predicted; eager 3.80 against 2.88 s, likely as both processes' many small kernels took
        turns on the one GPU: not yet checked on two). Not pipelined, 0: one thread launches ahead of the GPUs, as on
        one GPU (whose plan has no floor either)."""
        if self.micro_batches <= 1:
            return 0.0
        if self.processes:  # each process makes its own part's calls: the 1F1B makespan of the parts' Python
            n = sum(p.footprint.num_blocks for p in self.plans)
            per_piece = [self.host_s_per_piece * p.footprint.num_blocks / n for p in self.plans]
            return pipelined_step_s([h * self.micro_batches / self.batches_per_pipeline for h in per_piece],
                                    self.micro_batches, 0.0, self.batches_per_pipeline)
        return self.host_s_per_piece * self.micro_batches / self.batches_per_pipeline

    @property
    def predicted_step_s(self) -> Optional[float]:
        """One micro-step: the GPUs' (``gpu_step_s``) or, where longer, the host's (``host_floor_s``)."""
        gpu = self.gpu_step_s
        return None if gpu is None else max(gpu, self.host_floor_s)

    @property
    def host_bound(self) -> bool:
        gpu = self.gpu_step_s
        return gpu is not None and self.host_floor_s > gpu

    def _fewer_hint(self) -> str:
        if self.fewer_pieces:
            return f": micro_batches {self.fewer_pieces[0]} predicts {self.fewer_pieces[1]:.3f} s"
        if self.batches_per_pipeline == 1:
            return " (Train LoRA batch_size a larger multiple of micro_batches)"
        return " (a larger batch_size: each micro-batch is now one accumulated image)"

    def describe(self) -> str:
        n = self.plans[0].footprint.num_blocks + self.plans[1].footprint.num_blocks
        if self.chunks > 1:
            where = ", ".join(f"{r.start}-{r.stop - 1} on {self.devices[c % 2]}" for c, r in enumerate(self.chunk_ranges))
            head = (f"split interleaved, virtual_stages {self.chunks}: {n} blocks in {2 * self.chunks} chunks, blocks "
                    f"{where}")
        else:
            head = (f"split at block {self.cut} of {n}: blocks 0-{self.cut - 1} on {self.devices[0]}, "
                    f"{self.cut}-{n - 1} on {self.devices[1]}")
        kind = "interleaved 1F1B" if self.chunks > 1 else "1F1B"
        lines = [head + (f" ({self.reason})" if self.reason else "")
                 + (f"; each batch pipelined through both in {self.micro_batches} micro-batches ({kind})"
                    if self.micro_batches > 1 and self.batches_per_pipeline == 1 else "")
                 + (f"; every {self.batches_per_pipeline} accumulated batches pipelined through both together, "
                    f"{self.micro_batches} micro-batches ({kind})" if self.batches_per_pipeline > 1 else "")]
        step = self.predicted_step_s
        if step is not None and self.micro_batches > 1:
            parts = ", ".join(f"{p.step_time.seconds:.3f}" for p in self.plans)
            lines.append(f"predicted step {step:.3f} s: {self.micro_batches} micro-batches pipelined "
                         + (f"(interleaved 1F1B, v = {self.chunks}: {2 * self.chunks - 1} crossings each way, bound "
                            f"{bound(self.micro_batches, self.chunks):.2f}x the parts one after the other)"
                            if self.chunks > 1 else "(1F1B)")
                         + f" through the parts ({parts} s each alone), {self.crossing_s * 1e3:.1f} ms crossing "
                         + ("each cut" if self.chunks > 1 else "the cut"))
            if self.host_bound:
                pieces = self.micro_batches / self.batches_per_pipeline
                how = ("each process making its part's share of them, in the 1F1B order" if self.processes else
                       "made one after the other (both GPUs' threads share this process's interpreter)")
                lines.append(
                    f"  host-bound: {pieces:g} micro-batches x {self.host_s_per_piece:.2f} s of Python each, {how}: "
                    f"{self.host_floor_s:.3f} s against {self.gpu_step_s:.3f} s of GPU work; fewer micro-batches of "
                    f"more images each make fewer calls per image{self._fewer_hint()}")
        elif step is not None:
            parts = " + ".join(f"{p.step_time.seconds:.3f}" for p in self.plans)
            lines.append(f"predicted step {step:.3f} s: the parts one after the other ({parts} s) + "
                         f"{self.crossing_s * 1e3:.1f} ms for the hidden states crossing the cut")
        for dev, plan in zip(self.devices, self.plans):
            lines += [f"[{dev}] " + line for line in plan.describe().splitlines()]
        return "\n".join(lines)

    def summary(self) -> dict:
        step = self.predicted_step_s
        return {"mode": "split", "cut": self.cut, "devices": [str(d) for d in self.devices],
                "micro_batches": self.micro_batches, "virtual_stages": self.chunks,
                "cuts": list(self.cuts or (self.cut,)),
                "predicted_peak_gb": [round(p.predicted_peak_bytes / GB, 3) for p in self.plans],
                "predicted_host_peak_gb": round(self.predicted_host_peak_bytes / GB, 3),
                "predicted_step_s": round(step, 4) if step is not None else None,
                "predicted_gpu_step_s": round(self.gpu_step_s, 4) if step is not None else None,
                "predicted_host_floor_s": round(self.host_floor_s, 4),
                "parts": [p.summary() for p in self.plans]}


def part_footprints(fp: ModelFootprint, block_trainable: list[int], other_trainable: int,
                    cut) -> tuple[ModelFootprint, ModelFootprint]:
    """The two parts' footprints: the first carries everything outside the blocks. ``cut``: the one cut, or
    interleaved every cut (2v - 1), each device's part then its chunks' blocks in order (chunk c on device c % 2)."""
    cuts = tuple(cut) if isinstance(cut, (tuple, list)) else (cut,)
    if not all(1 <= c < fp.num_blocks for c in cuts) or list(cuts) != sorted(set(cuts)) or len(cuts) % 2 == 0:
        raise ConfigError(f"cut={cut} must be between 1 and {fp.num_blocks - 1} ({fp.name} has "
                          f"{fp.num_blocks} blocks)" + (", increasing, an odd number of them" if len(cuts) > 1 else ""))
    edges = [0, *cuts, fp.num_blocks]
    chunks = [range(a, b) for a, b in zip(edges, edges[1:])]
    # Each part streams whole blocks: apply_offload streams blocks in parts (engine/offload/units.py) only for
    # a whole model, so the parts' plans must not count units (unit_bytes=[]); with them, a part holding one
    # double block got one slot for two units and the scheduler refused it.
    # The per-block lists the step time reads (FLOPs) are each part's own: with the whole model's, the second part
    # was timed with the first blocks' FLOPs (Flux: double blocks for single ones).
    def part(device: int, **changes) -> ModelFootprint:
        mine = [r for c, r in enumerate(chunks) if c % 2 == device]
        index = [i for r in mine for i in r]
        lists = {k: [v[i] for i in index] if (v := getattr(fp, k)) else v
                 for k in ("block_names", "block_bytes", "block_params", "block_token_params", "block_attention_tokens")}
        name = ", ".join(f"{r.start}-{r.stop - 1}" for r in mine)
        return replace(fp, name=f"{fp.name} blocks {name}", **lists, unit_bytes=[],
                       trainable_params=sum(block_trainable[i] for i in index), **changes)

    # The layers outside the blocks (outer_bytes among them) are the first part's.
    first = part(0)
    first = replace(first, trainable_params=first.trainable_params + other_trainable)
    return first, part(1, other_bytes=0, outer_bytes=0)


def _block_step_flops(fp: ModelFootprint, workload: Workload) -> list[float]:
    """Each block's FLOPs over a step of one sample (forward, recompute and backward), weighted as
    engine/offload/steptime.py spreads a part's compute over its blocks."""
    return [LINEAR_PASSES * lin + ATTENTION_PASSES * att for lin, att in block_flops(
        fp, workload.tokens, 1, workload.text_tokens, audio_tokens=workload.audio_tokens)]


def chunk_shares(fp: ModelFootprint, workload: Workload, cuts: tuple[int, ...]) -> tuple[float, ...]:
    """Each chunk's share of its device's part time: of the part's block FLOPs (forward, recompute and backward:
    engine/offload/steptime.py's weights), which is how the step-time model spreads a part's compute over its
    blocks."""
    flops = _block_step_flops(fp, workload)
    edges = [0, *cuts, fp.num_blocks]
    per_chunk = [sum(flops[a:b]) for a, b in zip(edges, edges[1:])]
    per_device = [sum(per_chunk[d::2]) for d in (0, 1)]
    return tuple(w / per_device[c % 2] if per_device[c % 2] else 0.0 for c, w in enumerate(per_chunk))


def interleaved_cuts(fp: ModelFootprint, workload: Workload, chunks: int) -> list[tuple[int, ...]]:
    """Candidate cuts for ``chunks`` per device: chunk boundaries at equal shares of the blocks' FLOPs within each
    device, the first device's share of the whole swept (so the planner, which keeps the shortest predicted step,
    balances time with streaming and the head counted, as it does with one cut). Each chunk keeps a block at least."""
    flops = _block_step_flops(fp, workload)
    n, total = fp.num_blocks, sum(flops) or 1.0
    before = [sum(flops[:i]) / total for i in range(n + 1)]  # share before block i
    out: list[tuple[int, ...]] = []
    for step in range(INTERLEAVE_SWEEP + 1):
        alpha = 0.25 + 0.5 * step / INTERLEAVE_SWEEP  # the first device's share of the blocks
        targets, acc = [], 0.0
        for c in range(2 * chunks - 1):
            acc += (alpha if c % 2 == 0 else 1 - alpha) / chunks
            targets.append(acc)
        cuts, low = [], 1
        for j, t in enumerate(targets):
            high = n - (2 * chunks - 1 - j)  # room for a block in each chunk after
            best = min(range(low, high + 1), key=lambda i: (abs(before[i] - t), i))
            cuts.append(best)
            low = best + 1
        if tuple(cuts) not in out:
            out.append(tuple(cuts))
    return out


def plan_split(fp: ModelFootprint, block_trainable: list[int], other_trainable: int, workload: Workload,
               offload: OffloadConfig, devices: tuple[torch.device, torch.device],
               budgets: tuple[Optional[int], Optional[int]], cut: Optional[int] = None,
               host_ram_bytes: Optional[int] = None, ram_budget_bytes: Optional[int] = None,
               machines: tuple[Optional[Machine], Optional[Machine]] = (None, None),
               compiled: bool = False, micro_batches: int = 1, host_extra: Optional[dict] = None,
               accumulation: int = 1, virtual_stages: int = 1, suggest: bool = True,
               processes: bool = False) -> SplitPlan:
    """The plan for both parts: at ``cut``, or at the best cut when it is None (see the module doc).
    ``micro_batches`` 0: auto (``_auto_micro_batches``).
    ``machines``: each device's link and GPU (engine/offload/link.py ``resolve_machine``; None: the default
    machine), so each part's step time is predicted where it runs. ``micro_batches`` > 1: pipelined (the batch
    in that many pieces, 1F1B; from ``accumulation``'s batches where the batch is smaller), refused where it cannot
    run (see ``check_pipelined``). ``virtual_stages`` v > 1: interleaved, the blocks in 2v chunks (every cut placed
    here); 0: the v of ``AUTO_VIRTUAL_STAGES`` with the shortest predicted step that fits. ``host_extra``: host bytes
    the run holds beside the parts (the modulation window's weights), in the RAM budget once. ``suggest``: where the
    pipelined step is host-bound, plan half as many micro-batches too and keep its step if shorter (``fewer_pieces``,
    in the plan's text). ``processes``: one process per part (``SplitPlan.host_floor_s``)."""
    def again(m: int, v: int, at: Optional[int]) -> SplitPlan:
        return plan_split(fp, block_trainable, other_trainable, workload, offload, devices, budgets, cut=at,
                          host_ram_bytes=host_ram_bytes, ram_budget_bytes=ram_budget_bytes, machines=machines,
                          compiled=compiled, micro_batches=m, host_extra=host_extra, accumulation=accumulation,
                          virtual_stages=v, suggest=False, processes=processes)

    if micro_batches == 0:
        return _auto_micro_batches(workload.batch, other_trainable, accumulation, virtual_stages, cut, again)
    span = 1
    if micro_batches > 1:
        span = check_pipelined(other_trainable, workload.batch, micro_batches, accumulation)
    auto_note = ""
    if virtual_stages == 0:
        check_virtual_stages(0, micro_batches, cut)  # auto places every cut
        choices = [v for v in AUTO_VIRTUAL_STAGES if v == 1 or (
            micro_batches > 1 and micro_batches % 2 == 0 and 2 * v <= fp.num_blocks)]
        if len(choices) == 1:
            auto_note = ("virtual_stages auto: 1, " + ("not pipelined" if micro_batches == 1 else
                         f"micro_batches {micro_batches} is odd (interleaving needs a multiple of 2)"))
    else:
        check_virtual_stages(virtual_stages, micro_batches, cut, fp.num_blocks)
        choices = [virtual_stages]
    found, last_error = {}, None
    for v in choices:
        try:
            found[v] = _best_split(fp, block_trainable, other_trainable, workload, offload, devices, budgets, cut,
                                   host_ram_bytes, machines, compiled, micro_batches, span, v)
            found[v].processes = processes  # (the cut itself is placed on the GPUs' time)
        except ConfigError as exc:
            last_error = exc
    if not found:
        raise last_error
    timed = {v: p.predicted_step_s for v, p in found.items() if p.predicted_step_s is not None}
    # host-bound, every v predicts the host's floor: the GPUs' time then decides
    v = (min(timed, key=lambda v: (timed[v], found[v].gpu_step_s, v)) if len(timed) == len(found) else min(found))
    best = found[v]
    if virtual_stages == 0 and len(choices) > 1:
        others = ", ".join(f"{timed[u]:.3f} s at {u}" for u in sorted(timed) if u != v)
        auto_note = (f"virtual_stages auto: {v}, the shortest predicted step ({timed[v]:.3f} s; {others})"
                     if timed else f"virtual_stages auto: {v} (no step time predicted)")
    pinned = sum(p.pinned_host_bytes for p in best.plans)
    if host_ram_bytes and pinned > offload.max_pinned_fraction * host_ram_bytes:
        raise ConfigError(
            f"the two parts together pin {pinned / GB:.1f} GB of host RAM; max_pinned_fraction="
            f"{offload.max_pinned_fraction} of {host_ram_bytes / GB:.0f} GB allows "
            f"{offload.max_pinned_fraction * host_ram_bytes / GB:.1f} GB. Raise the GPU budgets (more blocks "
            f"resident) or turn activation offload off")
    best.host_extra_bytes = sum((host_extra or {}).values())
    if ram_budget_bytes is not None:
        host = best.predicted_host_peak_bytes
        if host > ram_budget_bytes:
            raise ConfigError(
                f"the two parts together need {host / GB:.1f} GB of host RAM (pinned blocks, activations, the "
                f"process{', ' + ', '.join(host_extra) if host_extra else ''}) but ram_budget_gb allows {ram_budget_bytes / GB:.1f} GB. Raise the GPU budgets (more "
                f"blocks resident), turn activation offload off, or free host RAM / raise ram_budget_gb")
    if cut is not None:
        best.reason = "as asked"
    elif micro_batches > 1 and best.predicted_step_s is not None:
        best.reason = (f"the cut{'s' if best.chunks > 1 else ''} with the shortest predicted pipelined step "
                       f"({micro_batches} micro-batches)")
    else:
        best.reason = "the cut that streams the fewest bytes per step, peaks balanced"
    if auto_note:
        best.reason += "; " + auto_note
    if suggest and best.host_bound:
        fewer = _halved(best, again, workload.batch, span, virtual_stages, cut)
        if fewer is not None and fewer.predicted_step_s < best.predicted_step_s:
            best.fewer_pieces = (fewer.micro_batches, fewer.predicted_step_s)
    return best


def _halved(plan: SplitPlan, again, batch: int, span: int, virtual_stages: int,
            cut: Optional[int]) -> Optional[SplitPlan]:
    """The same batch in half as many micro-batches (twice the images each): half the host calls, a larger bubble.
    ``virtual_stages`` as asked: 0 chooses again; one part per GPU keeps the cut (one plan rather than a sweep of every
    cut); v > 1 only halves to an even count. None where it cannot run or has no step time."""
    half = plan.micro_batches // 2
    if half < 2 or span != 1 or batch % half or (virtual_stages > 1 and half % 2):
        return None
    try:
        fewer = again(half, virtual_stages, plan.cut if virtual_stages == 1 else None)  # v != 1 takes no cut
    except ConfigError:
        return None
    if fewer.predicted_step_s is None:
        return None
    if virtual_stages == 1 and cut is None:  # the cut was placed for the plan it halves
        fewer.reason = f"the cut with the shortest predicted pipelined step at {plan.micro_batches} micro-batches"
    return fewer


def _auto_micro_batches(batch: int, other_trainable: int, accumulation: int, virtual_stages: int,
                        cut: Optional[int], again) -> SplitPlan:
    """micro_batches 0: the batch one image a micro-batch (the smallest bubble; at most 64), halved while the step is
    host-bound and half as many predicts a shorter one; 1 (the parts one after the other) where the batch is one image
    or the LoRA reaches outside the blocks, refused where ``virtual_stages`` > 1 then has no pipeline to interleave.
    ``again(m, v, cut)`` plans at m micro-batches."""
    m = max((d for d in range(2, min(batch, 64) + 1)
             if batch % d == 0 and (virtual_stages <= 1 or d % 2 == 0)), default=1)
    why = ""
    if m > 1:
        try:
            check_pipelined(other_trainable, batch, m, accumulation)
        except ConfigError:
            m, why = 1, "LoRA on layers outside the transformer blocks"
    else:
        why = (f"batch_size {batch}: raise batch_size, or set micro_batches to fill the pipeline from gradient "
               f"accumulation" if batch == 1 or virtual_stages <= 1 else f"batch_size {batch} is odd")
    if m == 1 and virtual_stages > 1:
        raise ConfigError(f"Dual-GPU Split micro_batches 0 (auto) found no pipeline for virtual_stages "
                          f"{virtual_stages} to interleave ({why}); set virtual_stages to 0 or 1, or make batch_size "
                          f"even")
    plan = first = again(m, virtual_stages, cut)
    while plan.host_bound:
        fewer = _halved(plan, again, batch, 1, virtual_stages, cut)
        if fewer is None or fewer.predicted_step_s >= plan.predicted_step_s:
            break
        plan = fewer
    each = batch // plan.micro_batches
    if m == 1:
        note = f"micro_batches auto: 1, not pipelined ({why})"
    elif plan is first:
        note = f"micro_batches auto: {m}, " + (f"{each} images each" if each > 1 else "one image each")
    else:
        note = (f"micro_batches auto: {plan.micro_batches}, {each} images each (at {first.micro_batches} the step is "
                f"host-bound: {first.predicted_step_s:.3f} s predicted, against {plan.predicted_step_s:.3f} s)")
    plan.reason += "; " + note
    return plan


def _best_split(fp, block_trainable, other_trainable, workload, offload, devices, budgets, cut, host_ram_bytes,
                machines, compiled, micro_batches, span, chunks) -> SplitPlan:
    """The best of the candidate cuts for ``chunks`` per device (one cut: each block index, or ``cut``;
    interleaved: ``interleaved_cuts``): the shortest predicted pipelined step, else the fewest bytes streamed."""
    if chunks > 1:
        candidates = interleaved_cuts(fp, workload, chunks)
    else:
        candidates = [(c,) for c in ([cut] if cut is not None else range(1, fp.num_blocks))]
    best, best_key, last_error = None, None, None
    for cuts in candidates:
        parts = part_footprints(fp, block_trainable, other_trainable, cuts if chunks > 1 else cuts[0])
        plan = schedule(micro_batches, 2, chunks) if micro_batches > 1 else None
        edges = [0, *cuts, fp.num_blocks]
        sizes = {c: b - a for c, (a, b) in enumerate(zip(edges, edges[1:]))}
        try:
            plans = tuple(_part_plan(p, workload, offload, b, host_ram_bytes, compiled, m, stage, micro_batches,
                                     plan, sizes, chunks)
                          for stage, (p, b, m) in enumerate(zip(parts, budgets, machines)))
        except ConfigError as exc:
            last_error = exc
            continue
        candidate = SplitPlan(cuts[0], devices, plans, crossing_bytes=_crossing_bytes(fp, workload),
                              micro_batches=micro_batches, batches_per_pipeline=span,
                              cuts=cuts if chunks > 1 else (),
                              chunk_shares=chunk_shares(fp, workload, cuts) if chunks > 1 else (),
                              host_s_per_piece=host_s_per_piece(fp, compiled))
        peaks = [p.predicted_peak_bytes for p in plans]
        step = candidate.gpu_step_s  # the host's floor is the same at every cut
        if micro_batches > 1 and step is not None:
            key = (step, max(peaks) - min(peaks))  # balanced time: compute and streaming per part
        else:
            key = (sum(p.streamed_bytes_per_step + 2 * p.activation_bytes_per_step for p in plans),
                   max(peaks) - min(peaks))
        if best_key is None or key < best_key:
            best, best_key = candidate, key
    if best is None:
        where = f"at cut {cut}" if cut is not None else "at any cut"
        what = f" with virtual_stages {chunks}" if chunks > 1 else ""
        raise ConfigError(f"the split does not fit {where}{what} on {devices[0]} + {devices[1]}: {last_error}")
    return best


def check_pipelined(other_trainable: int, batch: int, micro_batches: int, accumulation: int = 1) -> int:
    """What a pipelined split cannot run, refused with the fix; else how many accumulated batches one pipeline spans:
    1 (the batch cut into ``micro_batches`` pieces), or, with a smaller batch, ``micro_batches / batch`` batches of
    gradient accumulation whose samples flow through the pipeline together (one optimizer step still sees every
    accumulated batch, so the gradient is the same)."""
    span = 1
    if batch < micro_batches:
        span = micro_batches // batch
        if micro_batches % batch or accumulation % span:
            raise ConfigError(
                f"Dual-GPU Split micro_batches={micro_batches} pipelines that many micro-batches at once, but "
                f"batch_size is {batch} with gradient_accumulation {accumulation}: raise Train LoRA's batch_size to "
                f"at least {micro_batches}, or make micro_batches a multiple of batch_size and gradient_accumulation "
                f"a multiple of micro_batches / batch_size (e.g. batch_size 1, gradient_accumulation "
                f"{micro_batches}), or lower micro_batches")
    if other_trainable:
        raise ConfigError(f"Dual-GPU Split micro_batches={micro_batches}: {other_trainable} LoRA elements sit outside "
                          f"the transformer blocks, whose gradients the pipelined split does not carry across the "
                          f"cut; target only the blocks' layers, or set micro_batches to 1")
    return span


def pipelined_step_s(part_seconds: list[float], micro_batches: int, crossing_s: float = 0.0,
                     batches: int = 1, chunks: int = 1, shares: tuple[float, ...] = ()) -> float:
    """A micro-step (one batch) of the split: the parts one after the other (one micro-batch), or the 1F1B makespan
    of ``micro_batches`` pieces, each part's time (the whole batch's) shared among them; where a pipeline spans
    ``batches`` accumulated batches, its makespan over the ``batches`` x the parts' time, per batch. Interleaved
    (``chunks`` per device), each chunk's op takes its ``shares`` of its device's part time, and each of the 2v - 1
    cuts costs a crossing."""
    if micro_batches <= 1:
        return sum(part_seconds) + crossing_s
    per = [s * batches / micro_batches for s in part_seconds]
    share = (lambda c: shares[c]) if shares else (lambda c: 1.0)
    return makespan(schedule(micro_batches, len(per), chunks),
                    lambda s, op: per[s] * share(chunk_of(op, s)) * (FORWARD_SHARE if op[0] == "F"
                                                                      else 1 - FORWARD_SHARE),
                    crossing_s * batches / (2 * micro_batches)) / batches


def _part_plan(fp: ModelFootprint, workload: Workload, offload: OffloadConfig, budget: Optional[int],
               host_ram_bytes: Optional[int], compiled: bool, machine: Optional[Machine], stage: int,
               micro_batches: int, ops=None, chunk_sizes: Optional[dict] = None, chunks: int = 1) -> Plan:
    """One part's plan, its peak counted over the whole step (engine/parallel/part_memory.py): the ring at the part's
    large blocks with the inputs held then, and, pipelined, the block inputs of every micro-batch (interleaved: every
    chunk pass) the schedule ``ops`` keeps in flight there (on the GPU: activation offload keeps one set per block, so
    it stays on only where a block never holds two: the second part when not interleaved), on the first part the head
    and the crossing, and interleaved the further crossings. Pipelined, each part runs the batch in ``micro_batches``
    pieces, and neither part holds the layers outside the blocks on the host (their hooks would run from two threads
    at once). Under a budget, the part is planned again for what the one-GPU formula leaves out until its whole peak
    fits."""
    changes: dict = {}
    if micro_batches > 1:
        changes["micro_batch_size"] = -(-workload.batch // micro_batches)
        if offload.streams:
            changes["outer_on_host"] = False
            if stage == 0 or chunks > 1:
                changes["activation_offload"] = False
    cfg = replace(offload, **changes) if changes else offload
    held = 1
    if micro_batches > 1:
        mine = ops[stage]
        held = in_flight(mine) if chunks == 1 else held_blocks(mine, chunk_sizes, stage) / fp.num_blocks
    head = micro_batches > 1 and stage == 0
    crossings = chunks - 1 if micro_batches > 1 else 0
    inner = budget
    for _ in range(REPLANS):
        plan = make_plan(fp, workload, cfg, inner, host_ram_bytes, compiled=compiled, machine=machine)
        peak, added = part_peak(plan, held, head, crossings)
        over = peak + plan.margin_bytes - budget if budget is not None else 0  # the allocator's margin, as one GPU's
        if over <= 0:
            break
        # What the one-GPU formula leaves out, taken from the budget it plans in, below this plan's own peak: the
        # next plan is one the formula puts at least that much lower (auto's plans are discrete).
        inner = min(inner, plan.predicted_peak_bytes + plan.margin_bytes) - over
    else:
        raise ConfigError(f"{fp.name} does not fit its {budget / GB:.1f} GB budget once the whole step's peak is "
                          f"counted ({peak / GB:.2f} GB)")
    for name, extra in added.items():
        plan.breakdown[name] = extra
    plan.predicted_peak_bytes = peak
    plan.budget_bytes = budget
    return plan


def _crossing_bytes(fp: ModelFootprint, workload: Workload) -> int:
    """The hidden states at the cut per micro-step (what a part's step time covers): the batch's tokens x
    hidden size in the activation dtype (a dual-stream model's text tokens cross too: the workload counts them)."""
    return int(workload.batch * workload.tokens * fp.hidden_size * fp.act_bytes_per_elem)


def trainable_per_block(model: nn.Module, family) -> tuple[list[int], int]:
    """LoRA elements inside each block (execution order) and outside all blocks."""
    blocks = named_blocks(model, family)
    per_block = [sum(p.numel() for p in b.parameters() if p.requires_grad) for _, b in blocks]
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return per_block, total - sum(per_block)


def _to(device: torch.device):
    def move(x):
        return x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) and x.device != device else x

    return move


class SplitHandle:
    """Both parts' offload handles, the device hooks, and how to undo them."""

    def __init__(self, model: nn.Module, plan: SplitPlan, handles, hooks, restore, pipeline=None):
        self.model, self.plan, self.handles, self._hooks = model, plan, handles, hooks
        self._restore = restore  # (tensor, its data before) for the frozen tensors outside the blocks
        self.device = plan.devices[0]
        self.pipeline = pipeline  # PipelineRunner (engine/parallel/pipeline.py) when micro_batches > 1
        self.module_devices: dict[int, torch.device] = {}  # id(module inside a block) -> its part's device
        self.remote_modules: set[int] = set()  # id(module inside a block the other process runs): a process split

    @property
    def devices(self) -> tuple[torch.device, torch.device]:
        return self.plan.devices

    def end_step(self) -> None:
        for h in self.handles:
            h.end_step()

    def stats(self) -> dict:
        out = {"cut": self.plan.cut, "parts": [h.stats() for h in self.handles]}
        if self.plan.chunks > 1:
            out["cuts"] = list(self.plan.cuts)
        if self.pipeline is not None:
            out.update(peer_bytes_copied=self.pipeline.bytes_copied,
                       pipelined_micro_batches=self.pipeline.micro_batches_run)
        return out

    def peak_report(self, step: int = 1) -> str:
        return "; ".join(f"[{h.device}] {h.peak_report(step)}" for h in self.handles)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for h in reversed(self.handles):
            h.remove()
        for t, data in self._restore:
            t.data = data
        self._restore.clear()


def apply_split(model: nn.Module, family, plan: SplitPlan, offload: OffloadConfig, callback=None,
                _engine_factory=None, ranks=None, release_remote: bool = False) -> SplitHandle:
    """Place (and stream) each part on its device per ``plan``; LoRA must be attached and gradient
    checkpointing enabled. ``_engine_factory``: the copy engine for tests (CPU). ``ranks`` with a ``stage``: this
    process runs that part only (engine/parallel/process_split.py), and with ``release_remote`` (the model is the
    run's own, dropped after it) lets go of the other part's frozen weights."""
    from ..offload.streamer import apply_offload

    if ranks is not None and ranks.stage is not None:
        return _apply_stage(model, family, plan, offload, ranks, callback, _engine_factory, release_remote)
    blocks = named_blocks(model, family)
    # Each device's part: its chunks' blocks in execution order (one range each unless interleaved), one streamer
    # and one plan per device: the scheduler indexes the part's blocks 0..n-1 whatever their places in the model, and
    # a micro-batch visits them in that order forward and back, as its cycle expects (the interleaved order between
    # micro-batches is what it resyncs to, as with one chunk each).
    chunk_of = {id(b): c for c, r in enumerate(plan.chunk_ranges) for i in r for b in [blocks[i][1]]}
    parts = tuple([blocks[i] for c, r in enumerate(plan.chunk_ranges) if c % 2 == d for i in r] for d in (0, 1))
    dev0, dev1 = plan.devices
    block_ids = {id(b) for _, b in blocks}
    restore = outside_to(model, block_ids, dev0)  # everything outside the blocks (and its LoRA, if any)
    if callback is not None:
        callback.log(plan.describe().splitlines()[0])  # each part's own plan follows, from apply_offload
    handles = []
    try:
        for part, dev, part_plan in zip(parts, plan.devices, plan.plans):
            handles.append(apply_offload(model, family, offload, dev, callback, plan=part_plan, blocks=part,
                                         _engine_factory=_engine_factory))
    except BaseException:
        for h in handles:
            h.remove()
        for t, data in restore:
            t.data = data
        raise
    device_of = {id(b): dev for part, dev in zip(parts, plan.devices) for _, b in part}
    pipeline = None
    if plan.micro_batches > 1:
        from .pipeline import PipelineRunner

        pipeline = PipelineRunner(plan.devices, chunk_of, {id(m): d for d, part in enumerate(parts) for _, b in part
                                                          for m in b.modules()},
                                  plan.batches_per_pipeline, plan.chunks)
    hooks = [hook for part, dev in zip(parts, plan.devices) for hook in _device_hooks(part, dev)]
    if pipeline is not None and pipeline.copies.cuda:
        hooks += [block.register_forward_pre_hook(pipeline.throttle) for _, block in parts[0]]
    hooks += _head_hooks(model, dev0, pipeline)
    offloaders = {id(b): h.activations for part, h in zip(parts, handles) if h.activations is not None
                  for _, b in part}
    _install_checkpoint(model, device_of, offloaders, pipeline)
    handle = SplitHandle(model, plan, handles, hooks, restore, pipeline)
    # Where each module inside a block runs (the modulation window keeps a flagged module's outputs there).
    handle.module_devices = {id(m): dev for part, dev in zip(parts, plan.devices) for _, b in part for m in b.modules()}
    return handle


def _apply_stage(model, family, plan: SplitPlan, offload: OffloadConfig, ranks, callback=None,
                 _engine_factory=None, release_remote: bool = False) -> SplitHandle:
    """Place (and stream) this process's part only, on its device, with everything outside the blocks there too (each
    process runs those layers itself); the model's checkpoint function runs the other part's blocks through the
    runner (engine/parallel/process_split.py)."""
    from ..offload.streamer import apply_offload
    from .process_split import RankPipeline

    if plan.chunks > 1:
        raise ConfigError(f"virtual_stages={plan.chunks}: one process per GPU runs one part each (virtual_stages 1) "
                          f"so far; set virtual_stages 1, or use the threaded split")
    blocks = named_blocks(model, family)
    block_ids = {id(b) for _, b in blocks}
    outside = [n for m in _non_block_modules(model, block_ids) for n, p in m.named_parameters(recurse=False)
               if p.requires_grad]
    if outside:
        raise ConfigError(f"LoRA outside the transformer blocks ({outside[0]}, ...) with one process per GPU: its "
                          f"gradient would come from both processes; target the blocks only")
    stage, dev = ranks.stage, plan.devices[ranks.stage]
    part = [blocks[i] for i in plan.chunk_ranges[stage]]
    restore = outside_to(model, block_ids, dev)
    if callback is not None:
        callback.log(plan.describe().splitlines()[0])
        callback.log(f"process split: this process (stage {stage}) runs blocks {plan.chunk_ranges[stage].start}-"
                     f"{plan.chunk_ranges[stage].stop - 1} on {dev}")
    try:
        handle = apply_offload(model, family, offload, dev, callback, plan=plan.plans[stage], blocks=part,
                               _engine_factory=_engine_factory)
    except BaseException:
        for t, data in restore:
            t.data = data
        raise
    ranks.owned = {id(p) for _, b in part for p in b.parameters() if p.requires_grad}
    ranks.device = dev
    remote = [b for i, (_, b) in enumerate(blocks) if i not in plan.chunk_ranges[stage]]  # the other process's
    if release_remote:  # never read here: the other process runs these blocks (their LoRA stays, for the exchange)
        released = _release_frozen(remote)
        if callback is not None and released:
            callback.log(f"process split: released {released / GB:.2f} GB of the other part's frozen weights")
    runner = RankPipeline(stage, dev, id(blocks[plan.cut][1]), plan.batches_per_pipeline)
    hooks = _device_hooks(part, dev) + _head_hooks(model, dev)
    offloaders = {id(b): handle.activations for _, b in part} if handle.activations is not None else {}
    _install_checkpoint(model, {id(b): dev for _, b in part}, offloaders, runner)
    out = SplitHandle(model, plan, [handle], hooks, restore, runner)
    out.module_devices = {id(m): dev for _, b in part for m in b.modules()}
    out.remote_modules = {id(m) for b in remote for m in b.modules()}
    return out


def _device_hooks(part, device: torch.device) -> list:
    """Each block of ``part`` gets its tensor arguments on ``device``."""
    return [block.register_forward_pre_hook(_arguments_to(device), with_kwargs=True) for _, block in part]


def _head_hooks(model: nn.Module, device: torch.device, pipeline=None) -> list:
    """The layers after the blocks (the final norm and projection) get their arguments on ``device``."""
    return [child.register_forward_pre_hook(_arguments_to(device, pipeline), with_kwargs=True)
            for _, child in model.named_children() if not isinstance(child, nn.ModuleList)]


def _release_frozen(blocks) -> int:
    """The frozen plain tensors of ``blocks`` replaced by empty ones (their memory goes back once nothing else holds
    it); returns the bytes let go. Tensor subclasses (quantized weights) are left as they are."""
    released = 0
    for block in blocks:
        for t in [*block.parameters(), *block.buffers()]:
            if not t.requires_grad and type(t.data) is torch.Tensor and t.numel():
                released += t.numel() * t.element_size()
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return released


def outside_to(model: nn.Module, block_ids: set[int], device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every tensor outside the blocks (the modulation window's excepted: it holds those) moved to ``device``; returns
    (tensor, its data before) for the frozen ones, which ``SplitHandle.remove`` puts back."""
    from ..offload.host import step_constant_tensors

    restore: list[tuple[torch.Tensor, torch.Tensor]] = []
    window = step_constant_tensors(model)  # engine/train/step_window.py
    for t in [t for m in _non_block_modules(model, block_ids) for t in list(m.parameters(recurse=False))
              + list(m.buffers(recurse=False))]:
        if t.device != device and id(t) not in window:
            if not t.requires_grad:
                restore.append((t, t.data))
            t.data = t.data.to(device)
    return restore


def _non_block_modules(model: nn.Module, block_ids: set[int]):
    """Every module that is not inside a block (the model itself included)."""
    stack = [model]
    while stack:
        m = stack.pop()
        if id(m) in block_ids:
            continue
        yield m
        stack.extend(m.children())


def _arguments_to(device: torch.device, pipeline=None):
    def hook(module, args, kwargs):
        if pipeline is not None:  # inside a pipelined forward, the head's inputs cross back first
            args, kwargs = pipeline.head_arguments(args, kwargs)
        move = _to(device)
        return tree_map(move, args), tree_map(move, kwargs)

    return hook


def _install_checkpoint(model: nn.Module, device_of: dict[int, torch.device], offloaders: dict,
                        pipeline=None) -> None:
    """The model's checkpoint function (what diffusers calls for each block while training): move the
    block's arguments to its device, then checkpoint it as that part's activation offloader would, or with
    the engine's block checkpoint (engine/offload/block_checkpoint.py). Pipelined, the arguments cross the cut as leaves
    (engine/parallel/pipeline.py); with one process per part, the other part's blocks are the runner's."""

    def checkpoint(block, *args):
        if id(block) not in device_of:  # a block the other process runs (engine/parallel/process_split.py)
            return pipeline.remote_block(block, args)
        if pipeline is not None:
            args = pipeline.block_arguments(block, args)
        args = tree_map(_to(device_of[id(block)]), args)
        offloader = offloaders.get(id(block))
        if offloader is not None:
            out = offloader.checkpoint(block, *args)
        else:
            out = checkpoint_block(block, *args)
        return pipeline.block_outputs(block, out) if pipeline is not None else out

    model.enable_gradient_checkpointing(gradient_checkpointing_func=checkpoint)


def check_split_devices(split, offload: Optional[OffloadConfig]) -> None:
    """Clear errors before anything is loaded: GPUs that are not there, streaming on a CPU, no checkpointing."""
    if offload is not None and not offload.gradient_checkpointing:
        raise ConfigError("split mode needs gradient_checkpointing=True in Offload Config: the blocks' arguments "
                          "cross the cut inside the checkpoint function")
    for name in split.devices:
        dev = torch.device(name)
        if dev.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if dev.index is not None and dev.index >= count:
                raise ConfigError(
                    f"split uses {name}, but this machine has {count} CUDA GPU{'s' if count != 1 else ''}"
                    + (f" ({', '.join(f'cuda:{i}' for i in range(count))})" if count else "")
                    + "; name GPUs that exist in Dual-GPU Split's devices, or train on one GPU without it")
        elif offload is not None and offload.streams and offload.mode == "stream":
            raise ConfigError(f"split device {name} is not a CUDA GPU; streaming needs one (use mode='resident' "
                              f"to test a split on the CPU)")


def given_budgets_gb(split, offload: OffloadConfig) -> tuple[float, ...]:
    """Each device's budget as the user gave it, in GB (0: none given): the split's own value, else Offload Config's
    vram_budget_gb. Mode 'auto' only (all 0 otherwise). The budgets planned from and the allocator's caps."""
    if offload.mode != "auto":
        return tuple(0.0 for _ in split.devices)
    return tuple(gb or offload.vram_budget_gb or 0.0 for gb in split.vram_budget_gb)


def split_budgets(split, offload: OffloadConfig) -> tuple[Optional[int], Optional[int]]:
    """Each device's budget in bytes for mode='auto' (None otherwise): the one given (``given_budgets_gb``), else
    90% of what is free on that GPU now."""
    if offload.mode != "auto":
        return (None, None)
    out = []
    for name, gb in zip(split.devices, given_budgets_gb(split, offload)):
        dev = torch.device(name)
        if gb:
            out.append(int(gb * GB))
        elif dev.type == "cuda":
            out.append(int(0.9 * torch.cuda.mem_get_info(dev)[0]))
        else:
            raise ConfigError(f"split device {name}: give a vram_budget_gb for it (auto plans from a budget)")
    return tuple(out)
