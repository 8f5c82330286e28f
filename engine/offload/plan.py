"""The offload plan: which blocks stay on the GPU, how deep the ring is, whether
activations leave the GPU, and what that costs. Pure arithmetic (no device), so
``auto`` can refuse an impossible budget before anything is loaded.

Memory model of one training step (bytes; B batch, T = image + text tokens,
D hidden size, e = 2 for bf16 activations, one "unit" = B*T*D*e):

    weights     non-block tensors + resident blocks + ring slots x largest streamed block
    LoRA        trainable params x 16: fp32 param, grad, two AdamW moments
    EMA         trainable params x 4 with ema_decay: its fp32 copy (on the host with the moments instead)
    activations checkpointed block inputs: one unit per block, or with activation offload
                1.9 units + 0.125 GB (restored and prefetched inputs, the reentrant recompute's
                outputs and gradients)
              + one block's recompute + backward working set: 47.5 units - 0.11 GB
    optimizer   AdamW (foreach) temporaries, trainable x 8, after the activations are gone

    peak = weights + LoRA + max(activations, optimizer)

A plan fits a budget when peak + margin <= budget: the margin is the allocator's fragmentation (``allocator_margin``),
which grows with the largest tensor a block makes, not only with the budget.

The activation constants are a line fitted through steady-state peaks (step 2 on, once
the AdamW moments exist) measured on the H100 with Flux.1-dev, LoRA r16 on the default
targets, at 512², 1024² and 2048² (bench/bench_offload.py rows in bench/results.jsonl):
they reproduce all 23 measured rows (resident, k=1..3, resident blocks, activation
offload) within 0.01 GB. Another LoRA target set or model family needs its own fit;
the plan is logged next to the measured peak after steps 1 and 2 so a drift shows.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
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
EMA_BYTES_PER_PARAM = 4  # the EMA's fp32 copy of each adapter weight (engine/train/ema.py), where the moments live
OFFLOADED_KEPT_UNITS = 1.9  # inputs still on the GPU with activation offload (fitted) ...
OFFLOADED_KEPT_BYTES = int(0.125 * GB)  # ... plus this (fitted)
# Kept free inside a budget: the caching allocator reserves more than it hands out. Measured
# reserved - allocated on the H100 without a cap: 0.5 GB at 512², 1.1 GB at 1024² and 2048² with the default
# allocator; 0.6-1.05 GB with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and blocks in parts (2026-11-25).
# Training under an explicit auto budget caps the allocator at the budget (streamer.cap_allocator): at the cap
# it hands cached memory back and retries instead of reserving more, as it does on a card of that size.
HEADROOM_BYTES = int(0.5 * GB)
# ... or, where the family measured more, its ``MemoryProfile.fragmentation`` x the step's largest activation tensor
# (``Plan.largest_tensor_bytes``): freed slots and transients leave holes in the allocator's segments that a request of
# that size cannot use, and at the cap they cannot be handed back (Flux.1 at batch 4: engine/families/flux1/family.py).
AUTO_DEPTHS = (3, 2, 1)  # prefetch depths auto weighs (a deeper ring absorbs a copy-bound forward, for a slot)

# --- host RAM (the RAM plan: every host byte the run causes, engine/offload/hostmem.py holds the budget) ---
# The process itself beside the run's own buffers: Python, torch, diffusers/transformers, the CUDA context and the
# libraries' host-side state once kernels ran (cuBLAS handles, workspaces), the step's small host tensors. Measured
# on the H200 with bench/bench_ram.py, 2026-11-27 (Flux.1-dev int8 slab, 1024², auto 8 GB): 0.69 GB of unreclaimable
# RSS (RssAnon + RssShmem) after the imports, CUDA start and one matmul; 1.61 GB while training (peak 9.85 GB less
# the 8.24 GB of pinned blocks and kept tensors the plan counts). The larger figure, rounded up.
PROCESS_BASE_BYTES = int(1.7 * GB)


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
    # The adapter's EMA (ema_decay set): EMA_BYTES_PER_PARAM, on the GPU, or in pinned host RAM where the plan keeps
    # the AdamW moments (``optimizer_on_host``: one rule for both). 0: no EMA.
    ema_bytes_per_param: float = 0.0
    # Per block: the bytes of each part it streams as with activation offload (engine/offload/units.py),
    # or None where it streams whole. Empty: every block whole.
    unit_bytes: list = field(default_factory=list)
    # One block's working set against Flux.1's at the same B*T*D (the fitted constants below are Flux.1's):
    # the family's ``activation_scale``.
    activation_scale: float = 1.0
    # The same while blocks stream in parts (activation offload with ``unit_bytes``): the largest part's working set
    # (``MemoryProfile.parts_activation_scale``); None: ``activation_scale``.
    parts_activation_scale: Optional[float] = None
    # The same with the token-wise parts in chunks (``MemoryProfile.chunked_activation_scale``); None: the above.
    chunked_activation_scale: Optional[float] = None
    # Compiled blocks below an activation-memory budget of 1, in chunks: the working set against the family's eager
    # chunked one (``MemoryProfile.compiled_activation_scale``); None: Flux.1's compiled line.
    compiled_activation_scale: Optional[float] = None
    # The largest part of a block in parts shrinks with token chunks (``MemoryProfile.parts_chunked``); False: blocks
    # in parts hold the unchunked line's share at any number of chunks.
    parts_chunked: bool = True
    # The family's token-wise block parts can recompute in chunks (``MemoryProfile.chunked_recompute``).
    chunkable: bool = True
    # Frozen elements per block (FLOPs for the step-time model, engine/offload/steptime.py). Empty: the block's
    # bytes at ``act_bytes_per_elem`` per element (bf16 weights).
    block_params: list = field(default_factory=list)
    # Per block, frozen Linear weights by the rows they multiply (``MemoryProfile.linear_tokens``: "all", "image",
    # "text", "vector", "audio") and the tokens its attention runs over (``block_tokens``): the step-time model's
    # FLOPs.
    # Empty: every frozen element multiplies every token (``block_params``).
    block_token_params: list = field(default_factory=list)
    block_attention_tokens: list = field(default_factory=list)
    # Frozen bytes (part of ``other_bytes``) of the large layers outside the blocks that may wait in pinned host
    # memory between their one run per forward (``outer_on_host``; the family's ``int8_extra_linears``).
    outer_bytes: int = 0
    # The frozen weights are views of a read-only file map (an int8 slab, engine/slab/load.py): their pages are clean
    # page cache the kernel may drop, so only the copies made from them (pinned blocks, tensors converted to bf16)
    # count as host bytes. False (a checkpoint loaded into host memory): every frozen byte is held on the host while
    # loading, and a tensor moved to the GPU keeps its host copy for the run (the streamer restores it on remove).
    file_backed: bool = False
    # The model can read its blocks from the slab file on disk each time they load (the disk tier; a slab only).
    disk_capable: bool = False
    # The widest frozen Linear of the blocks that multiplies token rows (in or out features; the modulation's
    # per-sample rows left out): a block's largest activation tensor is tokens x this (Flux.1: the single blocks'
    # proj_out input, attention + MLP concatenated, 5 x hidden). 0: unknown.
    widest_features: int = 0
    # The allocator's unusable holes at the cap, in units of that tensor (``MemoryProfile.fragmentation``, measured
    # per family; 0: HEADROOM_BYTES covers them).
    fragmentation: float = 0.0
    # The same while blocks stream in parts (``MemoryProfile.parts_fragmentation``); None: ``fragmentation``.
    parts_fragmentation: Optional[float] = None
    # At least this much kept free, where a run asked for more than the family's measure (``OffloadConfig``'s
    # ``allocator_margin_gb``, set after an out-of-memory that named the holes: ``oom_margin_advice``). 0: none.
    margin_floor_bytes: int = 0
    # The family's modulation growth with a per-token timestep (``MemoryProfile.token_modulation``: a
    # ``TokenModulation``), counted over ``Workload.timestep_tokens``. None: it does not grow.
    token_modulation: Optional[object] = None

    def stream_units(self, split) -> tuple[list[int], list[list[int]]]:
        """(bytes per streaming unit, unit indexes per block). ``split``: the blocks that stream in parts, those whose
        activations are offloaded (True: every block, False or empty: none); parts only with activation offload."""
        chosen = range(self.num_blocks) if split is True else set(split or ())
        sizes, groups = [], []
        for i, b in enumerate(self.block_bytes):
            parts = (self.unit_bytes[i] if i in chosen and i < len(self.unit_bytes) else None) or [b]
            groups.append(list(range(len(sizes), len(sizes) + len(parts))))
            sizes += parts
        return sizes, groups

    def working_set_units(self, split, chunks: int = 1, compiled_budget: float = 1.0) -> float:
        """One block's recompute + backward working set in B*T*D units: the fitted line (``transient_units``) times
        the family's factor (``working_set_scale``); the unchunked line for blocks in parts where no chunk reaches the
        largest part (``parts_chunked``). Compiled below an activation-memory budget of 1 (in chunks, or in such
        parts), a family with its own ``compiled_activation_scale`` takes that times its eager working set instead of
        Flux.1's compiled line (where the compile saves nothing for it)."""
        scale = self.working_set_scale(split, chunks)
        flat = not self.parts_chunked and self.in_parts(split)  # no chunk reaches the largest part
        line = 1 if flat else chunks
        if (chunks > 1 or flat) and compiled_budget < 1.0 and self.compiled_activation_scale is not None:
            return self.compiled_activation_scale * scale * transient_units(line)
        return scale * transient_units(line, compiled_budget)

    def working_set_scale(self, split, chunks: int = 1) -> float:
        """The factor on the fitted block working set: with the token-wise parts in ``chunks`` > 1 chunks, the family's
        chunked one where it has one; else the largest part's when every block that has parts streams in them (only
        with activation offload, engine/offload/streamer.py; ``split`` as in ``stream_units``), else the whole
        block's (a large block left whole sets the largest working set)."""
        if chunks > 1 and self.chunked_activation_scale is not None:
            return self.chunked_activation_scale
        return self.parts_activation_scale if self.in_parts(split) and self.parts_activation_scale is not None \
            else self.activation_scale

    def in_parts(self, split) -> bool:
        """Every block that has parts streams in them (``split`` as in ``stream_units``)."""
        chosen = range(self.num_blocks) if split is True else set(split or ())
        big = [i for i, u in enumerate(self.unit_bytes) if u]
        return bool(big) and all(i in chosen for i in big)

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
    # Differential output preservation (engine/train/preservation.py): each micro-step also runs one forward without
    # gradients and one forward + backward on the class prompt (the step-time model counts them; the peak is one pass's).
    preservation: bool = False
    reference_tokens: int = 0  # of image_tokens, an edit item's reference (control) images' tokens
    # A joint audio-video model's audio tokens per sample (``MemoryProfile.audio_tokens``): not in ``tokens``
    # (another stream, beside the image tokens); the step-time model counts its Linears on them.
    audio_tokens: int = 0
    # Tokens with a timestep of their own (an image-to-video variant holding its first frames clean at timestep 0:
    # ``FirstFrameCondition.held``): the modulation grows with them (``ModelFootprint.token_modulation``). 0: one
    # timestep per sample.
    timestep_tokens: int = 0

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
    activation_offload: bool  # some (``offloaded_blocks``) or all blocks' inputs wait in pinned host memory
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
    # The disk tier: streamed blocks whose frozen bytes are NOT held in host RAM; each load reads them from the slab
    # file into one of ``staging_slots`` pinned buffers (each the size of the largest disk block), then to the GPU.
    disk_blocks: list[int] = field(default_factory=list)
    staging_slots: int = 0
    disk_bytes_per_step: int = 0
    # The RAM plan: host bytes per phase of the run ("load": the model read and its blocks pinned; "train": steady
    # state; "caching": the Cache Text Embeds pass when it is known), the training phase's parts, and the budget.
    host_phases: dict = field(default_factory=dict)
    host_breakdown: dict = field(default_factory=dict)
    ram_budget_bytes: Optional[int] = None
    ram_note: str = ""  # why the RAM plan looks as it does (recompute instead of offload, blocks on disk)
    host_args: dict = field(default_factory=dict, repr=False)  # what ``rehost`` needs to count the host bytes again
    # Partial activation offload: the blocks whose checkpointed inputs go to pinned host memory (they stream in parts);
    # the others keep theirs on the GPU and recompute as without offload. Every block when activation_offload is on
    # for all, none when off.
    offloaded_blocks: list[int] = field(default_factory=list)
    # The offloaded blocks stream (and offload their inputs) in parts where the family has them (False: whole, one
    # input set per block: a third of Wan's activation host RAM for a larger working set on the GPU).
    offload_in_parts: bool = True
    # The step's largest activation tensor: micro-batch x tokens x the widest block Linear, per token chunk when
    # chunked (``allocator_margin``).
    largest_tensor_bytes: int = 0
    # Of the activations, the per-token modulation (``token_modulation_bytes``).
    modulation_bytes: int = 0

    @property
    def margin_bytes(self) -> int:
        """What the plan keeps free under its budget for the allocator (``allocator_margin``)."""
        return max(allocator_margin(self.largest_tensor_bytes, self.fragmentation), self.footprint.margin_floor_bytes)

    @property
    def fragmentation(self) -> float:
        """The family's allocator factor for this plan: its own for blocks in parts where every block that has parts
        streams in them (``ModelFootprint.parts_fragmentation``), else the whole blocks'."""
        fp = self.footprint
        parts = fp.parts_fragmentation is not None and fp.in_parts(self.split_blocks)
        return fp.parts_fragmentation if parts else fp.fragmentation

    @property
    def split_blocks(self) -> list[int]:
        """The blocks that stream in parts (``ModelFootprint.stream_units``)."""
        return self.offloaded_blocks if self.offload_in_parts else []

    @property
    def partial_offload(self) -> bool:
        return self.activation_offload and len(self.offloaded_blocks) < self.footprint.num_blocks

    @property
    def ema_on_host(self) -> bool:
        """The adapter's EMA waits in pinned host RAM between steps (with the AdamW moments)."""
        return bool(self.footprint.ema_bytes_per_param) and self.optimizer_on_host

    @property
    def predicted_host_peak_bytes(self) -> int:
        """The most host RAM the run holds at once: the largest phase."""
        return max(self.host_phases.values()) if self.host_phases else 0

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
                    "activation offload " + (f"for {len(self.offloaded_blocks)} of {fp.num_blocks} blocks (the rest "
                                             f"recompute with their inputs on the GPU)" if self.partial_offload else
                                             'on' if self.activation_offload else 'off')
                    + (" (whole blocks, one input set each)" if self.activation_offload and not self.offload_in_parts
                       and any(fp.unit_bytes) else ""))
                 + (f", recompute in {self.recompute_chunks} token chunks" if self.recompute_chunks > 1 else "")
                 + (", AdamW moments on the host" if self.optimizer_on_host else "")
                 + ((", adapter EMA in pinned host RAM" if self.ema_on_host else ", adapter EMA on the training device")
                    if fp.ema_bytes_per_param else "")
                 + (f", {fp.outer_bytes / GB:.2f} GB of layers outside the blocks on the host"
                    if self.outer_on_host else "")
                 + (f", each batch run {self.micro_batch} sample(s) at a time"
                    if 0 < self.micro_batch < wl.batch else "")
                 + (f", compiled blocks at activation-memory budget {self.activation_memory_budget:g}"
                    if self.activation_memory_budget < 1 else "")]
        budget = f" of a {self.budget_bytes / GB:.1f} GB budget" if self.budget_bytes else ""
        parts = ", ".join(f"{k} {v / GB:.2f}" for k, v in self.breakdown.items())
        if self.modulation_bytes:
            parts += f"; of the activations, {self.modulation_bytes / GB:.2f} GB of per-token modulation"
        why = ("allocator_margin_gb" if self.margin_bytes == fp.margin_floor_bytes else
               f"the largest tensor {self.largest_tensor_bytes / GB:.2f} GB x {self.fragmentation:g}")
        margin = (f"; {self.margin_bytes / GB:.2f} GB kept free for the allocator's fragmentation ({why})"
                  if self.budget_bytes and self.margin_bytes > HEADROOM_BYTES else "")
        lines.append(f"  predicted peak {self.predicted_peak_bytes / GB:.2f} GB{budget} ({parts}){margin}")
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
        if self.host_phases:
            ram = (f" of a {self.ram_budget_bytes / GB:.1f} GB RAM budget" if self.ram_budget_bytes else "")
            parts = ", ".join(f"{k} {v / GB:.2f}" for k, v in self.host_breakdown.items() if v)
            phases = ", ".join(f"{k} {v / GB:.1f}" for k, v in self.host_phases.items())
            lines.append(f"  predicted host RAM peak {self.predicted_host_peak_bytes / GB:.2f} GB{ram} "
                         f"(training: {parts}; by phase: {phases})")
        if self.ram_note:
            lines.append(f"  {self.ram_note}")
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
            "offloaded_blocks": len(self.offloaded_blocks), "offload_in_parts": self.offload_in_parts,
            "predicted_peak_gb": round(self.predicted_peak_bytes / GB, 3),
            "margin_gb": round(self.margin_bytes / GB, 3),
            "streamed_gb_per_step": round(self.streamed_bytes_per_step / GB, 3),
            "pinned_host_gb": round(self.pinned_host_bytes / GB, 3),
            "budget_gb": round(self.budget_bytes / GB, 3) if self.budget_bytes else None,
            "recompute_chunks": self.recompute_chunks, "optimizer_on_host": self.optimizer_on_host,
            "ema": ("host" if self.ema_on_host else "device") if self.footprint.ema_bytes_per_param else None,
            "outer_on_host": self.outer_on_host,
            "micro_batch": self.micro_batch or self.workload.batch,
            "activation_memory_budget": self.activation_memory_budget,
            **(self.step_time.as_dict() if self.step_time is not None else {}),
            "link_gbps": round(self.machine.link_bytes_per_s / GB, 2) if self.machine is not None else None,
            "link_source": self.machine.source if self.machine is not None else None,
            "predicted_host_peak_gb": round(self.predicted_host_peak_bytes / GB, 3),
            "host_breakdown_gb": {k: round(v / GB, 3) for k, v in self.host_breakdown.items()},
            "host_phases_gb": {k: round(v / GB, 3) for k, v in self.host_phases.items()},
            "ram_budget_gb": round(self.ram_budget_bytes / GB, 3) if self.ram_budget_bytes else None,
            "disk_blocks": len(self.disk_blocks), "staging_slots": self.staging_slots,
            "disk_gb_per_step": round(self.disk_bytes_per_step / GB, 3),
            "disk_gbps": (round(self.machine.disk_bytes_per_s / GB, 2)
                          if self.machine is not None and self.machine.disk_bytes_per_s else None),
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
               micro_batch: Optional[int] = None, compiled_budget: float = 1.0, outer_on_host: bool = False,
               disk_blocks: Sequence[int] = (), host_extra: Optional[dict] = None,
               ram_budget_bytes: Optional[int] = None, keeps_host_copies: bool = True,
               resume_staging: bool = True, offload_blocks: Optional[Sequence[int]] = None,
               offload_parts: bool = True) -> Plan:
    """One plan's numbers (the step's copies are simulated once per ring layout and cached: schedule.py).
    ``micro_batch``: samples per forward/backward; a batch of more runs as that many gradient-accumulated
    pieces (the same gradient), so activations are sized for it. ``compiled_budget``: the blocks are compiled at
    this activation-memory budget (1: eager, or compiled at 1). ``outer_on_host``: the footprint's ``outer_bytes``
    wait in pinned host memory, on the GPU only while they run (in the forward, not at the backward's peak), copied
    in once per forward. ``disk_blocks``: streamed blocks read from the slab file each time they load (the disk tier)
    instead of held in host RAM. ``host_extra``: host bytes the run holds beside the plan, by name ("preview
    partner": the other expert's pinned blocks; "caching": the Cache Text Embeds pass, a phase of its own).
    ``keeps_host_copies``: the streamer places the model and keeps the host copies of what it moves to the GPU
    (False: mode='resident', whose placement moves the model and lets the host copies go). ``resume_staging``: the run
    writes resumable states (each save copies the LoRA and its moments to a pinned host buffer). ``offload_blocks``:
    with activation offload, the blocks whose inputs are offloaded (None: all; partial offload, ``offload_prefix``);
    ``offload_parts``: they stream in parts where the family has them (False: whole, one input set per block)."""
    resident = sorted(set(resident))
    if resident and (resident[0] < 0 or resident[-1] >= fp.num_blocks):
        raise ConfigError(f"resident block ids {resident} must be in [0, {fp.num_blocks}) for {fp.name}")
    streamed = [i for i in range(fp.num_blocks) if i not in set(resident)]
    micro = min(wl.batch, micro_batch or wl.batch)
    unit = micro * wl.tokens * fp.hidden_size * fp.act_bytes_per_elem  # one B*T*D activation
    offloaded = (sorted(set(range(fp.num_blocks) if offload_blocks is None else offload_blocks))
                 if activation_offload and streamed else [])
    activation_offload = bool(offloaded)
    split = offloaded if offload_parts else []
    if streamed:
        # Slots are sized per unit (engine/offload/streamer.py): what the ring holds is the largest sum of
        # the units it holds at once over a step.
        sizes, groups = fp.stream_units(split)
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
        loads, sizes = (), list(fp.block_bytes)
        activation_offload = False  # nothing streams: the resident plan has no use for it
        outer_on_host = False  # ... nor for host-held outer layers (only the streamer holds them)
        groups = [[i] for i in range(fp.num_blocks)]
    # With activation offload the offloaded inputs on the GPU at once (fitted), plus one set per block that keeps its
    # own (partial offload: those blocks stream and recompute whole).
    kept_inputs = ((OFFLOADED_KEPT_UNITS + (fp.num_blocks - len(offloaded)) * SAVED_INPUT_UNITS) if activation_offload
                   else fp.num_blocks * SAVED_INPUT_UNITS)
    moments = MOMENT_BYTES_PER_PARAM if optimizer_on_host else 0  # on the GPU only for the step
    outer = fp.outer_bytes if outer_on_host else 0
    modulation, modulation_io = token_modulation_bytes(fp, wl, micro, len(offloaded))
    breakdown = {
        "weights": fp.other_bytes - outer + sum(fp.block_bytes[i] for i in resident) + ring_at_peak,
        "lora+adam": int(fp.trainable_params * (fp.lora_bytes_per_param - moments)),
        # The fitted line has a negative intercept; clamp so tiny models never predict < 0.
        "activations": max(0, int((kept_inputs + fp.working_set_units(split, recompute_chunks, compiled_budget)) * unit
                                  + TRANSIENT_BYTES
                                  + (OFFLOADED_KEPT_BYTES if activation_offload else 0)) + modulation),
    }
    # The EMA on the GPU (else on the host with the moments: its update then brings it in after the optimizer's
    # temporaries are gone, 4 bytes per weight within their 8 + 8).
    if fp.ema_bytes_per_param and not optimizer_on_host:
        breakdown["ema"] = int(fp.trainable_params * fp.ema_bytes_per_param)
    peak = (breakdown["weights"] + breakdown["lora+adam"] + breakdown.get("ema", 0)
            + max(breakdown["activations"], fp.trainable_params * (OPTIMIZER_BYTES_PER_PARAM + moments)))
    # Each checkpointed unit's inputs go out and come back (a block in parts has one input set per part).
    act_io = int(sum(len(groups[i]) for i in offloaded) * SAVED_INPUT_UNITS * unit) + modulation_io
    disk = sorted(set(disk_blocks))
    if disk and not set(disk) <= set(streamed):
        raise ConfigError(f"disk blocks {disk} must be streamed blocks of {fp.name} (resident: {resident})")
    staging_slots, staging_bytes, disk_per_step = 0, 0, 0
    if disk:  # the staging ring and the reads its policy makes in a steady-state step (engine/offload/disk.py)
        from .disk import default_staging_slots, read_bytes_of, simulate_disk_reads

        disk_units = {u for i in disk for u in groups[i]}
        staging_slots = default_staging_slots(k)
        staging_bytes = staging_slots * max(read_bytes_of(sizes[u]) for u in disk_units)
        disk_per_step = sum(read_bytes_of(sizes[u]) for u in simulate_disk_reads(loads, disk_units, staging_slots))
    host = host_bytes(fp, streamed, disk, act_io, outer, optimizer_on_host, staging_bytes, host_extra or {},
                      resident, keeps_host_copies, resume_staging)
    # Token chunks cut the token-wise parts, where the widest tensors are (Flux.1's MLP and concatenation, Wan's FFN);
    # attention runs unchunked, and its backward asks for two B*T*D tensors at once (Wan 2.2 A14B at 832x480x81: the
    # 640 MiB request of bench/logs/experts_wan_oom_session5.log).
    chunked = micro * math.ceil(wl.tokens / max(1, recompute_chunks)) * fp.widest_features * fp.act_bytes_per_elem
    largest = max(chunked, 2 * micro * wl.tokens * fp.hidden_size * fp.act_bytes_per_elem)
    return Plan(
        mode="stream" if streamed else "resident", resident=resident, streamed=streamed, prefetch_depth=k,
        num_slots=num_slots, slot_bytes=slot_bytes, activation_offload=activation_offload, offloaded_blocks=offloaded,
        offload_in_parts=offload_parts,
        predicted_peak_bytes=int(peak), breakdown=breakdown, streamed_bytes_per_step=streamed_per_step + outer,
        activation_bytes_per_step=act_io,
        pinned_host_bytes=host["pinned"],
        budget_bytes=budget_bytes, footprint=fp, workload=wl, reason=reason,
        recompute_chunks=max(1, recompute_chunks), optimizer_on_host=optimizer_on_host, outer_on_host=bool(outer), micro_batch=micro,
        ring_bytes=ring_bytes, streamed_units=len(streamed_units) if streamed else 0,
        activation_memory_budget=compiled_budget, disk_blocks=disk, staging_slots=staging_slots,
        disk_bytes_per_step=disk_per_step, host_phases=host["phases"], host_breakdown=host["train"],
        ram_budget_bytes=ram_budget_bytes,
        host_args={"extra": dict(host_extra or {}), "keeps_host_copies": keeps_host_copies,
                   "resume_staging": resume_staging},
        largest_tensor_bytes=int(largest), modulation_bytes=modulation,
    )


def token_modulation_bytes(fp: ModelFootprint, wl: Workload, micro: int, offloaded: int) -> tuple[int, int]:
    """(GPU bytes at the backward's peak, activation-offload host bytes per micro-step) of the modulation a per-token
    timestep makes (``ModelFootprint.token_modulation`` over ``Workload.timestep_tokens``; (0, 0) without one). On
    the GPU: the rows held for the whole step plus one running block's. With activation offload the input rows are
    shared by every block and stay on the GPU (engine/offload/activations.py ``_shared``); only the first offloaded
    block of a forward copies them out (nothing reads that copy back), into its host buffer."""
    mod = fp.token_modulation
    if mod is None or not wl.timestep_tokens:
        return 0, 0
    row = micro * wl.timestep_tokens * fp.hidden_size * fp.act_bytes_per_elem
    return int((mod.held_rows + mod.block_rows) * row), int(mod.input_rows * row) if offloaded else 0


def with_disk_blocks(plan: Plan, blocks: Sequence[int], staging_slots: int = 0) -> Plan:
    """``plan`` with ``blocks`` (some of its streamed ones) read from the slab on every load (benches, tests: a plan
    forced onto the disk tier): the staging ring's size, the disk bytes one steady-state step reads (the scheduler's
    loads replayed through the staging policy, engine/offload/disk.py) and the host bytes (the disk blocks' host
    copies gone, the ring added)."""
    from .disk import default_staging_slots, read_bytes_of, simulate_disk_reads

    blocks = sorted(set(blocks))
    if not blocks:
        plan.disk_blocks, plan.staging_slots, plan.disk_bytes_per_step = [], 0, 0
        return rehost(plan, 0)
    if not set(blocks) <= set(plan.streamed):
        raise ConfigError(f"disk blocks {blocks} must be streamed blocks of the plan ({plan.streamed})")
    fp = plan.footprint
    sizes, groups = fp.stream_units(plan.split_blocks)
    streamed_units = [u for i in plan.streamed for u in groups[i]]
    disk_units = {u for i in blocks for u in groups[i]}
    slots = staging_slots or default_staging_slots(plan.prefetch_depth)
    loads, _, _ = simulate_step(len(sizes), streamed_units, plan.prefetch_depth, plan.num_slots, sizes)
    plan.disk_blocks, plan.staging_slots = blocks, slots
    plan.disk_bytes_per_step = sum(read_bytes_of(sizes[u]) for u in simulate_disk_reads(loads, disk_units, slots))
    return rehost(plan, slots * max(read_bytes_of(sizes[u]) for u in disk_units))


def rehost(plan: Plan, staging_bytes: int) -> Plan:
    """Count ``plan``'s host bytes again after its disk blocks changed (engine/offload/disk.py ``with_disk_blocks``),
    with a staging ring of ``staging_bytes``."""
    fp = plan.footprint
    host = host_bytes(fp, plan.streamed, plan.disk_blocks, plan.activation_bytes_per_step,
                      fp.outer_bytes if plan.outer_on_host else 0, plan.optimizer_on_host, staging_bytes,
                      plan.host_args.get("extra", {}), plan.resident, plan.host_args.get("keeps_host_copies", True),
                      plan.host_args.get("resume_staging", True))
    plan.host_phases, plan.host_breakdown, plan.pinned_host_bytes = host["phases"], host["train"], host["pinned"]
    return plan


def host_bytes(fp: ModelFootprint, streamed: Sequence[int], disk: Sequence[int], act_io: int, outer: int,
               moments_on_host: bool, staging: int, extra: dict, resident: Sequence[int],
               keeps_host_copies: bool = True, resume_staging: bool = True) -> dict:
    """Every host byte a run causes, by part and by phase (the RAM plan):

    * process: the interpreter, torch and the CUDA context (PROCESS_BASE_BYTES, measured);
    * blocks: the pinned copies of streamed blocks not on the disk tier (engine/offload/host.py);
    * staging: the disk tier's pinned ring (``staging`` bytes: its slots x the largest disk unit's read);
    * activations: the pinned buffers activation offload keeps, one per streamed unit (activations.py);
    * moments: AdamW's moments between steps with optimizer_on_host (host_moments.py);
    * ema: the adapter's EMA, with the moments (engine/train/ema.py, ``ModelFootprint.ema_bytes_per_param``);
    * outer: the layers outside the blocks held in pinned memory with outer_on_host (outer.py);
    * resume: the pinned copy a resume save takes of the LoRA, its moments and its EMA (state_writer.py HostStaging);
    * weights kept: host copies of tensors moved to the GPU, kept for the run so ``remove()`` can put them back
      (the streamer's ``_moved``): the tensors outside the blocks, and with a model loaded into host memory (not a
      slab's file map) the resident blocks too;
    * extra: what the caller names (a preview partner's pinned blocks).

    Phases: "load" holds the process, the model as read (a slab: its tensors converted to bf16, the int8 weights
    are the file map's clean pages; else every frozen byte) and the pinned blocks made from it; "train" the parts
    above; "caching" (``extra["caching"]``) the process and the caching pass's own peak. The plan's peak is the
    largest phase."""
    extra = dict(extra)
    caching = extra.pop("caching", 0)
    disk_set = set(disk)
    pinned_blocks = sum(fp.block_bytes[i] for i in streamed if i not in disk_set)
    lora = fp.trainable_params
    moments = int(lora * MOMENT_BYTES_PER_PARAM) if moments_on_host else 0
    ema = int(lora * fp.ema_bytes_per_param) if moments_on_host else 0
    # A resume save stages the fp32 LoRA weights, the optimizer's moments (lora_bytes_per_param less the weight
    # and its gradient: 8 for AdamW, ~2 for 8-bit AdamW) and the EMA, wherever it lives.
    resume = int(lora * (4 + max(0.0, fp.lora_bytes_per_param - 8) + fp.ema_bytes_per_param)) if resume_staging else 0
    kept = (fp.other_bytes - outer + (0 if fp.file_backed else sum(fp.block_bytes[i] for i in resident))
            if keeps_host_copies else 0)
    train = {"process": PROCESS_BASE_BYTES, "blocks": pinned_blocks, "staging": staging, "activations": act_io,
             "moments": moments, "ema": ema, "outer": outer, "resume": resume, "weights kept": kept}
    train.update({k: int(v) for k, v in extra.items()})
    as_read = fp.other_bytes if fp.file_backed else fp.other_bytes + fp.total_block_bytes
    # While pinning, a loaded (not file-backed) model's streamed blocks are copied one at a time and the originals
    # let go, so the load phase holds the model as read plus one block; a slab's pinned copies add up.
    load = PROCESS_BASE_BYTES + as_read + (pinned_blocks + staging if fp.file_backed
                                            else max(fp.block_bytes, default=0))
    phases = {"load": int(load), "train": int(sum(train.values()))}
    if caching:
        phases["caching"] = int(PROCESS_BASE_BYTES + caching)
    pinned = pinned_blocks + staging + act_io + outer  # the streamer's (max_pinned_fraction holds it)
    return {"train": train, "phases": phases, "pinned": int(pinned)}


def cpu_resident_plan(fp: ModelFootprint, wl: Workload, ram_budget_bytes: Optional[int], ram_source: str = "",
                      host_extra: Optional[dict] = None, resume_staging: bool = True) -> Plan:
    """The RAM plan of training on the CPU: what a GPU would hold (the model, the LoRA with its gradients and AdamW
    moments, the activations: the resident plan's device peak) is host memory here, beside the process. A slab's
    int8 weights stay views of its file map (clean page cache, not counted, as in ``host_bytes``). Raises ConfigError
    when that exceeds ``ram_budget_bytes`` (None: unlimited)."""
    plan = build_plan(fp, wl, range(fp.num_blocks), 1, False, reason="training on the CPU",
                      keeps_host_copies=False, host_extra=host_extra, ram_budget_bytes=ram_budget_bytes,
                      resume_staging=resume_staging)
    frozen = fp.other_bytes + fp.total_block_bytes
    on_host = plan.predicted_peak_bytes - (frozen if fp.file_backed else 0)  # the "device" memory is host memory
    plan.host_breakdown = {**plan.host_breakdown, "training on the CPU": int(on_host)}
    plan.host_phases = {**plan.host_phases, "train": int(sum(plan.host_breakdown.values()))}
    if ram_budget_bytes is not None and plan.predicted_host_peak_bytes > ram_budget_bytes:
        need = math.ceil(plan.predicted_host_peak_bytes / GB * 10) / 10
        raise ConfigError(
            f"training {fp.name} on the CPU at {wl.label or f'{wl.tokens} tokens'}, batch {wl.batch} needs {need:.1f} "
            f"GB of host RAM (the model, LoRA + AdamW and activations {on_host / GB:.2f} GB; by phase "
            f"{', '.join(f'{k} {v / GB:.1f}' for k, v in plan.host_phases.items())} GB) but ram_budget_gb="
            f"{ram_budget_bytes / GB:.3g}{ram_source} allows {ram_budget_bytes / GB:.1f} GB; free host RAM or raise "
            f"ram_budget_gb to at least {need:.1f}, lower the resolution or batch size, or train on a CUDA GPU "
            f"(where blocks can stream)")
    return plan


def allocator_margin(largest_tensor_bytes: int, fragmentation: float = 0.0) -> int:
    """VRAM a plan keeps free under its budget for the caching allocator: HEADROOM_BYTES, or the family's measured
    ``fragmentation`` x the step's largest activation tensor where that is more (the holes grow with the tensors)."""
    return max(HEADROOM_BYTES, int(fragmentation * largest_tensor_bytes))


_TORCH_OOM = re.compile(r"Tried to allocate ([\d.]+) (KiB|MiB|GiB)\b.*?([\d.]+) (KiB|MiB|GiB) allowed; Of the "
                        r"allocated memory ([\d.]+) (KiB|MiB|GiB) is allocated by PyTorch, and ([\d.]+) (KiB|MiB|GiB) "
                        r"is reserved by PyTorch but unallocated", re.S)
_UNIT = {"KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}


def oom_margin_advice(message: str, plan: Optional[Plan]) -> str:
    """What an out-of-memory under a capped budget says about the allocator margin, from torch's own figures in its
    message (the request, the cap, what was allocated and what was reserved but unusable): how much the run needed
    beyond the plan's predicted peak, and the ``allocator_margin_gb`` that covers it (rounded up to 0.25 GB). With
    that margin the planner fits the same budget with more kept free, so the card's budget can stay as it is.
    "" when the message has no such figures (no cap, or another allocator backend) or no plan is known."""
    m = _TORCH_OOM.search(message)
    if m is None or plan is None or not plan.budget_bytes:
        return ""
    request, allowed, allocated, unusable = (float(m.group(i)) * _UNIT[m.group(i + 1)] for i in (1, 3, 5, 7))
    needed = allocated + unusable + request - plan.predicted_peak_bytes
    if needed <= plan.margin_bytes:  # the plan itself was under-counted, not the margin
        return (f"The allocator had {unusable / GB:.2f} GB reserved but unusable and the request was {request / GB:.2f}"
                f" GB, within the {plan.margin_bytes / GB:.2f} GB the plan kept free: the plan's prediction was short;"
                f" lower vram_budget_gb by {math.ceil((allocated + unusable + request - allowed) / GB * 4) / 4:.2f} GB.")
    margin = math.ceil(needed / GB * 4) / 4
    # Holes (fragmentation) that are a small part of what was missing: the plan's own prediction was short.
    why = ("fragmentation" if unusable >= 0.25 * needed else
           "little of it fragmentation: the plan under-counted this step's memory")
    return (f"The allocator had {unusable / GB:.2f} GB reserved but unusable ({why}) beside a "
            f"{request / GB:.2f} GB request: this step needed {needed / GB:.2f} GB beyond the predicted peak, and the "
            f"plan kept {plan.margin_bytes / GB:.2f} GB free. Set Offload Tuning's allocator_margin_gb to {margin:.2f} "
            f"(the plan then streams more within the same vram_budget_gb) and run again.")


def _fits(plan: Plan, budget: int) -> bool:
    return plan.predicted_peak_bytes + plan.margin_bytes <= budget


@dataclass(frozen=True)
class RamLimits:
    """What the RAM plan is held to: ``budget`` (every host byte at the peak phase; None: unlimited) and ``pinned``
    (the streamer's page-locked bytes: max_pinned_fraction x the machine's RAM; None: unlimited)."""

    budget: Optional[int] = None
    pinned: Optional[int] = None

    def fits(self, plan: Plan) -> bool:
        return ((self.budget is None or plan.predicted_host_peak_bytes <= self.budget)
                and (self.pinned is None or plan.pinned_host_bytes <= self.pinned))


def with_step_time(plan: Plan, machine: Optional[Machine], compute_s_per_step: Optional[float] = None,
                   compiled: bool = False) -> Plan:
    """``plan`` with its predicted step time on ``machine`` (None: the default machine, a 25 GB/s link)."""
    plan.machine = machine or Machine()
    plan.step_time = predict_step_time(plan, plan.machine, compute_s_per_step, compiled)
    return plan


def _cost(plan: Plan) -> tuple:
    """Lower is better: the predicted step time (to the millisecond); at the same time, fewer bytes over the link
    and from disk (host-to-GPU weights, activations both ways, disk reads), then no activation offload, then deeper
    prefetch."""
    io = plan.streamed_bytes_per_step + 2 * plan.activation_bytes_per_step + plan.disk_bytes_per_step
    return (round(plan.predicted_step_s, 3), io, plan.activation_offload, -plan.prefetch_depth)


#: The shares of the blocks whose activations auto tries offloading when offloading all of them does not fit the RAM
#: budget (partial activation offload: each step frees a quarter of the activation host RAM).
PARTIAL_OFFLOAD_SHARES = (0.75, 0.5, 0.25)


def partial_offload_counts(num_blocks: int) -> list[int]:
    """How many blocks' activations auto tries offloading when not all fit the RAM budget, most first."""
    return sorted({m for m in (round(num_blocks * f) for f in PARTIAL_OFFLOAD_SHARES) if 0 < m < num_blocks},
                  reverse=True)


def offload_prefix(fp: ModelFootprint, count: int) -> list[int]:
    """The ``count`` blocks whose inputs are offloaded in a partial activation offload: the first in the forward. The
    large blocks come first where a family has two kinds (Flux, Qwen-Image's double blocks, Flux.2's), and offloaded
    blocks stream in parts, which shrinks the ring the most for the same host RAM."""
    return list(range(min(count, fp.num_blocks)))


def disk_orders(fp: ModelFootprint, streamed: Sequence[int]) -> list[list[int]]:
    """The orders streamed blocks may move to the disk tier in, each tried by auto (the step-time model picks):
    the last streamed first (next to the turn, where the staging ring carries a block from the forward into the
    backward, so they are read the fewest times; engine/offload/disk.py), and the smallest first spread evenly over
    the model (alternate halves, quarters, ...; the staging slots are sized for the largest disk block, and the disk's
    reads interleave with the compute of the blocks between them)."""
    def spread(rank: int) -> float:  # van der Corput: 0, 1/2, 1/4, 3/4, ...
        out, base, r = 0.0, 0.5, rank
        while r:
            out, r, base = out + base * (r & 1), r >> 1, base / 2
        return out

    by_size: dict[int, list[int]] = {}
    for i in streamed:
        by_size.setdefault(fp.block_bytes[i], []).append(i)
    spread_order = []
    for size in sorted(by_size):
        ids = by_size[size]
        spread_order += [ids[j] for j in sorted(range(len(ids)), key=spread)]
    last = list(reversed(list(streamed)))
    return [last] + ([spread_order] if spread_order != last else [])


def can_use_disk(fp: ModelFootprint, machine: Optional[Machine]) -> bool:
    """auto may put blocks on the disk tier: the model is a slab (its blocks can be read from the file) and the
    machine's disk read rate is known (engine/offload/disk.py probes it)."""
    return fp.disk_capable and machine is not None and bool(machine.disk_bytes_per_s)


def _with_disk(fp: ModelFootprint, wl: Workload, plan_args: dict, ram: RamLimits, disk_ok: bool,
               timing: dict) -> Optional[Plan]:
    """The plan of ``plan_args`` with the fewest blocks on the disk tier that make it fit ``ram`` (none when it fits
    as it is), in the disk order the step-time model finds fastest; None when even every streamed block on disk
    does not fit."""
    plan = build_plan(fp, wl, **plan_args)
    if ram.fits(plan) or not disk_ok or not plan.streamed:
        return plan if ram.fits(plan) else None
    best = None
    for order in disk_orders(fp, plan.streamed):
        for d in range(1, len(order) + 1):  # disk blocks free RAM once there are more than the staging slots
            candidate = build_plan(fp, wl, disk_blocks=order[:d], **plan_args)
            if ram.fits(candidate):
                with_step_time(candidate, **timing)
                if best is None or _cost(candidate) < _cost(best):
                    best = candidate
                break
    return best


def make_plan(fp: ModelFootprint, wl: Workload, cfg: OffloadConfig, budget_bytes: Optional[int] = None,
              host_ram_bytes: Optional[int] = None, compiled: bool = False, machine: Optional[Machine] = None,
              compute_s_per_step: Optional[float] = None, ram_budget_bytes: Optional[int] = None,
              host_extra: Optional[dict] = None, ram_source: str = "", resume_staging: bool = True) -> Plan:
    """The plan for ``cfg``. ``budget_bytes`` is required for mode='auto' (the caller resolves
    vram_budget_gb=0 to the free VRAM). ``ram_budget_bytes``: the RAM plan's budget (the caller resolves
    ram_budget_gb=0 with engine/offload/hostmem.py; None: unlimited); ``host_ram_bytes``: the machine's RAM (the
    smaller of physical and the cgroup limit), of which the streamer may pin ``cfg.max_pinned_fraction``;
    ``host_extra``: host bytes the run holds beside the plan (``build_plan``); ``ram_source``: how the RAM budget
    was set, for messages; ``resume_staging``: the run saves resumable states (``build_plan``). Raises ConfigError when auto cannot fit both budgets, or an explicit plan does not fit
    the RAM budget. ``compiled``: the blocks will be compiled (engine/train/compile.py), so
    cfg.activation_memory_budget applies, and auto may lower it. ``machine``: the link, disk and GPU the step time is
    predicted for (engine/offload/link.py measures it; None: a 25 GB/s link, no disk tier); auto picks the fastest
    plan on it. ``compute_s_per_step``: the measured resident step of this model and workload, when known (else
    estimated from FLOPs; engine/offload/steptime.py)."""
    if cfg.allocator_margin_gb:  # the plans below keep at least this free under the budget (``margin_bytes``)
        fp = replace(fp, margin_floor_bytes=int(cfg.allocator_margin_gb * GB))
    timing = {"machine": machine, "compute_s_per_step": compute_s_per_step, "compiled": compiled}
    ram = RamLimits(ram_budget_bytes, int(cfg.max_pinned_fraction * host_ram_bytes) if host_ram_bytes else None)
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
             "compiled_budget": cfg.activation_memory_budget if compiled else 1.0,
             "host_extra": host_extra, "ram_budget_bytes": ram_budget_bytes, "resume_staging": resume_staging}
    if cfg.mode == "resident":
        plan = with_step_time(build_plan(fp, wl, range(n), 1, False, reason="mode=resident",
                                         keeps_host_copies=False, **fixed), **timing)
    elif cfg.mode == "stream":
        r = cfg.resident_blocks or 0
        plan = build_plan(fp, wl, order[:r], cfg.prefetch_depth or 2, bool(cfg.activation_offload),
                          reason="mode=stream", **fixed)
        if cfg.disk_blocks:  # the disk tier, forced (benches, tests): the blocks next to the turn
            from .disk import last_streamed

            plan = build_plan(fp, wl, order[:r], cfg.prefetch_depth or 2, bool(cfg.activation_offload),
                              reason="mode=stream", disk_blocks=last_streamed(plan, cfg.disk_blocks), **fixed)
        plan = with_step_time(plan, **timing)
    else:
        if budget_bytes is None:
            raise ValueError("mode='auto' needs budget_bytes")
        plan = _auto(fp, wl, cfg, order, budget_bytes, compiled, timing, ram, ram_source,
                     {"host_extra": host_extra, "resume_staging": resume_staging})
    if ram.pinned is not None and plan.pinned_host_bytes > ram.pinned:
        raise ConfigError(
            f"the plan pins {plan.pinned_host_bytes / GB:.1f} GB of host RAM but max_pinned_fraction="
            f"{cfg.max_pinned_fraction} of this machine's {host_ram_bytes / GB:.0f} GB allows "
            f"{ram.pinned / GB:.1f} GB; keep more blocks resident (a larger "
            f"budget or resident_blocks), turn activation offload off, or raise max_pinned_fraction"
        )
    if ram.budget is not None and not ram.fits(plan):
        raise ConfigError(
            f"mode={cfg.mode!r} needs {plan.predicted_host_peak_bytes / GB:.1f} GB of host RAM but ram_budget_gb="
            f"{ram.budget / GB:.3g}{ram_source} allows {ram.budget / GB:.1f} GB "
            f"({', '.join(f'{k} {v / GB:.2f}' for k, v in plan.host_breakdown.items() if v)} GB in training; "
            f"by phase {', '.join(f'{k} {v / GB:.1f}' for k, v in plan.host_phases.items())} GB). Use mode='auto' "
            f"(it plans for both budgets and can stream a slab's blocks from disk), keep more blocks resident, turn "
            f"activation offload off, or free host RAM / raise ram_budget_gb to at least "
            f"{math.ceil(plan.predicted_host_peak_bytes / GB * 10) / 10:.1f}")
    return plan


def _auto(fp: ModelFootprint, wl: Workload, cfg: OffloadConfig, order: list[int], budget: int,
          compiled: bool = False, timing: Optional[dict] = None, ram: RamLimits = RamLimits(),
          ram_source: str = "", host: Optional[dict] = None) -> Plan:
    """The fastest plan that fits both budgets. Finer recompute and host-held moments cost time but no PCIe bytes,
    so they are escalations: tried only when nothing fits without them (unless set explicitly), or when what fits
    without them needs blocks on the disk tier. Compiled blocks at activation-memory budget 1 (the default) may go
    down to AUTO_COMPILED_BUDGET as a last escalation."""
    timing = timing or {}
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
    disk_ok = can_use_disk(fp, timing.get("machine")) and cfg.disk_blocks != 0  # 0: the user keeps them off disk
    found, ram_refused = [], []
    for chunks, moments, micro, cbudget, outer in escalations:
        plan = _auto_fixed(fp, wl, cfg, order, budget, chunks, moments, micro, cbudget, timing, outer, ram, disk_ok,
                           ram_refused, host)
        if plan is not None:
            found.append(plan)
            if not plan.disk_blocks:  # a later escalation only costs time: stop at the first without disk reads
                break
    if found:
        best = min(found, key=_cost)
        faster = [p for p in ram_refused if _cost(p) < _cost(best)]  # what the RAM budget ruled out
        if faster and best.activation_offload and not best.offload_in_parts and any(fp.unit_bytes):
            best.ram_note = ("activations are offloaded per whole block (one input set each, not one per part): a larger "
                             "working set on the GPU for less host RAM")
        if faster and (not best.activation_offload or best.partial_offload):
            over = min(p.predicted_host_peak_bytes for p in faster) - ram.budget
            which = (f"{fp.num_blocks - len(best.offloaded_blocks)} of {fp.num_blocks} blocks' activations"
                     if best.partial_offload else "activations")
            best.ram_note = (f"{which} stay on the GPU (recompute{' in token chunks' if best.recompute_chunks > 1 else ''}"
                             f" instead of activation offload, which would be faster here): offloading them all would "
                             f"need {over / GB:.1f} GB more host RAM than the RAM budget allows, and activations are "
                             f"never written to disk (SSD wear)")
        if best.disk_blocks:
            best.ram_note = (best.ram_note + "; " if best.ram_note else "") + (
                f"{len(best.disk_blocks)} streamed blocks ({sum(fp.block_bytes[i] for i in best.disk_blocks) / GB:.1f}"
                f" GB) are read from the slab file each time they load: the RAM budget holds the rest")
        return best
    raise _refusal(fp, wl, cfg, order, budget, compiled, escalations, ram, disk_ok, ram_source, host)


def _refusal(fp, wl, cfg, order, budget, compiled, escalations, ram: RamLimits, disk_ok: bool, ram_source: str,
             host_args: Optional[dict] = None):
    """The ConfigError when no plan fits: the smallest (VRAM, RAM) pairs that work, and the fix. The smallest plan is
    the least VRAM over the escalations auto tried (the last is not always it: a compiled budget below 1 saves
    nothing for some families, ``MemoryProfile.compiled_activation_scale``)."""
    def smallest_at(escalation):
        chunks, host, micro, cbudget, outer = escalation
        common = {"recompute_chunks": chunks, "micro_batch": micro, "compiled_budget": cbudget, **(host_args or {})}
        plan = build_plan(fp, wl, order[:cfg.resident_blocks or 0], min([cfg.prefetch_depth] if cfg.prefetch_depth
                                                                        else [2, 1]),
                          cfg.activation_offload if cfg.activation_offload is not None else True, budget,
                          optimizer_on_host=host, outer_on_host=outer, **common)
        return plan.predicted_peak_bytes + plan.margin_bytes, plan, common, escalation

    least, smallest, common, (chunks, host, micro, cbudget, outer) = min(
        (smallest_at(e) for e in escalations), key=lambda t: t[0])
    need = math.ceil((smallest.predicted_peak_bytes + smallest.margin_bytes) / GB * 10) / 10
    if ram.budget is None or not _fits(smallest, budget):  # the VRAM budget is below any plan
        def least_at(compiled_budget: float) -> int:  # the escalations at another activation-memory budget
            return min(smallest_at((c, h, m, compiled_budget, o))[0] for c, h, m, _, o in escalations)

        hint = ""
        if not compiled and least_at(AUTO_COMPILED_BUDGET) < least:  # would compiled blocks need less?
            hint = ("; compiled blocks (compile='blocks', or auto for runs of 200+ steps on a CUDA GPU with Triton) "
                    "need less")
        elif compiled and cfg.activation_memory_budget < 1.0 and least_at(1.0) < least:  # a budget set below 1
            hint = (f"; activation_memory_budget 1 needs less here ({math.ceil(least_at(1.0) / GB * 10) / 10:.1f} "
                    f"GB: this model's compiled blocks save no memory below 1)")
        return ConfigError(
            f"vram_budget_gb={budget / GB:.3g} is below the smallest plan for {fp.name} at "
            f"{wl.label or f'{wl.tokens} tokens'}, batch {wl.batch} ({need:.1f} GB: "
            f"{', '.join(f'{k} {v / GB:.2f}' for k, v in smallest.breakdown.items())} GB + "
            f"{smallest.margin_bytes / GB:.1f} GB headroom"
            + (f"; that plan needs {smallest.predicted_host_peak_bytes / GB:.1f} GB of host RAM"
               if ram.budget is not None else "")
            + f"); raise the budget to at least {need:.1f} GB, or lower the resolution or batch size" + hint)
    # Both budgets matter: the pairs that work at the two ends (the least VRAM, the least RAM).
    pairs = []
    for resident, act, moments, outer_host, c in (
            (order[:cfg.resident_blocks or 0], True if cfg.activation_offload is None else cfg.activation_offload,
             host, outer, chunks),
            (order[:cfg.resident_blocks or 0], bool(cfg.activation_offload), False, False, chunks),
            (list(range(fp.num_blocks)), False, False, False, 1)):
        plan = build_plan(fp, wl, resident, 1, act, budget, optimizer_on_host=moments, outer_on_host=outer_host,
                          **{**common, "recompute_chunks": c})
        if disk_ok and plan.streamed:
            plan = build_plan(fp, wl, resident, 1, act, budget, optimizer_on_host=moments, outer_on_host=outer_host,
                              disk_blocks=plan.streamed, **{**common, "recompute_chunks": c})
        pairs.append((math.ceil((plan.predicted_peak_bytes + plan.margin_bytes) / GB * 10) / 10,
                      math.ceil(plan.predicted_host_peak_bytes / GB * 10) / 10))
    least_vram = min(pairs)
    least_ram = min(pairs, key=lambda p: (p[1], p[0]))
    shown = [least_vram] + ([least_ram] if least_ram != least_vram else [])
    return ConfigError(
        f"no plan for {fp.name} at {wl.label or f'{wl.tokens} tokens'}, batch {wl.batch} fits vram_budget_gb="
        f"{budget / GB:.3g} and ram_budget_gb={ram.budget / GB:.3g}{ram_source} together; the smallest pairs that "
        f"work: {' or '.join(f'{v:.1f} GB VRAM + {r:.1f} GB RAM' for v, r in shown)}. Free host RAM or raise "
        f"ram_budget_gb, or raise vram_budget_gb (more blocks resident need less RAM)"
        + ("" if disk_ok else
           "; disk_blocks=0 keeps every block off the disk tier: leave it unset (-1 on the node) to let auto read "
           "some from the slab file" if cfg.disk_blocks == 0 and fp.disk_capable else
           "; the disk tier needs the slab file's read rate, which was not measured" if fp.disk_capable else
           "; load the model as an int8 slab (precision 'int8 slab'): its blocks can then stream from the slab file "
           "on disk instead of RAM")
        + ", or lower the resolution or batch size")


def _auto_fixed(fp: ModelFootprint, wl: Workload, cfg: OffloadConfig, order: list[int], budget: int,
                chunks: int, host: bool, micro: int, compiled_budget: float = 1.0,
                timing: Optional[dict] = None, outer: bool = False, ram: RamLimits = RamLimits(),
                disk_ok: bool = False, ram_refused: Optional[list] = None,
                host_args: Optional[dict] = None) -> Optional[Plan]:
    """The fastest plan that fits both budgets at these escalations: for each prefetch depth and activation offload
    setting the most resident blocks that fit the VRAM budget (more resident is never slower and needs less RAM),
    with the fewest blocks on the disk tier that make it fit the RAM budget; then the lowest predicted step time.
    ``ram_refused`` collects the activation-offload plans that fit the VRAM budget but not the RAM one."""
    timing = timing or {}
    n = fp.num_blocks
    extra = {"recompute_chunks": chunks, "optimizer_on_host": host, "micro_batch": micro,
             "compiled_budget": compiled_budget, "outer_on_host": outer, **(host_args or {})}
    if cfg.resident_blocks in (None, n):  # nothing streams when everything fits: fastest by far
        everything = build_plan(fp, wl, range(n), 1, False, budget, reason="auto: everything fits the budget",
                                ram_budget_bytes=ram.budget, **extra)
        if _fits(everything, budget) and ram.fits(everything):
            return with_step_time(everything, **timing)
    depths = [cfg.prefetch_depth] if cfg.prefetch_depth else AUTO_DEPTHS
    acts = [cfg.activation_offload] if cfg.activation_offload is not None else [False, True]
    # Partial activation offload (auto only): the inputs of some blocks go to the host, the rest recompute with theirs
    # on the GPU; tried when offloading every block's does not fit the RAM budget (or needs the disk tier), so auto
    # trades host RAM against speed in steps instead of all or nothing.
    # Where the family streams large blocks in parts, offloading whole blocks (one input set each instead of one per
    # part) is the next step down in host RAM, for a larger working set on the GPU.
    levels = [(act, None, True) for act in acts]
    if cfg.activation_offload is not False and ram.budget is not None:
        partial = [offload_prefix(fp, m) for m in partial_offload_counts(n)] if cfg.activation_offload is None else []
        for parts in [True] + ([False] if any(fp.unit_bytes) else []):
            levels += [(True, blocks, parts) for blocks in ([None] if not parts else []) + partial]
    counts = [cfg.resident_blocks] if cfg.resident_blocks is not None else range(n - 1, -1, -1)
    best = None
    for k in depths:
        all_short = False  # offloading every block's inputs did not fit the RAM budget without the disk tier
        for act, offloaded, parts in levels:
            if (offloaded is not None or not parts) and not all_short:
                continue
            for r in counts:  # most resident first: the first that fits is the best for this (k, act)
                args = {"resident": order[:r], "prefetch_depth": k, "activation_offload": act,
                        "budget_bytes": budget, "ram_budget_bytes": ram.budget, "offload_blocks": offloaded,
                        "offload_parts": parts, **extra}
                plan = build_plan(fp, wl, **args)
                if not _fits(plan, budget):
                    continue
                fitted = _with_disk(fp, wl, args, ram, disk_ok, timing)
                if act and offloaded is None and parts and (fitted is None or fitted.disk_blocks):
                    all_short = True
                if fitted is None:
                    if act and ram_refused is not None and ram.budget is not None:
                        ram_refused.append(with_step_time(plan, **timing))
                    break
                with_step_time(fitted, **timing)
                if best is None or _cost(fitted) < _cost(best):
                    best = fitted
                break
    if best is not None:
        best.reason = (f"auto: the fastest plan that fits the budget{'s' if ram.budget is not None else ''} "
                       f"(predicted step time on a {best.machine.describe()})")
    return best
