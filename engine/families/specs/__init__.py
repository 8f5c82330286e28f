"""The family's specs beside its core (``base.ModelFamily``): one frozen dataclass per concern, one file each.

``text`` (``PromptTemplate``, ``TextEncoderSpec``: what the dataset cache keeps of each text encoder), ``vae``
(``VaeSpec``: pixels <-> latents), ``guidance`` (``Guidance``: how previews sample), ``controls``
(``ControlImages``: an edit model's control images; ``FirstFrameCondition``, ``ImageEncoderSpec``: an image-to-video
model's first frame), ``memory`` (``MemoryProfile``: the planner's and step-time model's knobs), ``schedule`` (``NoiseSchedule``, ``Prediction``: shifts, sigmas, ranges, the model's convention),
``lora`` (``LoraForm``: default targets, the saved file's form and architecture), ``templates``
(``TrainingTemplate``: a shipped workflow), ``step_constants`` (``StepConstants``: the modules whose output is
a constant of the training step, for the modulation window). A family folder declares its instances (a subclass of its own where it
needs code). A new capability is a new spec file here, not another member of ``ModelFamily``.
"""
from .controls import HELD_KEY, HELD_ON_KEY, ControlImages, FirstFrameCondition, ImageEncoderSpec, held_weights, hold_frames
from .guidance import Guidance
from .lora import COMFYUI_FORMS, LoraForm
from .memory import MemoryProfile, TokenModulation
from .step_constants import StepConstants
from .streams import JointStream
from .schedule import NoiseSchedule, Prediction, sigma_schedule, static_shift_mu
from .templates import TrainingTemplate
from .text import PromptTemplate, TextEncoderSpec
from .vae import VaeSpec

__all__ = ["COMFYUI_FORMS", "ControlImages", "FirstFrameCondition", "HELD_KEY", "HELD_ON_KEY", "held_weights", "hold_frames", "Guidance", "ImageEncoderSpec", "JointStream", "LoraForm",
           "MemoryProfile", "NoiseSchedule", "Prediction", "PromptTemplate", "StepConstants", "TextEncoderSpec", "TokenModulation",
           "TrainingTemplate", "VaeSpec", "sigma_schedule", "static_shift_mu"]
