"""Where the frozen weights live while a LoRA trains: decided once, held by one object.

Three placements:

- ``Resident``: every weight on the training device (a GPU it fits on, or the CPU).
- ``Streamed``: the transformer blocks stream from pinned host memory through one GPU
  (engine/offload/streamer.py), per a plan made from the VRAM budget.
- ``Split``: the blocks cut across two devices, each part planned and placed (or streamed)
  within its own budget (engine/parallel/split.py).

``choose_placement`` is the single place that takes the resident / stream / split decision,
from Offload Config, the split and the device. The loop then asks the placement what it needs
(its devices, the memory options its plan chose, the allocator cap, per-step reports) without
asking which kind it is. Each placement makes its plan (``plan``: the one place training asks
for an offload plan, from the checkpoint's header before loading when it can, and from the
loaded model), applies it (``apply``: LoRA attached, weights moved or streamed; undone if it
fails) and undoes it (``remove``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import contextlib
import re
from typing import NamedTuple, Optional

import torch

from ..callbacks import TrainingCallback
from ..config import TrainConfig
from ..errors import ConfigError
from ..models import resolve_device
from ..offload import OffloadConfig
from ..offload.block_checkpoint import checkpoint
from .lora_attach import attach_lora, detach_lora
from .optimizers import lora_bytes_per_param


class MemoryOptions(NamedTuple):
    """How the training step spends memory: from the plan when blocks stream (auto may have chosen them),
    else as set in Offload Config."""

    recompute_chunks: int  # token chunks of the finer recompute (1: whole blocks)
    optimizer_on_host: bool  # AdamW moments in pinned host RAM between steps (needs a GPU to leave)
    micro_batch: int  # samples per forward/backward (0: the whole batch)


def ram_budget(offload: OffloadConfig) -> tuple[int, int, str]:
    """(the RAM budget in bytes, the machine's RAM: min(physical, cgroup limit), how the budget was set for
    messages): ``ram_budget_gb``, or with 0 the auto budget (engine/offload/hostmem.py)."""
    from ..offload.hostmem import ram_cap_bytes, resolve_ram_budget

    ram = resolve_ram_budget(offload.ram_budget_gb)
    return ram.bytes, ram_cap_bytes(), "" if ram.source == "set" else f" (0 = auto: {ram.describe()})"


def training_device(train: TrainConfig, split=None, stage=None) -> torch.device:
    """The device training runs on: the split's first device (with one process per part, ``stage``: its part's
    device), else TrainConfig's."""
    return torch.device(split.devices[stage or 0]) if split is not None else resolve_device(train.device)


def choose_placement(offload: Optional[OffloadConfig], split, device: torch.device,
                     callback: Optional[TrainingCallback] = None) -> "Placement":
    """Resident, Streamed or Split, decided here only. ``offload``: None or mode='resident' keeps every
    weight on ``device``; 'stream' / 'auto' stream blocks (CUDA only: auto on a CPU stays resident, an
    explicit 'stream' is refused). ``split`` (engine/parallel/config.ParallelConfig, mode 'split') plans
    each part on its own device; auto on a CPU keeps both parts resident."""
    cb = callback or TrainingCallback()
    if split is not None and split.mode != "split":
        raise ConfigError(f"Dual-GPU Split mode {split.mode!r} starts worker processes: train through "
                          f"engine.runs.result_reuse.train_or_reuse (what the node and `lowvram-lora run` call)")
    if split is not None:
        from ..parallel.split import check_split_devices

        check_split_devices(split, offload)
        offload = offload or OffloadConfig(mode="resident")
        if offload.mode == "auto" and device.type != "cuda":
            cb.log("offload mode 'auto' on the CPU: both parts of the split stay resident")
            offload = OffloadConfig(mode="resident", gradient_checkpointing=True)
        return Split(offload, device, split)
    if offload is not None and offload.streams:
        if offload.mode == "auto" and device.type != "cuda":
            # auto means "choose for me": on a CPU the only choice is resident (an explicit
            # mode='stream' still gets require_cuda's error below).
            cb.log("offload mode 'auto' on the CPU: every weight stays resident (streaming needs a CUDA GPU)")
            return Resident(offload, device)
        from ..offload.streamer import require_cuda

        require_cuda(offload, device)
        return Streamed(offload, device)
    return Resident(offload, device)


class Placement(ABC):
    """What the three placements share. ``handle``: the OffloadHandle / SplitHandle once applied."""

    kind = ""

    def __init__(self, offload: Optional[OffloadConfig], device: torch.device):
        self.offload, self.device = offload, device
        self.handle = None
        # Host bytes the run holds beside the plan, by name (the loop sets "preview partner" before planning): the
        # RAM plan counts them (engine/offload/plan.py host_bytes).
        self.host_extra: dict[str, int] = {}
        self.slab_path = None  # the checkpoint is an int8 slab here: its blocks can stream from disk
        self.saves_state = True  # the run writes resumable states (the loop says): a save stages them in host RAM
        self.preservation = False  # each micro-step also runs preservation's passes (the loop says; step time)
        self.ema = False  # the run keeps an EMA of the adapter (the loop says): the plan places and counts it
        # The modulation window's weights stay in the slab file's map, read once per window, and its host bytes go to
        # blocks instead (Streamed.plan decides when host RAM is short; engine/train/step_window.py).
        self.window_from_file = False
        self.ranks = None  # the run's ranks (the loop says): a process split places only its own part
        # The run loaded the model itself and drops it at the end (the loop says): a process split then releases the
        # frozen weights of the part it does not run.
        self.model_is_own = False
        self._model = None  # the model LoRA is attached to, until remove()
        self._checkpointing_on = False  # whether apply turned gradient checkpointing on

    # --- deciding, planning, applying ---------------------------------------------------------------

    @property
    def checkpointing(self) -> bool:
        """Gradient checkpointing is a memory setting: it lives in Offload Config only (on by default)."""
        return self.offload.gradient_checkpointing if self.offload is not None else True

    @property
    def devices(self) -> tuple[torch.device, ...]:
        return (self.device,)

    def compiles(self, train: TrainConfig) -> tuple[bool, str]:
        """(whether the blocks will be compiled, why not when auto says no): decided before planning, since
        compiled blocks change what the plan needs (engine/offload/plan.py)."""
        from .compile import why_not_auto

        mode = self.offload.compile if self.offload is not None else "auto"
        if mode == "auto":
            why_not = why_not_auto(self.device, train.steps, self.kind == "split")
            return why_not is None, why_not or ""
        return mode == "blocks", ""

    def window_blocker(self, train: TrainConfig) -> str:
        """Why the modulation window (engine/train/step_window.py) cannot run with this placement ('' when it can)."""
        return ""

    def module_devices(self) -> Optional[dict]:
        """id(module inside a block) -> the device it runs on, where that is not the training device (a split's second
        part): the modulation window keeps a flagged module's outputs there. None: every module on ``device``."""
        return None

    def remote_modules(self) -> set[int]:
        """id(module) of every module inside a block another process runs (a process split's other part)."""
        return set()

    def plan_before_loading(self, ident, family_id: str, dataset, lora, train: TrainConfig,
                            dtype: torch.dtype) -> None:
        """Plan from the checkpoint's header alone, so an impossible budget is refused before minutes of
        loading. Streaming does; resident has no plan, and a split is planned once loaded (each part's LoRA
        elements are counted off the attached model)."""

    @abstractmethod
    def apply(self, model, family, variant: str, dataset, lora, train: TrainConfig,
              callback: TrainingCallback) -> list[torch.nn.Parameter]:
        """Attach LoRA and put the weights in place; returns the trainable parameters. Undone if it fails."""

    def _attach(self, model, family, lora, train: TrainConfig, checkpointing: bool) -> list[torch.nn.Parameter]:
        """Gradient checkpointing (when asked) and LoRA, fp32, wherever the layers are now."""
        self._model = model
        if checkpointing:
            model.enable_gradient_checkpointing(gradient_checkpointing_func=checkpoint)
            self._checkpointing_on = True
        try:
            return attach_lora(model, family, lora, train.seed)
        except BaseException:
            self.remove()
            raise

    def _per_weight(self, fp, train: TrainConfig) -> None:
        """The bytes per adapter weight the plan counts: the optimizer's (with the weight and its gradient), the EMA's."""
        from ..offload.plan import EMA_BYTES_PER_PARAM

        fp.lora_bytes_per_param = lora_bytes_per_param(train)
        fp.ema_bytes_per_param = EMA_BYTES_PER_PARAM if self.ema else 0.0

    def remove(self) -> None:
        """Undo ``apply``: streaming stopped (frozen tensors back where they were; streamed blocks to their
        pinned host buffers), LoRA detached, checkpointing off again. A resident model stays on its device
        (a loaded one is dropped after training; a preloaded one trains there again)."""
        model, self._model = self._model, None
        if model is None:
            return
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        detach_lora(model)
        if self._checkpointing_on:
            model.disable_gradient_checkpointing()
            self._checkpointing_on = False

    # --- what the loop asks ---------------------------------------------------------------------------

    def plans(self) -> tuple:
        """The offload plans in force (one per streamed device; none when resident)."""
        return ()

    def pipeline(self):
        """The pipelined split's runner (engine/parallel/pipeline.py) that runs a batch's pieces, or None."""
        return None

    def memory_options(self) -> MemoryOptions:
        plans = self.plans()
        if plans:
            chunks, host = max(p.recompute_chunks for p in plans), any(p.optimizer_on_host for p in plans)
            micro = min(p.micro_batch or 0 for p in plans)
        elif self.offload is not None:
            chunks, host = self.offload.recompute_chunks or 1, bool(self.offload.optimizer_on_host)
            micro = self.offload.micro_batch_size or 0
        else:
            chunks, host, micro = 1, False, 0
        return MemoryOptions(chunks, host and self.device.type == "cuda", micro)

    def compile_budget(self) -> float:
        """The compiled blocks' activation-memory budget, as set in Offload Config."""
        return self.offload.activation_memory_budget if self.offload is not None else 1.0

    @property
    def pinned_gb(self) -> float:
        return sum(p.pinned_host_bytes for p in self.plans()) / 1e9

    @property
    def predicted_host_gb(self) -> float:
        """The RAM plan's predicted peak (one process holds every part: its base once); 0 without a plan."""
        from ..offload.plan import PROCESS_BASE_BYTES

        plans = self.plans()
        if not plans:
            return 0.0
        return round((sum(p.predicted_host_peak_bytes for p in plans) - (len(plans) - 1) * PROCESS_BASE_BYTES) / 1e9, 2)

    def cap_allocator(self, held_before: dict, callback: TrainingCallback):
        """The context training runs in: each device's allocator held to its explicit auto budget (streamed and
        split placements; ``held_before``: what the process held on each device before training)."""
        return contextlib.nullcontext()

    def end_step(self, step: int, callback: TrainingCallback) -> float:
        """After each optimizer step: harvest the copy timings, report the peak on steps 1 and 2; returns this
        step's compute stall on copies (s)."""
        if self.handle is not None:
            self.handle.end_step()
            if step <= 2:  # step 2: steady state, the AdamW moments exist during backward
                callback.log(self.handle.peak_report(step))
                if self.plans() and self.device.type == "cuda":
                    from ..offload.streamer import host_memory_line

                    budget = max(p.ram_budget_bytes or 0 for p in self.plans())
                    callback.log(f"  {host_memory_line(int(self.predicted_host_gb * 1e9), budget)}")
        return self.last_stall_s()

    def last_stall_s(self) -> float:
        """The last step's compute stall on copies (s): none where nothing streams."""
        return 0.0

    def record_peaks(self, settings: dict) -> None:
        """After the last step: per-device peaks where there is more than one device."""

    def report(self, settings: dict) -> None:
        """Before ``remove``: the plan and the streaming counters into the result's settings."""
        if self.handle is not None:
            settings["offload_plan"] = self.handle.plan.summary()
            settings["offload_stats"] = self.handle.stats()

    def _plan_on(self, message: str):
        """The plan of the device torch's out-of-memory message names ("GPU N"), or the only plan; None: unknown."""
        plans = self.plans()
        if len(plans) == 1:
            return plans[0]
        gpu = re.search(r"\bGPU (\d+)\b", message)
        for device, plan in zip(self.devices, plans):
            if gpu is not None and device.type == "cuda" and device.index == int(gpu.group(1)):
                return plan
        return None

    def out_of_memory(self, exc: BaseException, family) -> torch.cuda.OutOfMemoryError:
        """CUDA ran out of memory while training: the error to raise, with what to change (from torch's figures where
        the budget capped the allocator: ``oom_margin_advice``)."""
        from ..offload.plan import oom_margin_advice

        advice = oom_margin_advice(str(exc), self._plan_on(str(exc)))
        return torch.cuda.OutOfMemoryError(
            f"CUDA out of memory while training {family.display_name} with block streaming on "
            f"{', '.join(str(d) for d in self.devices)}: "
            f"{exc}\n{self.handle.plan.describe()}\n" + (advice or
            "Lower vram_budget_gb (more blocks stream), turn activation offload on, use prefetch_depth=1, or lower "
            "the resolution or batch size. Under an auto budget the allocator is held to the budget: other programs "
            "on the GPU do not count, but fragmentation does; raise Offload Tuning's allocator_margin_gb by 0.5 if "
            "the plan's prediction was close to the budget."))


class Resident(Placement):
    """Every weight on the training device, LoRA with it."""

    kind = "resident"

    def window_blocker(self, train: TrainConfig) -> str:
        # Measured 2026-11-27 (H200, tests/test_compile.py): compiled blocks under diffusers' own checkpointing (this
        # placement's) recompute other tensors than their forward saved when the window serves the modulation
        # (torch's CheckpointError). Streamed placements checkpoint through the offload hooks, and run.
        if self.device.type == "cuda" and self.compiles(train)[0]:
            return "compiled blocks with every weight resident: not yet supported"
        return ""

    def plan_before_loading(self, ident, family_id, dataset, lora, train, dtype):
        """The RAM plan of the resident run, checked against the RAM budget before loading: on a GPU the model as
        read and the process; on the CPU also everything a GPU would hold (model, LoRA, activations)."""
        if self.offload is None:
            return
        from ..offload.footprint import footprint_before_loading, workload_for
        from ..offload.plan import cpu_resident_plan, make_plan

        fp, family, variant = footprint_before_loading(ident, dtype, lora, family_id)
        self._per_weight(fp, train)
        ram, cap, source = ram_budget(self.offload)
        if self.device.type != "cuda":
            cpu_resident_plan(fp, workload_for(dataset, family, variant, train.batch_size), ram, source,
                              self.host_extra, self.saves_state)
            return
        make_plan(fp, workload_for(dataset, family, variant, train.batch_size), self.offload, None, cap,
                  ram_budget_bytes=ram, host_extra=self.host_extra, ram_source=source, resume_staging=self.saves_state)

    def apply(self, model, family, variant, dataset, lora, train, callback):
        model.to(self.device)
        params = self._attach(model, family, lora, train, self.checkpointing)
        model.to(self.device)
        return params

    def out_of_memory(self, exc, family):
        return torch.cuda.OutOfMemoryError(
            f"CUDA out of memory while training {family.display_name} resident on {self.device}: {exc}. "
            f"Lower the resolution or batch size, keep gradient checkpointing on, or use block streaming.")


class Streamed(Placement):
    """The blocks stream through one GPU per the plan; LoRA and the rest of the model stay on it."""

    kind = "stream"

    def plan(self, fp, family, variant: str, dataset, train: TrainConfig):
        """The one place training asks for an offload plan (from the header before loading, and from the
        loaded model): the dataset's largest bucket, the optimizer's bytes per LoRA weight, the budget."""
        from ..offload.footprint import workload_for
        from ..offload.plan import make_plan
        from ..offload.streamer import resolve_budget_bytes
        from ..offload.window import place_window_weights

        offload = self.offload
        self._per_weight(fp, train)
        if self.slab_path is not None:  # the int8 weights are the file map's pages; the file can be read per load
            fp.file_backed = fp.disk_capable = True
        if train.optimizer != "adamw":  # host-held moments are AdamW's fp32 ones: auto must not count on them
            from dataclasses import replace

            offload = replace(offload, optimizer_on_host=False)
        ram, cap, source = ram_budget(offload)
        workload = workload_for(dataset, family, variant, train.batch_size)
        workload.preservation = self.preservation
        machine = self.machine(fp)

        def planned(extra):
            return make_plan(fp, workload, offload, resolve_budget_bytes(offload, self.device), cap,
                             compiled=self.compiles(train)[0], machine=machine, ram_budget_bytes=ram,
                             host_extra=extra, ram_source=source, resume_staging=self.saves_state)

        plan, self.window_from_file = place_window_weights(
            planned, self.host_extra, fp.file_backed and ram is not None and machine is not None
            and bool(machine.disk_bytes_per_s))
        return plan

    def machine(self, fp):
        """The link (measured once), and the read rate of the slab file's disk (probed once, cached) when the model
        is a slab: only then may auto put blocks on the disk tier (engine/offload/disk.py)."""
        from dataclasses import replace

        from ..offload.link import resolve_machine

        machine = resolve_machine(self.device)
        if self.slab_path is None or not fp.disk_capable:
            return machine
        from ..offload.disk import disk_rate_for

        return replace(machine, disk_bytes_per_s=disk_rate_for(self.slab_path))

    def plan_before_loading(self, ident, family_id, dataset, lora, train, dtype):
        from ..offload.footprint import footprint_before_loading

        if ident.kind == "slab":
            self.slab_path = ident.path
        fp, family, variant = footprint_before_loading(ident, dtype, lora, family_id)
        self.plan(fp, family, variant, dataset, train)

    def apply(self, model, family, variant, dataset, lora, train, callback):
        from ..offload.footprint import lora_param_count, measure_footprint
        from ..offload.streamer import apply_offload

        # Plan before touching the model: a refused plan leaves a preloaded model as it was.
        fp = measure_footprint(model, family, f"{family.display_name} ({variant})",
                               trainable_params=lora_param_count(model, family, lora))
        if fp.disk_capable and self.slab_path is None:  # a preloaded slab: its file, as the loader recorded it
            from ..slab.source import slab_source_of

            self.slab_path = slab_source_of(model).path
        plan = self.plan(fp, family, variant, dataset, train)
        params = self._attach(model, family, lora, train, True)  # fp32, wherever the blocks are (CPU)
        try:
            self.handle = apply_offload(model, family, self.offload, self.device, callback, plan=plan)
        except BaseException:
            self.remove()
            raise
        return params

    def plans(self):
        return (self.handle.plan,) if self.handle is not None else ()

    def last_stall_s(self) -> float:
        stalls = self.handle.step_stall_s if self.handle is not None else []
        return stalls[-1] if stalls else 0.0

    def compile_budget(self):
        return self.handle.plan.activation_memory_budget  # auto may have lowered it

    def cap_allocator(self, held_before, callback):
        from ..offload.streamer import cap_allocator

        explicit = self.handle is not None and self.offload.mode == "auto" and self.offload.vram_budget_gb
        return cap_allocator(self.handle.plan.budget_bytes if explicit else None, self.device,
                             held_before.get(self.device, 0), callback)


class Split(Placement):
    """The blocks cut across two devices (engine/parallel/split.py), each part placed or streamed per its
    own plan within its own budget; everything outside the blocks on the first device."""

    kind = "split"

    def __init__(self, offload: OffloadConfig, device: torch.device, split):
        super().__init__(offload, device)
        self.split = split

    @property
    def devices(self):
        return tuple(torch.device(d) for d in self.split.devices)

    def window_blocker(self, train: TrainConfig) -> str:
        # Found 2026-11-29 (H200, torch 2.11, tests/test_parallel_gpu.py): pipelined, the window serves each call the
        # outputs of its micro-batch, which the calling thread names (step_window.served); dynamo traces that lookup
        # into a compiled block and fails to guard it ('Unexpected type _MicroBatch'). Not pipelined, resident parts
        # checkpoint as Resident does, which fails compiled with the window on CUDA (Resident.window_blocker); not yet
        # run on a GPU, so off as well.
        if not self.compiles(train)[0]:
            return ""
        if self.split.micro_batches != 1:  # 0: auto, pipelined wherever the batch allows
            auto = " (micro_batches auto)" if self.split.micro_batches == 0 else ""
            return (f"compiled blocks with a pipelined Dual-GPU Split{auto}: each micro-batch's thread picks its own "
                    f"outputs, which a compiled block cannot; the modulation runs in its blocks")
        return ("compiled blocks with Dual-GPU Split: not yet run on a GPU with the window; the modulation runs in "
                "its blocks")

    def plan(self, model, family, variant: str, dataset, train: TrainConfig):
        """Both parts' plans and the cut, from each device's budget. LoRA must be attached: each part's
        trainable elements are counted off the model."""
        from ..offload.footprint import measure_footprint, workload_for
        from ..parallel.split import plan_split, split_budgets, trainable_per_block

        fp = measure_footprint(model, family, f"{family.display_name} ({variant})")
        self._per_weight(fp, train)
        from ..offload.link import resolve_machine

        per_block, outside = trainable_per_block(model, family)
        return plan_split(fp, per_block, outside, workload_for(dataset, family, variant, train.batch_size),
                          self.offload, self.devices, split_budgets(self.split, self.offload),
                          cut=None if self.split.cut == -1 else self.split.cut, host_ram_bytes=ram_budget(self.offload)[1],
                          ram_budget_bytes=ram_budget(self.offload)[0],
                          machines=tuple(resolve_machine(d) for d in self.devices),
                          compiled=self.compiles(train)[0], micro_batches=self.split.micro_batches,
                          host_extra=self.host_extra, accumulation=train.gradient_accumulation,
                          virtual_stages=self.split.virtual_stages,
                          processes=self.ranks is not None and self.ranks.stage is not None)  # how it runs

    def apply(self, model, family, variant, dataset, lora, train, callback):
        from ..parallel.split import apply_split

        params = self._attach(model, family, lora, train, True)  # on the CPU: placed with their blocks below
        try:
            self.handle = apply_split(model, family, self.plan(model, family, variant, dataset, train),
                                      self.offload, callback, ranks=self.ranks, release_remote=self.model_is_own)
        except BaseException:
            self.remove()
            raise
        return params

    def plans(self):
        return self.handle.plan.plans if self.handle is not None else ()

    @contextlib.contextmanager
    def cap_allocator(self, held_before, callback):
        """Each part's device held to its own budget where one was given (the split's or Offload Config's), as one
        GPU's streamed run is: without it the first GPU reserved 12.2-13.0 GB under a 12 GB budget (2x H200)."""
        from ..offload.streamer import cap_allocator
        from ..parallel.split import given_budgets_gb

        mine = list(zip(self.devices, self.plans(), given_budgets_gb(self.split, self.offload)))
        stage = self.ranks.stage if self.ranks is not None else None
        with contextlib.ExitStack() as stack:
            for device, plan, gb in mine if stage is None else mine[stage:stage + 1]:  # a process split: its own
                stack.enter_context(cap_allocator(plan.budget_bytes if gb else None, device,
                                                  held_before.get(device, 0), callback))
            yield

    def pipeline(self):
        return self.handle.pipeline if self.handle is not None else None

    def remote_modules(self) -> set[int]:
        return self.handle.remote_modules if self.handle is not None else set()

    def module_devices(self):
        return self.handle.module_devices if self.handle is not None else None

    def record_peaks(self, settings):
        settings["split_peak_vram_gb"] = [
            round(torch.cuda.max_memory_allocated(d) / 1e9, 3) if d.type == "cuda" else 0.0 for d in self.devices]
