"""OffloadConfig: how a model's memory is managed while a LoRA trains.

Each field carries its help text in ``metadata["help"]`` (the Offload Config node
shows it as the tooltip), so every trade-off is explained once, here. Fields left
at ``None`` are chosen by the planner (``engine/offload/plan.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

from ..config import INT8_COMPUTE_MODES, field_help  # noqa: F401  (the modes: offered here)
from ..errors import ConfigError

MODES = ("auto", "resident", "stream")
#: What torch.compile applies to (engine/train/compile.py).
COMPILE_MODES = ("auto", "off", "blocks")


@dataclass
class OffloadConfig:
    mode: str = field(default="auto", metadata={"help": (
        "auto: plan from the VRAM budget (all weights resident when they fit, else stream the fewest blocks). "
        "resident: every weight stays on the GPU (fastest; Flux.1-dev needs ~25 GB at 1024). "
        "stream: transformer blocks live in pinned host RAM and are copied to the GPU just ahead of use, "
        "in forward and in backward order."
    )})
    vram_budget_gb: float = field(default=0.0, metadata={"help": (
        "auto only: GPU memory the plan may use, in GB. 0 = 90% of the memory free on the GPU when training "
        "starts. A lower budget streams more blocks (slower), a higher one keeps more resident. A budget set here "
        "is kept: while training, torch's allocator may reserve no more than it (plus what the process held "
        "before), as on a card of that size. Flux.1-dev trains 2048x2048 in 4 GB with compiled blocks."
    )})
    ram_budget_gb: float = field(default=0.0, metadata={"help": (
        "Host RAM the run may use, in GB: pinned streamed blocks, offloaded activations, host-held AdamW moments, "
        "the disk tier's staging buffers, the resume-save copy, a preview partner and the process itself. 0 = 85% "
        "of what is free when training starts: the smaller of the machine's RAM and its container (cgroup) memory "
        "limit, less what other programs hold. auto plans for this budget and the VRAM one together: when RAM is "
        "short it recomputes instead of offloading activations (activations never go to disk), keeps more blocks "
        "on the GPU where VRAM allows, and streams the remaining blocks from the slab file on disk; an explicit "
        "stream or resident plan that does not fit is refused before loading, with the smallest budget that works."
    )})
    resident_blocks: Optional[int] = field(default=None, metadata={"help": (
        "stream/auto: blocks kept on the GPU for the whole run; the largest blocks are chosen, since they save "
        "the most copy time. None: 0 in stream mode, as many as the budget allows in auto."
    )})
    prefetch_depth: Optional[int] = field(default=None, metadata={"help": (
        "stream/auto: blocks copied ahead of the one computing (the ring holds depth + 1 blocks). 1 is double "
        "buffering (least memory); 2 absorbs uneven block times; 3 helps where the forward is copy-bound (a slow "
        "link). None: 2 in stream mode; auto picks 1-3, whichever its step-time model predicts fastest on this "
        "machine's measured host-to-GPU link within the budget."
    )})
    activation_offload: Optional[bool] = field(default=None, metadata={"help": (
        "stream/auto: move each checkpointed block's inputs to pinned host RAM after its forward and back "
        "before its backward, overlapped with compute. Saves about blocks x tokens x hidden x 2 bytes "
        "(1.6 GB for Flux.1-dev at 1024, 6 GB at 2048) for extra PCIe traffic. With it, large blocks (Flux "
        "double blocks) stream and recompute as two parts, attention and feed-forward, which halves the "
        "weights on the GPU at once. None: off in stream mode; auto turns it on when the budget needs it, or "
        "when its step-time model predicts it faster (more blocks resident for the memory it frees)."
    )})
    gradient_checkpointing: bool = field(default=True, metadata={"help": (
        "Recompute each block's activations during backward instead of storing them: much less VRAM for "
        "about a third more compute. Streaming requires it."
    )})
    int8_compute: str = field(default="dequant", metadata={"help": (
        "int8 slabs only: how slab layers multiply. dequant (default): the int8 weight is turned back into bf16 "
        "just before a bf16 matmul (exact to the slab's weights); the fastest measured. fp8: activations are "
        "quantized per token to fp8 and the int8 weight is cast to fp8 (3 mantissa bits), multiplied on the fp8 "
        "tensor cores (CUDA, RTX 40xx / L4 / H100 and newer). w8a8: the same with int8 x int8. Both were measured "
        "slower than dequant on the H100 (Flux.1-dev 1024, resident: fp8 1.24 s, w8a8 1.33 s, dequant 1.05 s per "
        "step) and fp8 triples the output error (bench/RESULTS.md). The LoRA always trains in bf16/fp32."
    )})
    recompute_chunks: Optional[int] = field(default=None, metadata={"help": (
        "Finer recompute: the token-wise parts of each block (feed-forwards; in Flux.1 single blocks everything "
        "after attention) run in this many checkpointed token chunks, so a block's backward holds one chunk's "
        "MLP activations instead of all of them (Flux.1-dev at 2048: the largest single memory cost). 1 = whole "
        "blocks. Costs one more forward of those parts. None: 1, or what auto needs to fit its budget."
    )})
    optimizer_on_host: Optional[bool] = field(default=None, metadata={"help": (
        "Keep the AdamW moments (8 bytes per LoRA weight, 0.37 GB for a Flux.1 r16 LoRA) in pinned host RAM "
        "between steps; they are copied in for the optimizer step, after the activations are gone, and back. "
        "With an EMA (ema_decay) its copy (4 bytes per weight) waits there too. "
        "None: off, unless auto needs the memory. adamw only."
    )})
    outer_on_host: Optional[bool] = field(default=None, metadata={"help": (
        "Keep the large layers outside the blocks (the family's int8_extra_linears: Flux.2-dev's global modulation "
        "and text embedder, 0.66 GB in int8; Wan's time and text embedders) in pinned host RAM, each copied in for "
        "its one run per forward and dropped after it, so they are not on the GPU when the backward peaks. Costs "
        "one copy of them per forward. None: off, unless auto needs the memory."
    )})
    micro_batch_size: Optional[int] = field(default=None, metadata={"help": (
        "Samples per forward/backward: a batch of more runs in pieces of this size, their gradients "
        "accumulated, which gives the same gradient as the whole batch with activations for one piece "
        "(Flux.1-dev at 2048, batch 2: the VRAM of batch 1). None: the whole batch, or 1 when auto needs it."
    )})
    compile: str = field(default="auto", metadata={"help": (
        "blocks: torch.compile each transformer block's own computation (fused norms, modulation, activations "
        "and LoRA adds), once per block type; streaming and activation offload keep working around it. "
        "Measured on an H100 (Flux.1-dev, 1024): 0.67x the eager step time; the first step compiles (about "
        "40-55 s, the log says how long). On CUDA it needs Triton; on the CPU inductor builds C++ (slow to "
        "start). auto: blocks on a CUDA GPU with Triton for runs of 200 steps or more (where the compile time "
        "pays back), else off. off: eager."
    )})
    activation_memory_budget: float = field(default=1.0, metadata={"help": (
        "compile=blocks only: torch's activation-memory budget for the compiled blocks (0..1). 1 keeps what "
        "eager keeps for backward; lower values recompute cheap pointwise ops in backward instead of storing "
        "them: less VRAM in each block's backward for a little more compute. With mode=auto, 1 lets auto go "
        "down to 0.5 when its VRAM budget needs it (its last resort); a lower value is kept as set."
    )})
    disk_blocks: Optional[int] = field(default=None, metadata={"help": (
        "How many streamed blocks are read from the slab file on disk at every load instead of being held in "
        "pinned host RAM (the disk tier; int8 slabs only). Saves their host RAM for disk reads each step: fine on "
        "an NVMe drive when the step's compute hides them. Activations never go to disk. stream: this many blocks, "
        "those that run last in the forward (next to the turn into the backward, they are read the fewest times). "
        "auto: 0 keeps every block off the disk (a RAM budget that needs the disk tier is then refused); another "
        "count is for stream mode. None: none in stream mode; auto decides from the RAM budget."
    )})
    allocator_margin_gb: Optional[float] = field(default=None, metadata={"help": (
        "VRAM auto keeps free under vram_budget_gb for the caching allocator's unusable holes, at least. None: the "
        "family's measured margin (0.5 GB, or more where its wide tensors leave larger holes). Raise it when a run "
        "ran out of memory under its budget: the error names the value that covers what that step needed."
    )})
    max_pinned_fraction: float = field(default=0.8, metadata={"help": (
        "Largest share of the machine's RAM (the smaller of physical RAM and the cgroup limit) the plan may "
        "page-lock: pinned memory cannot be swapped, and pinning too much starves the rest of the system. A cap on "
        "the pinned part only, inside ram_budget_gb (which counts every host byte and is what auto plans for); "
        "auto keeps to both."
    )})

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"offload mode={self.mode!r} is not one of {', '.join(MODES)}")
        if self.vram_budget_gb < 0:
            raise ConfigError(f"vram_budget_gb={self.vram_budget_gb} must be >= 0 (0 = most of the free VRAM)")
        if self.vram_budget_gb and self.mode != "auto":
            raise ConfigError(
                f"vram_budget_gb={self.vram_budget_gb} only applies to mode='auto' (mode is {self.mode!r}); "
                f"set mode='auto' or leave the budget at 0"
            )
        if not self.ram_budget_gb >= 0 or self.ram_budget_gb == float("inf"):  # NaN fails this too
            raise ConfigError(f"ram_budget_gb={self.ram_budget_gb} must be a finite number >= 0 (0 = 85% of the "
                              f"RAM free when training starts)")
        if self.resident_blocks is not None and self.resident_blocks < 0:
            raise ConfigError(f"resident_blocks={self.resident_blocks} must be >= 0 (or None to let auto choose)")
        if self.prefetch_depth is not None and not 1 <= self.prefetch_depth <= 8:
            raise ConfigError(f"prefetch_depth={self.prefetch_depth} must be between 1 and 8 (or None)")
        if self.recompute_chunks is not None and not 1 <= self.recompute_chunks <= 64:
            raise ConfigError(f"recompute_chunks={self.recompute_chunks} must be between 1 and 64 (or None)")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ConfigError(f"micro_batch_size={self.micro_batch_size} must be >= 1 (or None)")
        if self.int8_compute not in INT8_COMPUTE_MODES:
            raise ConfigError(f"int8_compute={self.int8_compute!r} is not one of {', '.join(INT8_COMPUTE_MODES)}")
        if self.compile not in COMPILE_MODES:
            raise ConfigError(f"compile={self.compile!r} is not one of {', '.join(COMPILE_MODES)}")
        if not 0.0 < self.activation_memory_budget <= 1.0:  # NaN fails this too
            raise ConfigError(f"activation_memory_budget={self.activation_memory_budget} must be in (0, 1] "
                              f"(1 = save what eager saves)")
        if self.activation_memory_budget < 1.0 and self.compile == "off":
            raise ConfigError(f"activation_memory_budget={self.activation_memory_budget} applies to compiled "
                              f"blocks only; set compile='blocks' or leave the budget at 1")
        if self.allocator_margin_gb is not None and not 0 <= self.allocator_margin_gb < 64:  # NaN fails this too
            raise ConfigError(f"allocator_margin_gb={self.allocator_margin_gb} must be a number of GB in [0, 64) (or "
                              f"None for the family's measured margin)")
        if self.disk_blocks is not None and self.disk_blocks < 0:
            raise ConfigError(f"disk_blocks={self.disk_blocks} must be >= 0 (or None)")
        if self.disk_blocks and self.mode != "stream":
            raise ConfigError(f"disk_blocks={self.disk_blocks} only applies to mode='stream' (mode is "
                              f"{self.mode!r}); auto picks disk blocks from the RAM budget (0 forbids them). Set "
                              f"mode='stream', or disk_blocks to 0 or None (-1 on the node)")
        if not 0.0 < self.max_pinned_fraction <= 0.95:
            raise ConfigError(f"max_pinned_fraction={self.max_pinned_fraction} must be in (0, 0.95]")
        if self.mode == "resident":
            set_fields = [n for n in ("resident_blocks", "prefetch_depth", "activation_offload", "outer_on_host")
                          if getattr(self, n) is not None]
            if set_fields:
                raise ConfigError(
                    f"{', '.join(set_fields)} only apply to streaming; mode='resident' keeps every block on the "
                    f"GPU. Use mode='stream' or 'auto', or leave them at None"
                )
        if self.mode != "resident" and not self.gradient_checkpointing:
            raise ConfigError(
                f"mode={self.mode!r} needs gradient_checkpointing=True: without it autograd keeps references to "
                f"every block's weights for the backward pass, and a streamed block's GPU slot is overwritten "
                f"by the next block long before then (wrong gradients, silently). Turn checkpointing on, or use "
                f"mode='resident'"
            )

    @property
    def streams(self) -> bool:
        """True when blocks may be streamed (the planner may still keep all resident in auto)."""
        return self.mode != "resident"


def help_text(name: str) -> str:
    """The help text of one OffloadConfig field (node tooltips)."""
    return field_help(OffloadConfig, name)
