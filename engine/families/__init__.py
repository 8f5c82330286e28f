"""Model families, one folder each (``engine/families/<id>/``), behind one interface (``base.py``) and its specs
(``specs/``)."""
from .base import (ModelFamily, default_max_sequence_length, image_only, meta_model, predict_velocity, shared_config,
                   text_architecture_config)
from .registry import (families, family_for_class_name, family_for_single_file, family_fixtures, family_ids,
                       family_templates, get_family)
from .specs import (ControlImages, FirstFrameCondition, Guidance, ImageEncoderSpec, LoraForm, MemoryProfile, NoiseSchedule, Prediction, PromptTemplate,
                    TextEncoderSpec, TrainingTemplate, VaeSpec, sigma_schedule, static_shift_mu)

__all__ = [
    "ControlImages", "FirstFrameCondition", "Guidance", "ImageEncoderSpec", "LoraForm", "MemoryProfile", "ModelFamily", "NoiseSchedule", "Prediction",
    "PromptTemplate", "TextEncoderSpec", "TrainingTemplate", "VaeSpec",
    "default_max_sequence_length", "families", "family_fixtures", "family_for_class_name", "family_for_single_file",
    "family_ids", "family_templates", "get_family", "image_only", "meta_model", "predict_velocity", "shared_config",
    "sigma_schedule", "static_shift_mu", "text_architecture_config",
]
