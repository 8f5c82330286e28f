"""How long a training step takes under an offload plan, on a given link: pure arithmetic (no device), so
``auto`` can choose the fastest plan that fits before anything is loaded (engine/offload/plan.py).

The model, per micro-step (one forward + backward; the loop synchronises after the optimizer step):

* **compute**: the resident step's compute, either measured (``compute_s_per_step``: the step time of the same
  model, workload and compile mode with every block resident) or estimated from FLOPs at the GPU's dense bf16
  peak x an efficiency fitted on the H100 (``FLOP_EFFICIENCY``). Per block, forward FLOPs are
  ``2 x frozen params x B x T`` (the Linears) + ``4 x B x T^2 x D`` (attention); LoRA on a frozen base needs no
  weight gradient, so a checkpointed step is forward + recompute + input-gradient backward: 3 x the Linears,
  4.5 x the attention (its backward is ~2.5 forwards). The step's compute is spread over the blocks (or their
  streaming parts, by bytes) by their exact FLOPs, each Linear on the rows it multiplies (``block_flops``:
  a Flux.1 double block has 2.4x a single block's bytes but the same FLOPs, so its copy outlasts its forward):
  a forward visit runs the forward share, a backward visit the recompute + backward.
* **copies**: the scheduler (schedule.py) is driven through the exact visit sequence of training
  (0..N-1 forward, N-1..0 backward) with a copy engine that keeps a GPU timeline, as
  ``CudaCopyEngine`` orders its work (engine/offload/streamer.py): a copy starts when the copy stream is free,
  the compute stream is past the point where it was issued (its buffer's allocation: the end of the previous
  visit) and the slot's previous block was released; it takes ``bytes / link``; a visit's compute starts when
  its block's copy has landed (the stall).
* **activation offload**: each unit's inputs (B x T x D x 2 bytes) go to the host after its forward on their
  own lane (device-to-host: the other direction of the link, which nothing else uses) and come back one unit
  ahead of its backward on their own stream, sharing the host-to-device bandwidth with the weight copies (half
  each while both run; the weights are delayed by the activations' bytes); the unit's backward waits for them.
* **disk** (the disk tier, ``plan.disk_blocks``): a disk block's load first reads its bytes from the slab file into
  a pinned staging slot (``bytes / disk rate``), then copies them to the GPU. Reads run one after the other in the
  order the scheduler loads blocks (forward then backward), as far ahead as the staging ring allows: the j-th read
  needs the slot of read j - ``staging_slots``, free once that block's copy to the GPU has landed. A load's copy
  starts when its read has landed (so a disk-bound step stalls on the read, through the copy).
* The step ends when compute and every copy have finished (the loop synchronises). Each pipe (compute, link, disk)
  bounds it from below: step >= max(compute, link bytes / link rate, disk bytes / disk rate).

* Each visit of a streamed (or activation-offloaded) unit adds ``VISIT_OVERHEAD_S`` of compute: the overhead of
  streaming itself (checkpoint boundaries, events, a compiled graph per unit; issue 26 item 1), fitted.

What it leaves out: host time (Python, launches: eager steps are launch-bound and the measured
``compute_s_per_step`` includes that) and copies slowed by concurrent HBM traffic. Only the pipelined split, whose
micro-batches all go through one interpreter, takes a host floor (``host_s_per_piece``, engine/parallel/split.py).
bench/bench_memory.py prints the prediction beside the measured step so a drift shows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .schedule import BlockScheduler

GB = 1e9
# Dense bf16 tensor throughput (FLOP/s, fp32 accumulate, no sparsity) by a substring of the CUDA device name,
# most specific first. Vendor datasheets.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756), ("H100 NVL", 835), ("H200", 989), ("H100", 989), ("GH200", 989), ("B200", 2250),
    ("A100", 312), ("A800", 312), ("L40S", 362), ("L40", 181), ("L4", 121), ("A10", 125),
    ("RTX 6000 Ada", 364), ("A6000", 155), ("RTX 5090", 209), ("4090", 165), ("4080", 97), ("4070 Ti", 80),
    ("4070", 58), ("4060", 44), ("3090", 71), ("3080", 60), ("3070", 41), ("3060", 25),
)
DEFAULT_PEAK_TFLOPS = 100.0  # an unknown GPU
# Achieved / peak over a Flux.1-dev 1024² LoRA step with every block resident (the calibration's FLOP count: every
# frozen element on every token, 3.94e14 per step): H100 80GB HBM3, 2026-11-25 (issue 26): compiled blocks 0.689 s,
# eager 0.976 s. The count is a size measure fitted across resolutions (2048² within 10%), not the exact FLOPs:
# the exact per-block counts (``block_flops``) only decide where a step's compute goes.
FLOP_EFFICIENCY = {"compiled": 0.578, "eager": 0.408}
# Eager int8 slab layers dequantise in their own kernels (compiled, the dequant fuses into the matmul): Qwen-Image
# 1024² int8 auto 4 GB eager 1.30 s against 1.18-1.27 s bf16 resident with no copy stall (bench/NOTES.md).
EAGER_INT8_FACTOR = 1.07
# Recompute in token chunks reruns the token-wise parts (another forward of the MLPs): Flux.1 2048², 4 chunks,
# 1.07x the resident step (bench/results.jsonl 2026-11-23). Smaller chunks are launch-bound (1024², 4 chunks,
# 1.69x); auto only chunks when nothing else fits, so this only ranks plans that all chunk.
CHUNKED_FACTOR = 1.07
# Shares of one unit's work: forward 1, recompute 1, backward 1 (Linears: the input gradient only);
# attention backward ~2.5 forwards.
LINEAR_PASSES, ATTENTION_PASSES = 3.0, 4.5
# Compute-stream time each visit of a streamed or activation-offloaded unit adds on top of the resident compute
# (its checkpoint boundary, the streamer's events and waits, a graph per unit when compiled). Fitted on four H100
# Flux.1-dev 1024² compiled rows at ~54 GB/s (bench/results.jsonl, 2026-11-25/26): bf16 `auto` 8 GB (53 blocks,
# prefetch 2), int8 and bf16 streamed + activation offload with prefetch 1 and 2; each alone wants 0.6-0.9 ms. This is
# the overhead issue 26 item 1 is removing: refit it when that lands (bench/bench_memory.py prints both figures).
VISIT_OVERHEAD_S = 0.0008
# Host (Python) seconds of one micro-batch through one block of a pipelined split's checkpointed LoRA step (its
# forward, recompute and backward's operator calls: a count, whatever the width), both parts' threads in one process.
# Fitted on the H200 machine's host CPU (16 cores; one GPU, 2026-11-29, bench/bench_parallel.py --narrow: each block
# at a tiny width, every operator, next to no GPU time, both parts on cuda:0; three timed steps each), 8 micro-batches:
# eager, Flux.1-dev's 57 blocks 4.934 s (v = 1) and 4.935 s (v = 2), Flux.2-dev int8's 56 blocks 4.846 s (v = 4):
# 10.8 ms a block, the int8 slab's calls no dearer; compiled, Flux.1-dev 4.479 s and 4.097 s: 9.4 ms (one micro-batch
# alone compiled took 0.405 s, 7.1 ms a block: the threads cost the rest). One host's figures: a CPU with faster single
# threads needs less.
HOST_S_PER_BLOCK = {"compiled": 0.0094, "eager": 0.0108}
DEFAULT_LINK_BYTES_PER_S = 25 * GB  # no probe (CPU, tests): a PCIe 4.0 x16 board, the common case
# A plan with disk blocks on a machine whose disk was not probed (an explicit stream plan on the CPU, tests): a PCIe
# 4.0 NVMe drive's sequential read. auto never puts blocks on disk without a measured rate.
DEFAULT_DISK_BYTES_PER_S = 3.5 * GB


@dataclass(frozen=True)
class Machine:
    """What the step-time model knows about the machine: the pinned host-to-GPU link, the GPU's peak, and the read
    rate of the disk the slab file is on (None: no disk tier: the model is not a slab, or its disk was not probed,
    so the planner puts no block on disk)."""

    link_bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S
    peak_flops: float = DEFAULT_PEAK_TFLOPS * 1e12
    name: str = ""
    source: str = "default"  # where the link figure came from: probe, cache, env, emulated, default
    disk_bytes_per_s: Optional[float] = None  # engine/offload/disk.py: disk_rate_for(slab path)

    def describe(self) -> str:
        disk = f", disk {self.disk_bytes_per_s / GB:.1f} GB/s" if self.disk_bytes_per_s else ""
        return f"{self.link_bytes_per_s / GB:.1f} GB/s host->GPU ({self.source}){disk}"


def peak_flops_for(gpu_name: str) -> float:
    """The GPU's dense bf16 peak, FLOP/s (DEFAULT_PEAK_TFLOPS when the name is not in the table)."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in gpu_name.lower():
            return tflops * 1e12
    return DEFAULT_PEAK_TFLOPS * 1e12


@dataclass
class StepTime:
    seconds: float  # one optimizer step (all micro-batches)
    compute_s: float  # the resident compute it contains
    stall_s: float  # compute waiting for copies (weights and activations)
    link_busy_s: float  # host->GPU link busy (weights + restored activations)
    compute_source: str  # "measured" | "FLOPs"
    disk_busy_s: float = 0.0  # the disk reading disk-tier blocks

    def as_dict(self) -> dict:
        return {"predicted_step_s": round(self.seconds, 4), "predicted_compute_s": round(self.compute_s, 4),
                "predicted_stall_s": round(self.stall_s, 4), "predicted_link_busy_s": round(self.link_busy_s, 4),
                "predicted_disk_busy_s": round(self.disk_busy_s, 4), "compute_source": self.compute_source}


def block_params(fp) -> list[int]:
    """Frozen elements per block (the footprint's, or its bytes at the activation dtype's size)."""
    if fp.block_params:
        return list(fp.block_params)
    return [b // fp.act_bytes_per_elem for b in fp.block_bytes]


def block_flops(fp, tokens: int, batch: int, text_tokens: int = 0, exact: bool = True,
                audio_tokens: int = 0) -> list[tuple[float, float]]:
    """(Linear, attention) forward FLOPs of each block for ``batch`` samples of ``tokens`` tokens, of which
    ``text_tokens`` are the text's, and ``audio_tokens`` of a joint model's audio stream beside them. With the
    footprint's ``block_token_params`` (and ``exact``) each Linear counts the rows it really multiplies (a dual-stream
    block's image Linears the image tokens, its text Linears the text's, a modulation Linear one row per sample, an
    audio-stream Linear the audio tokens: what torch's FLOP counter gives, tests/test_step_flops.py) and each
    attention its block's sequence; otherwise every frozen element multiplies every token."""
    if not (exact and fp.block_token_params):
        attention = 4.0 * batch * tokens * tokens * fp.hidden_size
        return [(2.0 * p * batch * tokens, attention) for p in block_params(fp)]
    rows = {"all": tokens, "image": tokens - text_tokens, "text": text_tokens, "vector": 1, "audio": audio_tokens}
    seqs = fp.block_attention_tokens or ["all"] * len(fp.block_token_params)
    return [(2.0 * batch * sum(n * rows[kind] for kind, n in params.items()),
             4.0 * batch * rows[seq] ** 2 * fp.hidden_size) for params, seq in zip(fp.block_token_params, seqs)]


def estimate_compute_s(fp, tokens: int, batch: int, peak_flops: float, compiled: bool,
                       recompute_chunks: int = 1) -> float:
    """The resident step's compute from FLOPs (one forward + recompute + backward of ``batch`` samples), by the
    calibration's count (every frozen element on every token; ``FLOP_EFFICIENCY``)."""
    flops = sum(LINEAR_PASSES * lin + ATTENTION_PASSES * att
                for lin, att in block_flops(fp, tokens, batch, exact=False))
    seconds = flops / (peak_flops * FLOP_EFFICIENCY["compiled" if compiled else "eager"])
    if _slab_blocks(fp) and not compiled:
        seconds *= EAGER_INT8_FACTOR
    return seconds * (CHUNKED_FACTOR if recompute_chunks > 1 else 1.0)


def _slab_blocks(fp) -> bool:
    """The blocks are an int8 or int4 slab: ~1 or ~0.56 bytes a weight (EAGER_INT8_FACTOR was fitted on int8)."""
    return bool(fp.block_params) and sum(fp.block_bytes) < 1.5 * sum(fp.block_params)


def host_s_per_piece(fp, compiled: bool) -> float:
    """The Python time of one micro-batch through every block of ``fp`` (forward, recompute, backward): what the one
    interpreter spends launching it, whichever GPU then runs it (``HOST_S_PER_BLOCK``)."""
    return fp.num_blocks * HOST_S_PER_BLOCK["compiled" if compiled else "eager"]


class _Timeline:
    """A copy engine for BlockScheduler that keeps the GPU's timeline instead of copying (seconds)."""

    def __init__(self, sizes: Sequence[int], num_slots: int, link: float, disk_units: frozenset = frozenset(),
                 disk_rate: float = 0.0, staging_slots: int = 1):
        self.sizes, self.link = sizes, link
        self.now = 0.0  # end of the last compute enqueued on the compute stream
        self.h2d_free = 0.0  # the host->device link (weights and restored activations)
        self.ready = [0.0] * num_slots
        self.released = [0.0] * num_slots
        self.stall = 0.0
        self.busy = 0.0
        # The disk tier: reads in load order, each into a staging slot freed when the copy made from it landed.
        self.disk_units, self.disk_rate = disk_units, disk_rate
        self.disk_free = 0.0
        self.staging_free = [0.0] * max(1, staging_slots)
        self.reads = 0
        self.disk_busy = 0.0

    def read(self, unit: int) -> float:
        """When the disk block's bytes are in a staging slot (its read, as early as the ring allows)."""
        slot = self.reads % len(self.staging_free)
        self.reads += 1
        seconds = self.sizes[unit] / self.disk_rate
        self.disk_free = max(self.disk_free, self.staging_free[slot]) + seconds
        self.disk_busy += seconds
        return self.disk_free

    def copy_in(self, nbytes: int, after: float) -> float:
        """A weight copy: the copy stream runs its copies one after the other."""
        start = max(self.h2d_free, after)
        self.h2d_free = start + nbytes / self.link
        self.busy += nbytes / self.link
        return self.h2d_free

    def copy_beside(self, nbytes: int, after: float) -> float:
        """An activation copy on its own stream: it shares the link with a weight copy in flight (half the
        bandwidth each) instead of queueing behind it, and delays the weight copies by its bytes."""
        seconds = nbytes / self.link
        busy_then = self.h2d_free > after
        self.h2d_free = max(self.h2d_free, after) + seconds
        self.busy += seconds
        return after + (2 * seconds if busy_then else seconds)

    def load(self, block, slot, evicted):
        # CudaCopyEngine: the buffer is allocated on the compute stream (the copy waits for what compute has
        # queued so far) and the copy waits for the slot's release; a replaced buffer's old copy must have landed.
        self.now = max(self.now, self.ready[slot])
        after = max(self.now, self.released[slot])
        if block in self.disk_units:
            read = self.read(block)
            self.ready[slot] = self.copy_in(self.sizes[block], max(after, read))
            self.staging_free[(self.reads - 1) % len(self.staging_free)] = self.ready[slot]
        else:
            self.ready[slot] = self.copy_in(self.sizes[block], after)

    def wait_ready(self, slot):
        if self.ready[slot] > self.now:
            self.stall += self.ready[slot] - self.now
            self.now = self.ready[slot]

    def release(self, slot):
        self.released[slot] = self.now


def simulate_step_time(sizes: Sequence[int], streamed: Sequence[int], prefetch_depth: int, num_slots: int,
                       fwd_s: Sequence[float], bwd_s: Sequence[float], link: float,
                       act_bytes: Sequence[int] = (), steps: int = 3,
                       visit_overhead_s: float = 0.0, disk_units: Sequence[int] = (), disk_rate: float = 0.0,
                       staging_slots: int = 1) -> tuple[float, float, float, float]:
    """(seconds, stall s, link busy s) of the last of ``steps`` micro-steps over units of ``sizes`` bytes of which
    ``streamed`` live on the host; ``fwd_s`` / ``bwd_s``: each unit's forward and recompute + backward compute;
    ``act_bytes``: each unit's offloaded inputs (empty: no activation offload); ``visit_overhead_s``: added to each
    visit of a streamed unit (every unit with activation offload); ``disk_units``: streamed units read from disk
    at ``disk_rate`` through ``staging_slots`` staging buffers on each load. Returns (seconds, stall s, link busy s,
    disk busy s)."""
    managed = set(range(len(sizes))) if act_bytes else set(streamed)
    fwd_s = [f + (visit_overhead_s if u in managed else 0.0) for u, f in enumerate(fwd_s)]
    bwd_s = [b + (visit_overhead_s if u in managed else 0.0) for u, b in enumerate(bwd_s)]
    n = len(sizes)
    if disk_units and not disk_rate > 0:
        raise ValueError("disk units need a disk read rate (Machine.disk_bytes_per_s)")
    eng = _Timeline(sizes, num_slots, link, frozenset(disk_units), disk_rate, staging_slots)
    sched = BlockScheduler(n, streamed, num_slots, prefetch_depth, eng) if streamed else None
    if sched is not None:
        sched.prime()
    d2h_free, start, stall0, busy0, disk0 = 0.0, 0.0, 0.0, 0.0, 0.0
    for _ in range(steps):
        start, stall0, busy0, disk0 = eng.now, eng.stall, eng.busy, eng.disk_busy
        for u in range(n):  # forward
            if sched is not None:
                sched.visit(u)
            eng.now += fwd_s[u]
            if act_bytes and act_bytes[u]:  # inputs out after the forward, on their own lane
                d2h_free = max(d2h_free, eng.now) + act_bytes[u] / link
        restored = {n - 1: eng.now}  # the last unit's inputs: its backward follows its forward at once
        for u in range(n - 1, -1, -1):  # recompute + backward
            if sched is not None:
                sched.visit(u)
            if act_bytes:
                if u - 1 >= 0:  # the next unit's inputs come back while this one computes (kept ones: on the GPU)
                    restored[u - 1] = (eng.copy_beside(act_bytes[u - 1], max(eng.now, d2h_free)) if act_bytes[u - 1]
                                       else eng.now)
                if restored[u] > eng.now:
                    eng.stall += restored[u] - eng.now
                    eng.now = restored[u]
            eng.now += bwd_s[u]
        eng.now = max(eng.now, eng.h2d_free, d2h_free)  # the loop synchronises after the step
    return eng.now - start, eng.stall - stall0, eng.busy - busy0, eng.disk_busy - disk0


def predict_step_time(plan, machine: Machine, compute_s_per_step: Optional[float] = None,
                      compiled: bool = False) -> StepTime:
    """The plan's step time on ``machine``. ``compute_s_per_step``: the measured resident step of the same model,
    workload and compile mode (its batch); None: estimated from FLOPs (``estimate_compute_s``)."""
    fp, wl = plan.footprint, plan.workload
    micro = plan.micro_batch or wl.batch
    pieces = -(-wl.batch // micro)
    if compute_s_per_step is not None:
        compute, source = compute_s_per_step * (CHUNKED_FACTOR if plan.recompute_chunks > 1 else 1.0), "measured"
    else:
        compute = estimate_compute_s(fp, wl.tokens, wl.batch, machine.peak_flops, compiled, plan.recompute_chunks)
        source = "FLOPs"
    if plan.mode == "resident":
        return _with_preservation(StepTime(compute, compute, 0.0, 0.0, source), fp, wl, micro)
    # Units as the scheduler streams them; each block's work split over its parts by bytes (attention with the
    # first part, where it runs).
    sizes, groups = fp.stream_units(plan.split_blocks)
    fwd, bwd = [0.0] * len(sizes), [0.0] * len(sizes)
    flops = block_flops(fp, wl.tokens, micro, wl.text_tokens, audio_tokens=wl.audio_tokens)
    total = sum(LINEAR_PASSES * lin + ATTENTION_PASSES * att for lin, att in flops)
    per_flop = compute / pieces / total
    for (lin, att), units in zip(flops, groups):
        block_total = sum(sizes[u] for u in units) or 1
        for j, u in enumerate(units):
            share = sizes[u] / block_total
            a = att if j == 0 else 0.0
            fwd[u] = (lin * share + a) * per_flop
            bwd[u] = ((LINEAR_PASSES - 1) * lin * share + (ATTENTION_PASSES - 1) * a) * per_flop
    streamed_units = [u for i in plan.streamed for u in groups[i]]
    act = []
    if plan.activation_offload:  # the units of blocks whose inputs are offloaded (partial offload: some)
        unit_act = micro * wl.tokens * fp.hidden_size * fp.act_bytes_per_elem
        moving = {u for i in plan.offloaded_blocks for u in groups[i]}
        act = [unit_act if u in moving else 0 for u in range(len(sizes))]
    disk_units = [u for i in plan.disk_blocks for u in groups[i]]
    seconds, stall, busy, disk = simulate_step_time(sizes, streamed_units, plan.prefetch_depth, plan.num_slots,
                                                    fwd, bwd, machine.link_bytes_per_s, act,
                                                    visit_overhead_s=VISIT_OVERHEAD_S, disk_units=disk_units,
                                                    disk_rate=machine.disk_bytes_per_s or DEFAULT_DISK_BYTES_PER_S,
                                                    staging_slots=max(1, plan.staging_slots))
    # Layers outside the blocks held on the host (``outer_on_host``): copied in on the compute stream where they
    # run, once per forward; nothing overlaps that copy (engine/offload/outer.py).
    outer = fp.outer_bytes / machine.link_bytes_per_s if plan.outer_on_host else 0.0
    return _with_preservation(StepTime((seconds + outer) * pieces, compute, (stall + outer) * pieces,
                                       (busy + outer) * pieces, source, disk * pieces), fp, wl, micro)


def _with_preservation(st: StepTime, fp, wl, micro: int) -> StepTime:
    """Differential output preservation's passes added to a step (``Workload.preservation``): a second forward +
    backward (the step again) and a forward without gradients, which takes the forward's share of the compute or, when
    streamed, one pass of the streamed bytes over the link or from disk (half the step's), whichever is longest."""
    if not wl.preservation:
        return st
    flops = block_flops(fp, wl.tokens, micro, wl.text_tokens, audio_tokens=wl.audio_tokens)
    forward_share = sum(lin + att for lin, att in flops) / sum(LINEAR_PASSES * lin + ATTENTION_PASSES * att
                                                              for lin, att in flops)
    forward = max(st.compute_s * forward_share, st.link_busy_s / 2, st.disk_busy_s / 2)
    return StepTime(2 * st.seconds + forward, st.compute_s * (2 + forward_share), 2 * st.stall_s,
                    2 * st.link_busy_s + st.link_busy_s / 2, st.compute_source, 2 * st.disk_busy_s + st.disk_busy_s / 2)
