"""Model families, one folder each (``engine/families/<id>/``), behind one interface (``base.py``)."""
from .base import (ControlImages, Guidance, ModelFamily, Prediction, PromptTemplate, TextEncoderSpec, TrainingTemplate, VaeSpec,
                   meta_model, shared_config, sigma_schedule, text_architecture_config)
from .registry import families, family_for_class_name, family_for_single_file, family_ids, get_family

__all__ = [
    "ControlImages", "Guidance", "ModelFamily", "Prediction", "PromptTemplate", "TextEncoderSpec", "TrainingTemplate", "VaeSpec",
    "families",
    "family_for_class_name", "family_for_single_file", "family_ids", "get_family", "meta_model", "shared_config",
    "sigma_schedule", "text_architecture_config",
]
