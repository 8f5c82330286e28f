"""The family's specs beyond its core (``base.ModelFamily``): one frozen dataclass per concern, one file each.

``memory.MemoryProfile`` (the planner's and step-time model's knobs), ``schedule.NoiseSchedule`` (shifts, sigmas,
ranges, the prediction convention), ``lora.LoraForm`` (default targets, the saved file's form and architecture).
A family folder declares an instance of each (a subclass of its own where it needs code). A new capability is a
new spec file here, not another member of ``ModelFamily``.
"""
from .lora import COMFYUI_FORMS, LoraForm
from .memory import MemoryProfile
from .schedule import NoiseSchedule, Prediction, sigma_schedule, static_shift_mu

__all__ = ["COMFYUI_FORMS", "LoraForm", "MemoryProfile", "NoiseSchedule", "Prediction", "sigma_schedule",
           "static_shift_mu"]
