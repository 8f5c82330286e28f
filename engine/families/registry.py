"""The model-family registry: every folder under ``engine/families/`` that defines ``FAMILY``.

Found by ``pkgutil`` when first asked, so a new family is a new folder and nothing else: the Load
node's family choices, Cache Text Embeds' tooltips, the templates and the tests' parametrization all
read this registry. A folder's other parts are found by their file names, as the folders are:
``fixtures.py`` (tiny models for tests and the demo) and ``templates.py`` (shipped workflows).
"""
from __future__ import annotations

import importlib.util
from importlib import import_module
from types import ModuleType

from ..discovery import discover
from ..errors import ConfigError
from .base import ModelFamily, family_package
from .specs import TrainingTemplate

_FOUND: dict[str, ModelFamily] = {}
#: Folders beside the family folders that are not families: shared configs, the family specs.
NOT_FAMILIES = ("configs", "specs")


def families() -> dict[str, ModelFamily]:
    """id -> family, every family folder, in id order."""
    if not _FOUND:
        from . import __path__ as here, __name__ as package

        _FOUND.update(discover(package, here, "FAMILY", lambda f: f.id, "family folders", packages=True,
                               skip=NOT_FAMILIES))
    return _FOUND


def family_ids() -> list[str]:
    return list(families())


def get_family(family_id: str) -> ModelFamily:
    try:
        return families()[family_id]
    except KeyError:
        raise ConfigError(
            f"unknown model family {family_id!r}; choose one of: {', '.join(families())}"
        ) from None


def family_for_class_name(class_name: str) -> ModelFamily | None:
    """The family whose diffusers transformer class is ``class_name`` (from config.json)."""
    return next((f for f in families().values() if f.diffusers_class_name == class_name), None)


def family_for_single_file(keys: set[str]) -> ModelFamily | None:
    """The family whose native names a single file's (prefix-stripped) tensor names are."""
    return next((f for f in families().values() if f.looks_like_single_file(keys)), None)


def family_fixtures(family: ModelFamily) -> ModuleType:
    """The folder's ``fixtures`` module: ``build_tiny_pipeline(folder, seed=0) -> Path`` and
    ``write_single_file(pipeline, out_file) -> Path`` (tests and the demo; never downloads)."""
    name = f"{family_package(family)}.fixtures"
    if importlib.util.find_spec(name) is None:
        raise ConfigError(f"{family.display_name} has no fixtures.py in its folder; tiny models for tests and the "
                          f"demo are built there (build_tiny_pipeline, write_single_file)")
    return import_module(name)


def family_templates(family: ModelFamily) -> list[TrainingTemplate]:
    """The folder's shipped workflows (``templates.py``'s ``TEMPLATES``; none if it has no such module)."""
    name = f"{family_package(family)}.templates"
    return list(import_module(name).TEMPLATES) if importlib.util.find_spec(name) else []
