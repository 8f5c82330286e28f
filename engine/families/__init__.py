"""Model families (Flux.1 today) behind one interface."""
from .base import ModelFamily, TextEncoderSpec, load_shipped_config
from .registry import FAMILIES, family_for_class_name, family_for_single_file, get_family

__all__ = [
    "FAMILIES", "ModelFamily", "TextEncoderSpec", "family_for_class_name",
    "family_for_single_file", "get_family", "load_shipped_config",
]
