"""Offloading: stream transformer blocks (and optionally activations) through a small GPU.

    OffloadConfig, make_plan, apply_offload   (all in this package)

``OffloadConfig`` says what the user wants; ``make_plan`` turns it, a model footprint
and a workload into a ``Plan`` (pure arithmetic); ``apply_offload`` makes a model
stream per that plan and returns an ``OffloadHandle`` whose ``remove()`` undoes it.
``train_lora(..., offload=OffloadConfig(...))`` does all of this.
"""
from .config import MODES, OffloadConfig, help_text
from .plan import ModelFootprint, Plan, Workload, build_plan, make_plan
from .schedule import BlockScheduler, visit_cycle


def __getattr__(name):  # the torch-heavy parts load on first use
    if name in ("apply_offload", "OffloadHandle"):
        from . import streamer

        return getattr(streamer, name)
    if name in ("measure_footprint", "workload_for", "footprint_before_loading"):
        from . import footprint

        return getattr(footprint, name)
    raise AttributeError(name)


__all__ = [
    "MODES", "BlockScheduler", "ModelFootprint", "OffloadConfig", "OffloadHandle", "Plan", "Workload",
    "apply_offload", "build_plan", "footprint_before_loading", "help_text", "make_plan", "measure_footprint",
    "visit_cycle", "workload_for",
]
