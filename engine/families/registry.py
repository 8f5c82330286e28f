"""Model-family registry: look a family up by id, or detect it from a checkpoint."""
from __future__ import annotations

from ..errors import ConfigError
from .base import ModelFamily
from .flux1 import Flux1Family
from .flux2 import Flux2Family

FAMILIES: dict[str, ModelFamily] = {"flux1": Flux1Family(), "flux2": Flux2Family()}


def get_family(family_id: str) -> ModelFamily:
    try:
        return FAMILIES[family_id]
    except KeyError:
        raise ConfigError(
            f"unknown model family {family_id!r}; choose one of: {', '.join(sorted(FAMILIES))}"
        ) from None


def family_for_class_name(class_name: str) -> ModelFamily | None:
    """The family whose diffusers transformer class is ``class_name`` (from config.json)."""
    for family in FAMILIES.values():
        if family.diffusers_class_name == class_name:
            return family
    return None


def family_for_single_file(keys: set[str]) -> ModelFamily | None:
    for family in FAMILIES.values():
        if family.looks_like_single_file(keys):
            return family
    return None
