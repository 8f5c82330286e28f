"""The other expert of a mixture, for previews of one expert (Wan 2.2 T2V-A14B: the high- and low-noise models).

A preview of one expert needs both (``ModelFamily.preview_partner``): the high-noise expert denoises sigma >= the
boundary, the low-noise one below, as WanPipeline does with ``transformer`` and ``transformer_2``. The run trains
one of them; the partner is the other's frozen base weights, from the checkpoint connected to Train LoRA's
``preview_partner`` input, without LoRA (a LoRA the other chain trained is not known to this run).

Memory: the partner is never resident in VRAM. On CUDA it streams through the same machinery as the trained model
(``apply_offload``) with a forward-only plan of its own (every block streamed, a ring of two slots, no activation
offload), only while a preview samples; afterwards every tensor goes back to the host. Its VRAM (the weights outside
the blocks and the ring) is taken off the rows one sampling forward may carry (``rows_bytes``), so sampling stays at
or below the training peak where the training plan leaves room for it. On the CPU (tests) it runs where it is.

Host RAM: an A14B expert is about 14 GB as an int8 slab, pinned while it streams. The training plan counts it
(``host_bytes``: the run's RAM plan holds it under "preview partner", engine/offload/plan.py), since a preview holds
it whether it is kept or not. Kept between previews it holds that for the whole run; released, each preview loads
and pins it again (tens of seconds, against previews every few hundred steps of several seconds each: a few
percent). So it is kept only while the process with it stays within the run's RAM budget (``ram_budget_gb``,
engine/offload/hostmem.py), and released after each preview otherwise; the log says which, and what it cost.
"""
from __future__ import annotations

import contextlib
import time

import torch

from ..config import LoraSettings, ModelConfig
from ..errors import ConfigError
from ..models.dtypes import release_device_memory
from ..models.inspect import ModelInfo, model_info
from ..offload import OffloadConfig
from ..sampling import PartnerExpert

GB = 1e9


def host_bytes(cfg: ModelConfig | ModelInfo, dtype: torch.dtype) -> int:
    """Host bytes the partner holds while it samples, from its checkpoint's header (nothing loaded): every block
    pinned (it streams whole) and the tensors outside the blocks (read into host memory, kept there while they run
    on the GPU)."""
    from ..offload.footprint import footprint_before_loading

    info = model_info(cfg)  # its Load node's identity as it is; a ModelConfig identified here
    fp, _, _ = footprint_before_loading(info.checkpoint, dtype, LoraSettings(rank=1, alpha=1.0), info.family)
    return fp.total_block_bytes + fp.other_bytes


class PreviewPartner:
    """The partner expert of a run: checked when made (the right family and variant), loaded and placed only
    inside ``placed()``."""

    #: Tests: stream on the CPU through this copy engine (``apply_offload``'s ``_engine_factory``), with a plan.
    _engine_factory = None

    def __init__(self, cfg: ModelConfig | ModelInfo, family, trained_variant: str, device: torch.device,
                 dtype: torch.dtype, offload: OffloadConfig | None, cb):
        wanted, self.boundary = family.schedule.preview_partner(trained_variant)
        info = model_info(cfg)  # its Load node's identity as it is; a ModelConfig identified here
        if info.family != family.id or info.variant != wanted:
            raise ConfigError(
                f"preview_partner is {info.describe()}, but previews of {trained_variant} need {wanted} (the other "
                f"expert: it denoises the other side of sigma {self.boundary}). Connect the Load Quantized Slab of "
                f"the {wanted} file to Train LoRA's preview_partner, or disconnect it (no samples then)")
        self.cfg, self.family, self.variant, self.info = info.config, family, wanted, info
        self.device, self.dtype, self.offload, self.cb = device, dtype, offload, cb
        self.high = family.schedule.train_sigma_range(wanted)[0] > 0  # the high-noise expert trains on [boundary, 1]
        self.guidance = family.guidance(wanted).scale
        self.model = None
        self.keep: bool | None = None  # decided at the first load
        self.stream = None  # the partner's OffloadConfig and plan (CUDA)
        if device.type == "cuda":
            self.stream, self.plan = self._plan()
        else:
            self.plan = None

    def _plan(self):
        """The forward-only streaming plan, from the checkpoint's header (nothing loaded): every block streamed
        through two slots (prefetch 1: the least VRAM), activation offload off (no backward), no LoRA. The
        plan's workload only sizes its activation estimate, which is not used: ``rows_bytes`` is its weights."""
        from ..offload.footprint import footprint_before_loading
        from ..offload.plan import Workload, make_plan

        fp, _, _ = footprint_before_loading(self.info.checkpoint, self.dtype,
                                            LoraSettings(rank=1, alpha=1.0), self.family.id)
        fp.trainable_params = 0
        cfg = OffloadConfig(mode="stream", resident_blocks=0, prefetch_depth=1, activation_offload=False,
                            int8_compute=self.int8_compute)
        return cfg, make_plan(fp, Workload(batch=1, image_tokens=1, text_tokens=0), cfg)

    @property
    def int8_compute(self) -> str:
        """How the partner's int8 slab layers multiply: as the run's own (the default without an OffloadConfig)."""
        return self.offload.int8_compute if self.offload is not None else OffloadConfig().int8_compute

    def rows_bytes(self) -> int:
        """What the partner holds on the GPU while it samples (its weights outside the blocks and the fullest
        ring); 0 on the CPU."""
        if self.plan is None:
            return 0
        return self.plan.footprint.other_bytes + self.plan.ring_bytes

    def _load(self):
        from ..models import load_transformer
        from ..offload.hostmem import process_memory, resolve_ram_budget
        from ..slab.int8_linear import set_int8_compute

        t0 = time.perf_counter()
        model, _, _, _ = load_transformer(self.info.checkpoint, self.family.id, self.dtype)
        model.requires_grad_(False).eval()
        set_int8_compute(model, self.int8_compute)
        size = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
        if self.keep is None:
            held = process_memory().unreclaimable  # the partner's tensors included, as read
            budget = resolve_ram_budget(self.offload.ram_budget_gb if self.offload is not None else 0.0)
            self.keep = self.device.type != "cuda" or held + size <= budget.bytes
            self.cb.log(
                f"preview partner {self.variant}: {size / GB:.1f} GB on the host, "
                + ("kept between previews" if self.keep else "loaded for each preview and released after it")
                + f" (host RAM {held / GB:.1f} GB now, pinned copies to come; kept while within the "
                  f"{budget.describe()})")
        self.cb.log(f"preview partner loaded in {time.perf_counter() - t0:.1f} s")
        return model

    @contextlib.contextmanager
    def placed(self):
        """The partner ready to sample (``PartnerExpert``); its tensors back on the host afterwards, and the model
        dropped unless it is kept."""
        model = self.model if self.model is not None else self._load()
        handle = expert = None
        try:
            if self.plan is not None:
                from ..offload.streamer import apply_offload

                t0 = time.perf_counter()
                handle = apply_offload(model, self.family, self.stream, self.device, self.cb, plan=self.plan,
                                       _engine_factory=self._engine_factory)
                self.cb.log(f"preview partner streams ({self.rows_bytes() / GB:.2f} GB on the GPU while it "
                            f"samples), placed in {time.perf_counter() - t0:.1f} s")
            elif next(model.parameters()).device != self.device:
                model.to(self.device)
            expert = PartnerExpert(model, self.boundary, self.high, self.guidance)
            yield expert
        finally:
            if handle is not None:
                handle.remove()
            if expert is not None:  # the caller may still hold it: it must not keep a released model alive
                expert.model = None
            self.model = model if self.keep else None
            del model, handle
            release_device_memory(self.device)

    def close(self) -> None:
        """The end of the run: the kept partner (and with it its pinned host copies) is let go."""
        self.model = None
        release_device_memory(self.device)
