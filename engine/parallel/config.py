"""ParallelConfig: how training uses more than one GPU (what the Dual-GPU Split node outputs).

Each field carries its help text in ``metadata["help"]``; the node's tooltips come from it.
Torch-free, so the node can build its widgets without importing torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from ..config import field_help
from ..errors import ConfigError

MODES = ("split", "data_parallel", "experts")
#: The most chunks per GPU the interleaved split takes (each adds two crossings per micro-batch).
MAX_VIRTUAL_STAGES = 4


@dataclass
class ParallelConfig:
    mode: str = field(default="split", metadata={"help": (
        "split: the transformer's blocks are cut in two; the first part runs on the first GPU, the rest on the "
        "second (each part may stream from host RAM and use int8 slabs). One image at a time, each GPU holds "
        "about half the model: for a model too big for one card's budget. data_parallel: one training "
        "process per GPU, each with the whole (streamed) model and its own images; LoRA gradients are averaged "
        "after every micro-batch, so the effective batch is GPUs x batch_size and images/s scale with the GPUs. "
        "experts: a two-expert model (Wan 2.2 A14B): the expert connected to Train LoRA's model trains on the first "
        "GPU and the one connected to its preview_partner on the second, at the same time, each on its own noise "
        "levels from the one cached dataset; two LoRAs, each the same as a one-expert run with the same seed."
    )})
    devices: tuple[str, ...] = field(default=("cuda:0", "cuda:1"), metadata={"help": (
        "The GPUs to use, e.g. cuda:0,cuda:1. split uses exactly two; data_parallel one process per device."
    )})
    cut: int = field(default=-1, metadata={"help": (
        "split only: the first block (in execution order: double blocks, then single blocks) that runs on the "
        "second GPU. -1 = auto: the cut that streams the fewest bytes with each side inside its budget, "
        "the two peaks balanced."
    )})
    micro_batches: int = field(default=1, metadata={"help": (
        "split only: cut each batch into this many micro-batches and pipeline them through the two parts (1F1B), "
        "so both GPUs work at once: the first GPU runs micro-batch k+1's first half while the second runs micro-batch "
        "k's second half. The micro-batches come from the batch (batch_size 4, micro_batches 4: one image each) or, "
        "with a smaller batch, from gradient accumulation (batch_size 1, gradient_accumulation 8, micro_batches 8: "
        "the 8 accumulated images flow through together; gradient_accumulation must be a multiple of "
        "micro_batches / batch_size). The gradient is the step's, as without it. A two-part pipeline flushed every "
        "optimizer step is at most 2M/(M+1) times faster than the parts one after the other (1.6x at 4, 1.78x at "
        "8, 1.88x at 16). Each micro-batch also costs its Python once more, and both GPUs share one interpreter: "
        "where that binds (Flux.1-dev: about 0.6 s a micro-batch) fewer micro-batches of more images are faster. "
        "0 = auto: the batch one image a micro-batch, halved while the step is host-bound and that predicts a "
        "shorter one (1 where batch_size is 1). "
        "1 = the parts one after the other. Needs LoRA only inside the transformer blocks."
    )})
    virtual_stages: int = field(default=1, metadata={"help": (
        "split with micro_batches > 1 only: interleaved stages (Megatron's interleaved 1F1B). The blocks are cut into "
        "2 x this many chunks, every other one on each GPU (2: chunks 0 and 2 on the first GPU, 1 and 3 on the "
        "second), so the pipeline fills and drains in 1/v of the time: at most 2M/(M + 1/v) times faster than the "
        "parts one after the other (M = 4: 1.6x at 1, 1.78x at 2, 1.85x at 3), for 2v - 1 crossings between the GPUs "
        "per micro-batch each way and more block inputs held on the first GPU (planned inside its budget). Needs "
        "micro_batches a multiple of 2 and cut -1. 0 = auto: the value with the shortest predicted step that fits "
        "(1 where micro_batches is odd). 1 = one part per GPU."
    )})
    one_process_per_gpu: bool = field(default=False, metadata={"help": (
        "split with micro_batches other than 1 only: run each part in a training process of its own (started as "
        "data_parallel's are), so each GPU's Python has its own interpreter instead of both parts sharing one: the "
        "host time a pipelined step cannot go below falls by up to half (measured on one H200, narrow Flux.1-dev, 8 "
        "micro-batches: 4.87 -> 3.80 s eager, 3.74 -> 2.26 s compiled). The LoRA is the same. Not yet with "
        "virtual_stages above 1, previews, validation images or differential output preservation, and a stopped "
        "run starts over (no resumable state yet)."
    )})
    vram_budget_gb: tuple[float, ...] = field(default=(0.0,), metadata={"help": (
        "GPU memory each device may use, in GB, in the order of devices (one value applies to all). 0 = 90% of "
        "the memory free on that GPU. With Offload Config mode=auto each side then streams the fewest blocks "
        "that fit; this replaces Offload Config's single vram_budget_gb."
    )})

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"parallel mode={self.mode!r} is not one of {', '.join(MODES)}")
        devices = tuple(str(d).strip() for d in self.devices if str(d).strip())
        if len(devices) < 2:
            raise ConfigError(f"devices={self.devices!r}: name at least two GPUs, e.g. cuda:0,cuda:1")
        gpus = [d for d in devices if d != "cpu"]
        if self.mode == "data_parallel" and len(set(gpus)) != len(gpus):
            # (split may put both parts on one GPU: a test of the split itself; CPU ranks are for tests)
            raise ConfigError(f"devices={self.devices!r} names a GPU twice; data parallel runs one process "
                              f"per GPU, name each once")
        for d in devices:
            if not (d.startswith("cuda:") and d[5:].isdigit()) and d != "cpu":
                raise ConfigError(f"device {d!r} is not of the form cuda:N (e.g. cuda:1)")
        if self.mode in ("split", "experts") and len(devices) != 2:
            raise ConfigError(f"{self.mode} uses exactly two GPUs; devices={devices!r} names {len(devices)}"
                              + (". Use data_parallel for more" if self.mode == "split" else
                                 " (one per expert)"))
        self.devices = devices
        budgets = tuple(self.vram_budget_gb) if isinstance(self.vram_budget_gb, (list, tuple)) else (self.vram_budget_gb,)
        for b in budgets:
            if not isinstance(b, (int, float)) or isinstance(b, bool) or not math.isfinite(b) or b < 0:
                raise ConfigError(f"vram_budget_gb={self.vram_budget_gb!r}: each budget must be a finite number "
                                  f">= 0 (0 = most of that GPU's free memory)")
        if len(budgets) == 1:
            budgets = budgets * len(devices)
        if len(budgets) != len(devices):
            raise ConfigError(f"vram_budget_gb has {len(budgets)} values for {len(devices)} devices; give one "
                              f"per device, or one for all")
        self.vram_budget_gb = tuple(float(b) for b in budgets)
        if not isinstance(self.cut, int) or self.cut < -1 or self.cut == 0:
            raise ConfigError(f"cut={self.cut!r} must be -1 (auto) or a block index >= 1")
        if self.mode != "split" and self.cut != -1:
            raise ConfigError(f"cut={self.cut} only applies to split mode; leave it at -1 for {self.mode}")
        if not isinstance(self.micro_batches, int) or isinstance(self.micro_batches, bool) or not \
                0 <= self.micro_batches <= 64:
            raise ConfigError(f"micro_batches={self.micro_batches!r} must be a whole number from 0 (auto) to 64 (1 = "
                              f"not pipelined)")
        if self.mode != "split" and self.micro_batches != 1:
            raise ConfigError(f"micro_batches={self.micro_batches} only applies to split mode; leave it at 1 for "
                              f"{self.mode}")
        v = self.virtual_stages
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_VIRTUAL_STAGES:
            raise ConfigError(f"virtual_stages={v!r} must be a whole number from 0 (auto) to {MAX_VIRTUAL_STAGES} "
                              f"(1 = not interleaved)")
        if v != 1 and self.mode != "split":
            raise ConfigError(f"virtual_stages={v} only applies to split mode; leave it at 1 for {self.mode}")
        check_virtual_stages(v, self.micro_batches, None if self.cut == -1 else self.cut)
        if self.one_process_per_gpu:
            if self.mode != "split":
                raise ConfigError(f"one_process_per_gpu only applies to split mode ({self.mode} runs one process per "
                                  f"GPU already, or one in all); leave it off")
            if self.micro_batches == 1:
                raise ConfigError("one_process_per_gpu pipelines micro-batches through the two processes, but "
                                  "micro_batches is 1: set micro_batches to 0 (auto) or 2 or more, or turn "
                                  "one_process_per_gpu off")
            if v != 1:
                raise ConfigError(f"one_process_per_gpu runs one part per process (virtual_stages 1) so far; "
                                  f"virtual_stages is {v}: set it to 1, or turn one_process_per_gpu off")

    @property
    def world_size(self) -> int:
        return len(self.devices) if self.mode == "data_parallel" else 1


def check_virtual_stages(virtual_stages: int, micro_batches: int, cut: Optional[int],
                         num_blocks: Optional[int] = None) -> None:
    """What an interleaved split cannot run, refused with the fix: the node's settings (ParallelConfig) and the
    split planner (engine/parallel/split.py, which also knows the model's ``num_blocks``) ask the same."""
    if virtual_stages > 1 and micro_batches != 0 and (micro_batches < 2 or micro_batches % 2):
        raise ConfigError(f"virtual_stages={virtual_stages} interleaves micro-batches in groups of 2, but "
                          f"micro_batches is {micro_batches}: set micro_batches to a multiple of 2 (e.g. 4), or "
                          f"virtual_stages to 1 (0 = auto picks 1 then)")
    if virtual_stages != 1 and cut is not None:
        raise ConfigError(f"cut={cut} places the one cut of virtual_stages 1; with virtual_stages={virtual_stages} "
                          f"the planner places every chunk's cut: leave cut at -1, or set virtual_stages to 1")
    if num_blocks is not None and 2 * virtual_stages > num_blocks:
        raise ConfigError(f"virtual_stages={virtual_stages} cuts the model into {2 * virtual_stages} chunks but it "
                          f"has {num_blocks} blocks; lower virtual_stages")


def help_text(name: str) -> str:
    return field_help(ParallelConfig, name)


def parse_devices(text: str) -> tuple[str, ...]:
    """'cuda:0, cuda:1' or '0,1' -> ('cuda:0', 'cuda:1')."""
    out = []
    for part in str(text).replace(";", ",").split(","):
        part = part.strip()
        if part:
            out.append(f"cuda:{part}" if part.isdigit() else part)
    return tuple(out)


def parse_budgets(text: str) -> tuple[float, ...]:
    """'12, 12' -> (12.0, 12.0); a clear error for anything that is not a number."""
    out = []
    for part in str(text).replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        try:
            out.append(float(part))
        except ValueError:
            raise ConfigError(f"vram_budget_gb={text!r}: {part!r} is not a number (e.g. 12,12 or 0)") from None
    return tuple(out) or (0.0,)
