"""What each shipped template needs: VRAM, host RAM and a predicted step, from the planner itself.

Each template's first chain is planned from its family's shipped config on the meta device (nothing loaded, no
file), with the template's own Offload Config values, for a reference machine with 32 GB of RAM (and, for image
templates, 16 GB): ``ram_budget_gb`` left at 0 gives auto's budget, SAFETY_FRACTION x (RAM - what the OS, a browser
and ComfyUI itself hold, ``OTHERS_GB``). The result goes into the template's Note (``host/templates.py``) and the
README's table (``python -m lowvram_lora.host.templates --needs`` prints it).

The reference machine: a PCIe 4.0 x16 link (25 GB/s, the planner's default), an RTX 4090's dense bf16 peak, a
PCIe 4.0 NVMe drive (3.5 GB/s) under the slab; a template whose VRAM budget is 0 (90% of what is free) is planned
for a 24 GB card. Previews count: a Wan 2.2 A14B expert's preview partner (the other expert) is held in host RAM
while it samples. The workload is the template's resolution as a square image (a clip: its frames; an edit model:
one control image of the same size), the family's text length, batch 1, LoRA at the template's rank.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import nn

from ..engine.config import LoraSettings
from ..engine.families import TrainingTemplate, default_max_sequence_length, get_family
from ..engine.offload import OffloadConfig
from ..engine.offload.hostmem import SAFETY_FRACTION
from ..engine.offload.plan import GB, Workload, make_plan
from ..engine.offload.steptime import Machine, peak_flops_for

OTHERS_GB = 4.0  # what the OS, a browser and ComfyUI hold on the reference machine
CARD_GB = 24.0  # the card a template with vram_budget_gb=0 is planned for
REFERENCE = Machine(link_bytes_per_s=25 * GB, peak_flops=peak_flops_for("4090"), name="reference",
                    source="reference: PCIe 4.0 x16", disk_bytes_per_s=3.5 * GB)
#: Image templates of models up to this many parameters must also plan for 16 GB of RAM (issue 35).
SMALL_IMAGE_PARAMS = 13e9


@dataclass
class Needs:
    name: str
    vram: str  # the template's VRAM budget as set ("8 GB", "0 = 90% of free: 21.6 GB on a 24 GB card", "12,12 GB")
    peak_vram_gb: float
    ram_gb: float  # the RAM plan's predicted peak on the 32 GB machine (or, where it does not fit, what it needs)
    ram_budget_gb: float  # auto's budget there
    fits32: bool
    step_s: Optional[float]
    disk_blocks: int
    ram16_gb: Optional[float] = None  # the same on a 16 GB machine (image templates up to 13B), None: not planned
    fits16: Optional[bool] = None
    why: str = ""  # where it does not fit: the planner's refusal

    def text(self) -> str:
        """The paragraph the template's Note ends with."""
        disk = f", {self.disk_blocks} blocks streamed from the slab on disk" if self.disk_blocks else ""
        # A step under 0.05 s is a tiny model's (the demo, on any device): no card-class prediction worth reading.
        step = (f"; about {self.step_s:.1f} s/step on a PCIe 4.0 RTX 4090-class card"
                if self.step_s and self.step_s >= 0.05 else "")
        head = (f"Needs (the planner's prediction, ram_budget_gb 0 = auto): VRAM budget {self.vram} (predicted "
                f"peak {self.peak_vram_gb:.1f} GB), host RAM {self.ram_gb:.1f} GB{disk}{step}.")
        if self.fits32:
            head += f" Fits a 32 GB RAM machine (auto's RAM budget there: {self.ram_budget_gb:.1f} GB)."
        else:
            head += (f" Does NOT fit a 32 GB RAM machine with these settings (auto's RAM budget there: "
                     f"{self.ram_budget_gb:.1f} GB): {self.why}")
        if self.ram16_gb is not None:
            head += (f" On a 16 GB RAM machine: {self.ram16_gb:.1f} GB" + ("." if self.fits16 else ", over its budget."))
        return head


@functools.lru_cache(maxsize=None)
def _footprint(family, variant: str, int8: bool, rank: int):
    from ..engine.families.base import meta_model
    from ..engine.offload.footprint import lora_param_count, measure_footprint

    model = meta_model(family, family.load_config(variant))
    nn.Module.to(model, dtype=torch.bfloat16)
    model.requires_grad_(False)
    trainable = lora_param_count(model, family, LoraSettings(rank=rank, alpha=float(rank)))
    if int8:
        from ..engine.slab.layout import swap_in_int8_linears

        swap_in_int8_linears(model, family)
    fp = measure_footprint(model, family, f"{family.display_name} ({variant}{', int8 slab' if int8 else ''})",
                           trainable)
    fp.file_backed = fp.disk_capable = int8
    return fp, model, None


def _workload(t: TrainingTemplate, family, variant: str) -> Workload:
    from ..engine.caching.task_choice import image_to_video_variant
    from ..engine.offload.footprint import per_token_timestep

    # The cache's image_to_video choice makes the run I2V (the variant's twin): per-token timesteps.
    cached = image_to_video_variant(family, variant) if t.cache.get("image_to_video") else variant
    side = int(t.cache.get("resolution", 1024))
    frames = int(t.cache.get("video_frames", 1) or 1)
    tokens = family.memory.image_tokens(side, side, variant) * family.memory.latent_frames(frames)
    references = 0
    control = family.control_images(variant)
    if control is not None and (not control.optional or t.cache.get("control_folder")):
        references = family.memory.image_tokens(side, side, variant)  # one control image of the same size joins
    return Workload(1, tokens + references, default_max_sequence_length(family, variant),
                    f"{side}x{side}" + (f"x{frames}f" if frames > 1 else ""), reference_tokens=references,
                    timestep_tokens=tokens if per_token_timestep(family, cached) else 0)


def _ram_budget(machine_gb: float) -> int:
    return int(SAFETY_FRACTION * (machine_gb - OTHERS_GB) * GB)


def needs(t: TrainingTemplate) -> Needs:
    """The planner's figures for template ``t`` on the reference machine (see the module doc)."""
    from ..engine.errors import ConfigError

    family = get_family(t.load.get("family") if t.load.get("family") not in (None, "auto") else "flux1")
    if not t.variant:
        raise ValueError(f"template {t.name!r} names no variant (TrainingTemplate.variant): the planner cannot size it")
    variant = t.variant
    int8 = t.load.get("precision") == "int8 slab"
    fp, model, _ = _footprint(family, variant, int8, int(t.train.get("rank", 16)))
    wl = _workload(t, family, variant)
    offload = OffloadConfig(**{k: v for k, v in t.offload.items() if k in ("mode", "vram_budget_gb")})
    vram = offload.vram_budget_gb or CARD_GB * 0.9
    extra = {}
    if t.partner_variant and t.train.get("sample_every"):
        partner, _, _ = _footprint(family, t.partner_variant, int8, 1)
        extra["preview partner"] = partner.total_block_bytes + partner.other_bytes
    compiled = int(t.train.get("steps", 0)) >= 200 and offload.mode == "auto"  # compile auto on a CUDA GPU

    def plan_for(machine_gb: Optional[float]):
        ram = _ram_budget(machine_gb) if machine_gb else None
        if t.split is not None:
            return _split_plan(t, fp, model, family, wl, offload, ram)
        return make_plan(fp, wl, offload, int(vram * GB) if offload.mode == "auto" else None,
                         int((machine_gb or 1024) * GB), compiled=compiled, machine=REFERENCE,
                         ram_budget_bytes=ram, host_extra=extra)

    def fitting(machine_gb: float):
        if t.split is not None:  # planned once (every cut is tried), then held to the budget here
            plan = plan_for(None)
            over = plan.predicted_host_peak_bytes > _ram_budget(machine_gb)
            return plan, (f"the two GPUs' parts together need {plan.predicted_host_peak_bytes / GB:.1f} GB of host "
                          f"RAM; raise the per-GPU budgets (more blocks resident)" if over else "")
        try:
            return plan_for(machine_gb), ""
        except ConfigError as exc:
            return plan_for(None), str(exc)

    plan, why = fitting(32)
    ram16 = fits16 = None
    image = int(t.cache.get("video_frames", 1) or 1) == 1
    if image and sum(fp.block_params or [0]) <= SMALL_IMAGE_PARAMS:
        small, why16 = fitting(16)
        ram16, fits16 = small.predicted_host_peak_bytes / GB, not why16
    if t.split is not None:
        shown = f"{t.split['vram_budget_gb']} GB (Dual-GPU Split, per GPU)"
    elif offload.mode != "auto":
        shown = f"none ({offload.mode})"
    elif offload.vram_budget_gb:
        shown = f"{offload.vram_budget_gb:g} GB"
    else:
        shown = f"0 = 90% of free VRAM ({vram:.1f} GB on a {CARD_GB:g} GB card)"
    return Needs(t.name, shown, plan.predicted_peak_bytes / GB, plan.predicted_host_peak_bytes / GB,
                 _ram_budget(32) / GB, not why, plan.predicted_step_s if t.split is None else None,
                 len(plan.disk_blocks), ram16, fits16, why)


_CACHE: dict[str, Needs] = {}


def cached_needs(t: TrainingTemplate) -> Needs:
    """``needs`` of a shipped template, computed once per process (its Note and the README's table use it); the
    caller says it is the shipped one (host/templates.py)."""
    if t.name not in _CACHE:
        _CACHE[t.name] = needs(t)
    return _CACHE[t.name]


class _SplitNeeds:
    """The two parts of a Dual-GPU Split as one plan's figures (the larger part's VRAM, one process's RAM)."""

    def __init__(self, split_plan):
        from ..engine.offload.plan import PROCESS_BASE_BYTES

        plans = split_plan.plans
        self.predicted_peak_bytes = max(p.predicted_peak_bytes for p in plans)
        self.predicted_host_peak_bytes = (sum(p.predicted_host_peak_bytes for p in plans)
                                          - (len(plans) - 1) * PROCESS_BASE_BYTES)
        self.predicted_step_s = sum(p.predicted_step_s or 0.0 for p in plans)
        self.disk_blocks = []


def _split_plan(t, fp, model, family, wl, offload, ram_budget: Optional[int]):
    from ..engine.offload.footprint import named_blocks
    from ..engine.parallel.split import plan_split

    rank = int(t.train.get("rank", 16))
    targets = family.lora.target_modules(model)
    per_block = []
    for _, block in named_blocks(model, family):
        per_block.append(sum(rank * (m.in_features + m.out_features) for n, m in block.named_modules()
                             if isinstance(m, nn.Linear) and any(n == x or n.endswith("." + x) for x in targets)))
    budgets = tuple(int(float(b) * GB) for b in str(t.split["vram_budget_gb"]).split(","))
    devices = tuple(torch.device("cpu") for _ in budgets)  # no device is touched: the budgets are given
    plans = plan_split(replace(fp), per_block, max(0, fp.trainable_params - sum(per_block)), wl, offload, devices,
                       budgets, ram_budget_bytes=ram_budget, machines=(REFERENCE, REFERENCE))
    return _SplitNeeds(plans)


def markdown(rows: list[Needs]) -> str:
    """The README's table."""
    out = ["| template | VRAM budget (predicted peak) | host RAM (32 GB machine) | fits 32 GB RAM | host RAM (16 GB "
           "machine) | predicted s/step |", "|---|---|---|---|---|---|"]
    for n in rows:
        disk = f", {n.disk_blocks} blocks from disk" if n.disk_blocks else ""
        small = "–" if n.ram16_gb is None else f"{n.ram16_gb:.1f} GB" + ("" if n.fits16 else " (over)")
        out.append(f"| {n.name} | {n.vram} ({n.peak_vram_gb:.1f} GB) | {n.ram_gb:.1f} GB{disk} | "
                   f"{'yes' if n.fits32 else '**no**'} | {small} | {f'{n.step_s:.2f}' if n.step_s else '–'} |")
    return "\n".join(out)
