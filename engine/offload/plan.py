"""The offload plan: which blocks stay on the GPU, how deep the ring is, whether
activations leave the GPU, and what that costs. Pure arithmetic (no device), so
``auto`` can refuse an impossible budget before anything is loaded.

Memory model of one training step (bytes; B batch, T = image + text tokens,
D hidden size, e = 2 for bf16 activations, one "unit" = B*T*D*e):

    weights     non-block tensors + resident blocks + ring slots x largest streamed block
    LoRA        trainable params x 16: fp32 param, grad, two AdamW moments
    activations checkpointed block inputs: one unit per block, or with activation offload
                1.9 units + 0.125 GB (restored and prefetched inputs, the reentrant recompute's
                outputs and gradients)
              + one block's recompute + backward working set: 47.5 units - 0.11 GB
    optimizer   AdamW (foreach) temporaries, trainable x 8, after the activations are gone

    peak = weights + LoRA + max(activations, optimizer)

The activation constants are a line fitted through steady-state peaks (step 2 on, once
the AdamW moments exist) measured on the H100 with Flux.1-dev, LoRA r16 on the default
targets, at 512², 1024² and 2048² (bench/bench_offload.py rows in bench/results.jsonl):
they reproduce all 23 measured rows (resident, k=1..3, resident blocks, activation
offload) within 0.01 GB. Another LoRA target set or model family needs its own fit;
the plan is logged next to the measured peak after steps 1 and 2 so a drift shows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..errors import ConfigError
from .config import OffloadConfig
from .schedule import simulate_step
from .steptime import Machine, StepTime, predict_step_time

GB = 1e9
LORA_BYTES_PER_PARAM = 16
OPTIMIZER_BYTES_PER_PARAM = 8
SAVED_INPUT_UNITS = 1.0  # a checkpointed block keeps its (hidden, encoder) inputs: B*T*D elements
# One block's recompute + backward working set, in B*T*D elements (fitted) ... It was 47.5 until LoRA
# layers stopped casting their inputs to fp32 (engine/train/lora_attach.skip_lora_input_cast): refitted on
# 2026-11-23 from bench/bench_memory.py rows (stream + activation offload, 1024² and 2048²: measured 3.27 /
# 6.01 GB, 13.3 units below the old line at both).
TRANSIENT_UNITS = 34.2
TRANSIENT_BYTES = int(-0.11 * GB)  # ... plus this (fitted)
# The same with the token-wise parts in checkpointed chunks (engine/offload/recompute.py): a + b / chunks
# units, fitted on the same run's 4- and 16-chunk rows at 1024² and 2048² (within 0.1 GB of all four).
CHUNKED_UNITS_BASE = 24.3
CHUNKED_UNITS_PER_CHUNK = 12.8
# Compiled blocks at an activation-memory budget below 1 (engine/train/compile.py) with token chunks: the
# partitioner recomputes pointwise ops instead of saving them, which shrinks the chunked working set further.
# Fitted on 2026-11-25 H100 rows of bench/bench_memory.py (blocks in parts, budget 0.5): 2048² with 4 chunks
# (3.45 GB) and 1024² with 2 chunks (2.00 GB); 8 chunks at 2048² measured 3.43 GB, 0.3 GB above this line.
COMPILED_CHUNKED_UNITS_BASE = 13.1
COMPILED_CHUNKED_UNITS_PER_CHUNK = 26.8
AUTO_COMPILED_BUDGET = 0.5  # what auto lowers activation_memory_budget to when it needs the memory
CHUNK_TOKENS = 4096  # auto: one chunk per this many tokens (smaller chunks are launch-bound: 1024² with 4
# chunks took 1.69x the resident step, 2048² 1.07x), at least 2
MOMENT_BYTES_PER_PARAM = 8  # AdamW's two fp32 moments
OFFLOADED_KEPT_UNITS = 1.9  # inputs still on the GPU with activation offload (fitted) ...
OFFLOADED_KEPT_BYTES = int(0.125 * GB)  # ... plus this (fitted)
# Kept free inside a budget: the caching allocator reserves more than it hands out. Measured
# reserved - allocated on the H100 without a cap: 0.5 GB at 512², 1.1 GB at 1024² and 2048² with the default
# allocator; 0.6-1.05 GB with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and blocks in parts (2026-11-25).
# Training under an explicit auto budget caps the allocator at the budget (streamer.cap_allocator): at the cap
# it hands cached memory back and retries instead of reserving more, as it does on a card of that size.
HEADROOM_BYTES = int(0.5 * GB)
AUTO_DEPTHS = (3, 2, 1)  # prefetch depths auto weighs (a deeper ring absorbs a copy-bound forward, for a slot)


@dataclass
class ModelFootprint:
    """What the planner needs to know about a model (measured from real or meta tensors)."""

    name: str
    block_names: list[str]
    block_bytes: list[int]  # frozen bytes per block, execution order
    other_bytes: int  # frozen tensors outside the blocks (embedders, final norm/projection)
    trainable_params: int  # LoRA elements (fp32)
    hidden_size: int
    act_bytes_per_elem: int = 2  # bf16 activations
    # fp32 param + grad + AdamW moments (16); 8-bit AdamW moments make it ~10
    lora_bytes_per_param: float = LORA_BYTES_PER_PARAM
    # Per block: the bytes of each part it streams as with activation offload (engine/offload/units.py),
    # or None where it streams whole. Empty: every block whole.
    unit_bytes: list = field(default_factory=list)
    # One block's working set against Flux.1's at the same B*T*D (the fitted constants below are Flux.1's):
    # the family's ``activation_scale``.
    activation_scale: float = 1.0
    # The same while blocks stream in parts (activation offload with ``unit_bytes``): the largest part's working set
    # (``ModelFamily.parts_activation_scale``); None: ``activation_scale``.
    parts_activation_scale: Optional[float] = None
    # The family's token-wise block parts can recompute in chunks (``ModelFamily.chunked_recompute``).
    chunkable: bool = True
    # Frozen elements per block (FLOPs for the step-time model, engine/offload/steptime.py). Empty: the block's
    # bytes at ``act_bytes_per_elem`` per element (bf16 weights).
    block_params: list = field(default_factory=list)
    # Per block, frozen Linear weights by the rows they multiply (``ModelFamily.linear_tokens``: "all", "image",
    # "text", "vector") and the tokens its attention runs over (``block_tokens``): the step-time model's FLOPs.
    # Empty: every frozen element multiplies every token (``block_params``).
    block_token_params: list = field(default_factory=list)
    block_attention_tokens: list = field(default_factory=list)
    # Frozen bytes (part of ``other_bytes``) of the large layers outside the blocks that may wait in pinned host
    # memory between their one run per forward (``outer_on_host``; the family's ``int8_extra_linears``).
    outer_bytes: int = 0

    def stream_units(self, activation_offload: bool) -> tuple[list[int], list[list[int]]]:
        """(bytes per streaming unit, unit indexes per block): parts only with activation offload."""
        sizes, groups = [], []
        for i, b in enumerate(self.block_bytes):
            parts = (self.unit_bytes[i] if activation_offload and i < len(self.unit_bytes) else None) or [b]
            groups.append(list(range(len(sizes), len(sizes) + len(parts))))
            sizes += parts
        return sizes, groups

    def working_set_scale(self, activation_offload: bool) -> float:
        """The factor on the fitted block working set: the largest part's when blocks stream in parts (only with
        activation offload, engine/offload/streamer.py), else the whole block's."""
        split = activation_offload and any(u for u in self.unit_bytes)
        return self.parts_activation_scale if split and self.parts_activation_scale is not None \
            else self.activation_scale

    @property
    def num_blocks(self) -> int:
        return len(self.block_bytes)

    @property
    def total_block_bytes(self) -> int:
        return sum(self.block_bytes)


@dataclass
class Workload:
    """The largest batch the run will see."""

    batch: int
    image_tokens: int
    text_tokens: int
    label: str = ""  # "1024x1024" for messages

    @property
    def tokens(self) -> int:
        return self.image_tokens + self.text_tokens


@dataclass
class Plan:
    mode: str  # "resident" | "stream"
    resident: list[int]
    streamed: list[int]
    prefetch_depth: int
    num_slots: int
    slot_bytes: int
    activation_offload: bool
    predicted_peak_bytes: int
    breakdown: dict[str, int]
    streamed_bytes_per_step: int  # weights host->GPU per optimizer micro-step (fwd + recompute/bwd)
    activation_bytes_per_step: int  # activations host<->GPU each way per micro-step
    pinned_host_bytes: int
    budget_bytes: Optional[int]
    footprint: ModelFootprint = field(repr=False)
    workload: Workload = field(repr=False)
    reason: str = ""
    recompute_chunks: int = 1
    optimizer_on_host: bool = False
    outer_on_host: bool = False  # the large layers outside the blocks wait in pinned host memory (outer.py)
    micro_batch: int = 0  # samples per forward/backward (0: the whole batch)
    ring_bytes: int = 0  # the most the slots hold at once (slots are sized per streamed unit)
    activation_memory_budget: float = 1.0  # of the compiled blocks (auto may lower it); 1 when eager
    streamed_units: int = 0  # large blocks stream in parts with activation offload (engine/offload/units.py)
    step_time: Optional[StepTime] = None  # predicted on ``machine`` (engine/offload/steptime.py)
    machine: Optional[Machine] = None
    # The disk tier (engine/offload/disk.py): streamed blocks read from the slab file on every load, through a
    # ring of ``staging_slots`` pinned buffers; the bytes one steady-state step reads from disk.
    disk_blocks: list[int] = field(default_factory=list)
    staging_slots: int = 0
    disk_bytes_per_step: int = 0

    @property
    def predicted_step_s(self) -> Optional[float]:
        return self.step_time.seconds if self.step_time is not None else None

    def describe(self) -> str:
        fp, wl = self.footprint, self.workload
        lines = [f"offload plan for {fp.name} at {wl.label or f'{wl.tokens} tokens'}, batch {wl.batch}: "
                 + (f"all {fp.num_blocks} blocks resident" if self.mode == "resident" else
                    f"{len(self.streamed)} of {fp.num_blocks} blocks streamed, {len(self.resident)} resident"
                    + (f" as {self.streamed_units} units" if self.streamed_units != len(self.streamed) else "")
                    + f", ring of {self.num_slots} slots holding at most {self.ring_bytes / GB:.2f} GB "
                    f"(prefetch {self.prefetch_depth}), "
                    f"activation offload {'on' if self.activation_offload else 'off'}")
                 + (f", recompute in {self.recompute_chunks} token chunks" if self.recompute_chunks > 1 else "")
                 + (", AdamW moments on the host" if self.optimizer_on_host else "")
                 + (f", {fp.outer_bytes / GB:.2f} GB of layers outside the blocks on the host"
                    if self.outer_on_host else "")
                 + (f", each batch run {self.micro_batch} sample(s) at a time"
                    if 0 < self.micro_batch < wl.batch else "")
                 + (f", compiled blocks at activation-memory budget {self.activation_memory_budget:g}"
                    if self.activation_memory_budget < 1 else "")]
        budget = f" of a {self.budget_bytes / GB:.1f} GB budget" if self.budget_bytes else ""
        parts = ", ".join(f"{k} {v / GB:.2f}" for k, v in self.breakdown.items())
        lines.append(f"  predicted peak {self.predicted_peak_bytes / GB:.2f} GB{budget} ({parts})")
        if self.step_time is not None:
            st = self.step_time
            origin = "measured resident" if st.compute_source == "measured" else "from FLOPs"
            lines.append(f"  predicted step {st.seconds:.3f} s on a {self.machine.describe()}: compute "
                         f"{st.compute_s:.3f} s ({origin})"
                         + (f", copy stall {st.stall_s:.3f} s, link busy {st.link_busy_s:.3f} s"
                            if self.mode != "resident" else ""))
        if self.mode != "resident":
            lines.append(f"  per step: {self.streamed_bytes_per_step / GB:.1f} GB of weights host->GPU"
                         + (f", {self.activation_bytes_per_step / GB:.2f} GB of activations each way"
                            if self.activation_offload else "")
                         + f"; pinned host memory {self.pinned_host_bytes / GB:.1f} GB")
            if self.disk_blocks:
                lines.append(f"  {len(self.disk_blocks)} blocks read from the slab on disk at each load: "
                             f"{self.disk_bytes_per_step / GB:.1f} GB per step through {self.staging_slots} pinned "
                             f"staging buffers (weights only: activations never go to disk)")
        if self.reason:
            lines.append(f"  {self.reason}")
        return "\n".join(lines)

    def summary(self) -> dict:
        """Plain numbers (bench rows, result metadata)."""
        return {
            "mode": self.mode, "resident_blocks": len(self.resident), "streamed_blocks": len(self.streamed),
            "prefetch_depth": self.prefetch_depth, "num_slots": self.num_slots,
            "slot_gb": round(self.slot_bytes / GB, 3), "ring_gb": round(self.ring_bytes / GB, 3),
            "streamed_units": self.streamed_units, "activation_offload": self.activation_offload,
            "predicted_peak_gb": round(self.predicted_peak_bytes / GB, 3),
            "streamed_gb_per_step": round(self.streamed_bytes_per_step / GB, 3),
            "pinned_host_gb": round(self.pinned_host_bytes / GB, 3),
            "budget_gb": round(self.budget_bytes / GB, 3) if self.budget_bytes else None,
            "recompute_chunks": self.recompute_chunks, "optimizer_on_host": self.optimizer_on_host,
            "outer_on_host": self.outer_on_host,
            "micro_batch": self.micro_batch or self.workload.batch,
            "activation_memory_budget": self.activation_memory_budget,
            **(self.step_time.as_dict() if self.step_time is not None else {}),
            "link_gbps": round(self.machine.link_bytes_per_s / GB, 2) if self.machine is not None else None,
            "link_source": self.machine.source if self.machine is not None else None,
            "disk_blocks": len(self.disk_blocks), "staging_slots": self.staging_slots,
            "disk_gb_per_step": round(self.disk_bytes_per_step / GB, 3),
        }


def resident_order(block_bytes: Sequence[int]) -> list[int]:
    """Blocks in the order they become resident: largest first (each saves the most copy time)."""
    return sorted(range(len(block_bytes)), key=lambda i: (-block_bytes[i], i))


def transient_units(chunks: int, compiled_budget: float = 1.0) -> float:
    """One block's recompute + backward working set in B*T*D units, whole or in token chunks; compiled blocks
    at an activation-memory budget below 1 (``compiled_budget``; 1 = eager or compiled at 1) save less."""
    if chunks <= 1:
        return TRANSIENT_UNITS
    if compiled_budget < 1.0:
        return COMPILED_CHUNKED_UNITS_BASE + COMPILED_CHUNKED_UNITS_PER_CHUNK / chunks
    return CHUNKED_UNITS_BASE + CHUNKED_UNITS_PER_CHUNK / chunks


def build_plan(fp: ModelFootprint, wl: Workload, resident: Sequence[int], prefetch_depth: int,
               activation_offload: bool, budget_bytes: Optional[int] = None, reason: str = "",
               recompute_chunks: int = 1, optimizer_on_host: bool = False,
               micro_batch: Optional[int] = None, compiled_budget: float = 1.0, outer_on_host: bool = False) -> Plan:
    """One plan's numbers (the step's copies are simulated once per ring layout and cached: schedule.py).
    ``micro_batch``: samples per forward/backward; a batch of more runs as that many gradient-accumulated
    pieces (the same gradient), so activations are sized for it. ``compiled_budget``: the blocks are compiled at
    this activation-memory budget (1: eager, or compiled at 1). ``outer_on_host``: the footprint's ``outer_bytes``
    wait in pinned host memory, on the GPU only while they run (in the forward, not at the backward's peak), copied
    in once per forward."""
    resident = sorted(set(resident))
    if resident and (resident[0] < 0 or resident[-1] >= fp.num_blocks):
        raise ConfigError(f"resident block ids {resident} must be in [0, {fp.num_blocks}) for {fp.name}")
    streamed = [i for i in range(fp.num_blocks) if i not in set(resident)]
    micro = min(wl.batch, micro_batch or wl.batch)
    unit = micro * wl.tokens * fp.hidden_size * fp.act_bytes_per_elem  # one B*T*D activation
    if streamed:
        # Slots are sized per unit (engine/offload/streamer.py): what the ring holds is the largest sum of
        # the units it holds at once over a step.
        sizes, groups = fp.stream_units(activation_offload)
        streamed_units = [u for i in streamed for u in groups[i]]
        k = max(1, min(prefetch_depth, len(streamed) - 1)) if len(streamed) > 1 else 1
        # The ring holds what the scheduler moves: units (a block in parts is several). One streamed block of
        # two parts needs two slots, the running part and the prefetched one (min(k + 1, len(streamed)) gave 1).
        num_slots = min(k + 1, len(streamed_units))
        slot_bytes = max(fp.block_bytes[i] for i in streamed)
        loads, ring_bytes, ring_at_turn = simulate_step(len(sizes), streamed_units, k, num_slots, sizes)
        streamed_per_step = sum(sizes[u] for u in loads)
        # At the peak: with activation offload, the fullest ring (a block's working set is the same all step);
        # without it every block's inputs stay on the GPU until its backward, so the peak comes where the
        # forward turns into the backward, with the last blocks (Flux: the small single blocks) in the ring
        # (2026-11-25, 1024², k=2: 4.23 GB measured against 5.39 predicted with the fullest ring).
        ring_at_peak = ring_bytes if activation_offload else ring_at_turn
    else:
        k, num_slots, slot_bytes, streamed_per_step, ring_bytes, ring_at_peak = prefetch_depth, 0, 0, 0, 0, 0
        activation_offload = False  # nothing streams: the resident plan has no use for it
        outer_on_host = False  # ... nor for host-held outer layers (only the streamer holds them)
        groups = [[i] for i in range(fp.num_blocks)]
    kept_inputs = OFFLOADED_KEPT_UNITS if activation_offload else fp.num_blocks * SAVED_INPUT_UNITS
    moments = MOMENT_BYTES_PER_PARAM if optimizer_on_host else 0  # on the GPU only for the step
    outer = fp.outer_bytes if outer_on_host else 0
    breakdown = {
        "weights": fp.other_bytes - outer + sum(fp.block_bytes[i] for i in resident) + ring_at_peak,
        "lora+adam": int(fp.trainable_params * (fp.lora_bytes_per_param - moments)),
        # The fitted line has a negative intercept; clamp so tiny models never predict < 0.
        "activations": max(0, int((kept_inputs + fp.working_set_scale(activation_offload)
                                   * transient_units(recompute_chunks, compiled_budget)) * unit
                                  + TRANSIENT_BYTES
                                  + (OFFLOADED_KEPT_BYTES if activation_offload else 0))),
    }
    peak = (breakdown["weights"] + breakdown["lora+adam"]
            + max(breakdown["activations"], fp.trainable_params * (OPTIMIZER_BYTES_PER_PARAM + moments)))
    # Each checkpointed unit's inputs go out and come back (a block in parts has one input set per part).
    act_io = int(sum(len(g) for g in groups) * SAVED_INPUT_UNITS * unit) if activation_offload else 0
    return Plan(
        mode="stream" if streamed else "resident", resident=resident, streamed=streamed, prefetch_depth=k,
        num_slots=num_slots, slot_bytes=slot_bytes, activation_offload=activation_offload,
        predicted_peak_bytes=int(peak), breakdown=breakdown, streamed_bytes_per_step=streamed_per_step + outer,
        activation_bytes_per_step=act_io,
        pinned_host_bytes=sum(fp.block_bytes[i] for i in streamed) + act_io + outer,
        budget_bytes=budget_bytes, footprint=fp, workload=wl, reason=reason,
        recompute_chunks=max(1, recompute_chunks), optimizer_on_host=optimizer_on_host, outer_on_host=bool(outer), micro_batch=micro,
        ring_bytes=ring_bytes, streamed_units=len(streamed_units) if streamed else 0,
        activation_memory_budget=compiled_budget,
    )


def _fits(plan: Plan, budget: int) -> bool:
    return plan.predicted_peak_bytes + HEADROOM_BYTES <= budget


def with_step_time(plan: Plan, machine: Optional[Machine], compute_s_per_step: Optional[float] = None,
                   compiled: bool = False) -> Plan:
    """``plan`` with its predicted step time on ``machine`` (None: the default machine, a 25 GB/s link)."""
    plan.machine = machine or Machine()
    plan.step_time = predict_step_time(plan, plan.machine, compute_s_per_step, compiled)
    return plan


def _cost(plan: Plan) -> tuple:
    """Lower is better: the predicted step time (to the millisecond); at the same time, fewer bytes over the link
    (host-to-GPU weights, activations both ways), then no activation offload, then deeper prefetch."""
    io = plan.streamed_bytes_per_step + 2 * plan.activation_bytes_per_step
    return (round(plan.predicted_step_s, 3), io, plan.activation_offload, -plan.prefetch_depth)


def make_plan(fp: ModelFootprint, wl: Workload, cfg: OffloadConfig, budget_bytes: Optional[int] = None,
              host_ram_bytes: Optional[int] = None, compiled: bool = False, machine: Optional[Machine] = None,
              compute_s_per_step: Optional[float] = None) -> Plan:
    """The plan for ``cfg``. ``budget_bytes`` is required for mode='auto' (the caller resolves
    vram_budget_gb=0 to the free VRAM). Raises ConfigError when auto cannot fit the budget, or the plan
    would pin more than ``cfg.max_pinned_fraction`` of ``host_ram_bytes``. ``compiled``: the blocks will be
    compiled (engine/train/compile.py), so cfg.activation_memory_budget applies, and auto may lower it.
    ``machine``: the link and GPU the step time is predicted for (engine/offload/link.py measures it; None: a
    25 GB/s link); auto picks the fastest plan on it. ``compute_s_per_step``: the measured resident step of this
    model and workload, when known (else estimated from FLOPs; engine/offload/steptime.py)."""
    timing = {"machine": machine, "compute_s_per_step": compute_s_per_step, "compiled": compiled}
    n = fp.num_blocks
    if (cfg.recompute_chunks or 1) > 1 and not fp.chunkable:
        raise ConfigError(f"recompute_chunks={cfg.recompute_chunks}: {fp.name} has no token-wise block parts to "
                          f"recompute in chunks; set recompute_chunks to 0 (auto) or 1")
    order = resident_order(fp.block_bytes)
    if cfg.resident_blocks is not None and cfg.resident_blocks > n:
        raise ConfigError(f"resident_blocks={cfg.resident_blocks} but {fp.name} has only {n} blocks")
    fixed = {"recompute_chunks": cfg.recompute_chunks or 1, "optimizer_on_host": bool(cfg.optimizer_on_host),
             "outer_on_host": bool(cfg.outer_on_host),
             "micro_batch": cfg.micro_batch_size,
             "compiled_budget": cfg.activation_memory_budget if compiled else 1.0}
    if cfg.mode == "resident":
        plan = with_step_time(build_plan(fp, wl, range(n), 1, False, reason="mode=resident", **fixed), **timing)
    elif cfg.mode == "stream":
        r = cfg.resident_blocks or 0
        plan = build_plan(fp, wl, order[:r], cfg.prefetch_depth or 2, bool(cfg.activation_offload),
                          reason="mode=stream", **fixed)
        if cfg.disk_blocks:  # the disk tier, forced (benches, tests): the blocks next to the turn
            from .disk import last_streamed, with_disk_blocks

            with_disk_blocks(plan, last_streamed(plan, cfg.disk_blocks))
        plan = with_step_time(plan, **timing)
    else:
        if budget_bytes is None:
            raise ValueError("mode='auto' needs budget_bytes")
        plan = _auto(fp, wl, cfg, order, budget_bytes, compiled, timing)
    if host_ram_bytes and plan.pinned_host_bytes > cfg.max_pinned_fraction * host_ram_bytes:
        raise ConfigError(
            f"the plan pins {plan.pinned_host_bytes / GB:.1f} GB of host RAM but max_pinned_fraction="
            f"{cfg.max_pinned_fraction} of this machine's {host_ram_bytes / GB:.0f} GB allows "
            f"{cfg.max_pinned_fraction * host_ram_bytes / GB:.1f} GB; keep more blocks resident (a larger "
            f"budget or resident_blocks), turn activation offload off, or raise max_pinned_fraction"
        )
    return plan


def _auto(fp: ModelFootprint, wl: Workload, cfg: OffloadConfig, order: list[int], budget: int,
          compiled: bool = False, timing: Optional[dict] = None) -> Plan:
    """The fastest plan that fits. Finer recompute and host-held moments cost time but no PCIe bytes, so
    they are escalations: tried only when nothing fits without them (unless set explicitly). Compiled blocks
    at activation-memory budget 1 (the default) may go down to AUTO_COMPILED_BUDGET as a last escalation."""
    auto_chunks = min(16, max(2, math.ceil(wl.tokens / CHUNK_TOKENS)))
    chunk_steps = [cfg.recompute_chunks] if cfg.recompute_chunks else [1] + ([auto_chunks] if fp.chunkable else [])
    host_steps = [cfg.optimizer_on_host] if cfg.optimizer_on_host is not None else [False, True]
    outer_steps = [cfg.outer_on_host] if cfg.outer_on_host is not None else [False] + ([True] if fp.outer_bytes else [])
    micro_steps = [cfg.micro_batch_size] if cfg.micro_batch_size else sorted({wl.batch, 1}, reverse=True)
    budget_steps = [1.0]
    if compiled:
        budget_steps = [cfg.activation_memory_budget] + (
            [AUTO_COMPILED_BUDGET] if cfg.activation_memory_budget >= 1.0 else [])
    # Cheapest first: host moments (two small copies per step) and the layers outside the blocks on the host
    # (one copy of them per forward), then a batch run one sample at a time (the same gradient; only the per-call
    # overheads repeat), then chunks (another forward of the MLPs), then a lower activation-memory budget
    # (pointwise recompute in backward).
    escalations = [(c, h, m, b, o) for b in budget_steps for c in chunk_steps for m in micro_steps
                   for h in host_steps for o in outer_steps]
    for chunks, host, micro, cbudget, outer in escalations:
        plan = _auto_fixed(fp, wl, cfg, order, budget, chunks, host, micro, cbudget, timing or {}, outer)
        if plan is not None:
            return plan
    chunks, host, micro, cbudget, outer = escalations[-1]
    smallest = build_plan(fp, wl, order[:cfg.resident_blocks or 0], min([cfg.prefetch_depth] if cfg.prefetch_depth
                                                                        else [2, 1]),
                          cfg.activation_offload if cfg.activation_offload is not None else True, budget,
                          recompute_chunks=chunks, optimizer_on_host=host, micro_batch=micro,
                          compiled_budget=cbudget, outer_on_host=outer)
    need = math.ceil((smallest.predicted_peak_bytes + HEADROOM_BYTES) / GB * 10) / 10
    raise ConfigError(
        f"vram_budget_gb={budget / GB:.3g} is below the smallest plan for {fp.name} at "
        f"{wl.label or f'{wl.tokens} tokens'}, batch {wl.batch} ({need:.1f} GB: "
        f"{', '.join(f'{k} {v / GB:.2f}' for k, v in smallest.breakdown.items())} GB + "
        f"{HEADROOM_BYTES / GB:.1f} GB headroom); raise the budget to at least {need:.1f} GB, "
        f"or lower the resolution or batch size"
        + ("" if compiled else "; compiled blocks (compile='blocks', or auto for runs of 200+ steps on a CUDA GPU "
                               "with Triton) need less")
    )


def _auto_fixed(fp: ModelFootprint, wl: Workload, cfg: OffloadConfig, order: list[int], budget: int,
                chunks: int, host: bool, micro: int, compiled_budget: float = 1.0,
                timing: Optional[dict] = None, outer: bool = False) -> Optional[Plan]:
    """The fastest plan that fits at these escalations: for each prefetch depth and activation offload setting the
    most resident blocks that fit (more resident is never slower), then the lowest predicted step time."""
    timing = timing or {}
    n = fp.num_blocks
    extra = {"recompute_chunks": chunks, "optimizer_on_host": host, "micro_batch": micro,
             "compiled_budget": compiled_budget, "outer_on_host": outer}
    if cfg.resident_blocks in (None, n):  # nothing streams when everything fits: fastest by far
        everything = build_plan(fp, wl, range(n), 1, False, budget, reason="auto: everything fits the budget",
                                **extra)
        if _fits(everything, budget):
            return with_step_time(everything, **timing)
    depths = [cfg.prefetch_depth] if cfg.prefetch_depth else AUTO_DEPTHS
    acts = [cfg.activation_offload] if cfg.activation_offload is not None else [False, True]
    counts = [cfg.resident_blocks] if cfg.resident_blocks is not None else range(n - 1, -1, -1)
    best = None
    for k in depths:
        for act in acts:
            for r in counts:  # most resident first: the first that fits is the best for this (k, act)
                plan = build_plan(fp, wl, order[:r], k, act, budget, **extra)
                if not _fits(plan, budget):
                    continue
                with_step_time(plan, **timing)
                if best is None or _cost(plan) < _cost(best):
                    best = plan
                break
    if best is not None:
        best.reason = (f"auto: the fastest plan that fits the budget (predicted step time on a "
                       f"{best.machine.describe()})")
    return best
