"""Adapter types: one handler file each (``lora.py``, ``loha.py``, ``lokr.py``, ``dora.py``), found by file name.

A handler says everything that differs between types: the peft config that attaches it, how many weights it adds
(for the memory plan), the names of its weights in peft's state dict, how alpha/rank is folded into them, and the
keys ComfyUI's ``comfy/weight_adapter/`` reads for it. Attaching (engine/train/lora_attach.py) and saving
(engine/lora_io/files.py, formats.py) ask the handler and never branch on the type.
"""
from __future__ import annotations

from ...config import ADAPTER_TYPES
from ...discovery import discover
from ...errors import ConfigError
from ._base import AdapterType

_FOUND: dict[str, AdapterType] | None = None


def adapter_types() -> dict[str, AdapterType]:
    """name -> handler, every ``ADAPTER`` of a module in this folder."""
    global _FOUND
    if _FOUND is None:
        from . import __path__ as path

        _FOUND = discover(__name__, path, "ADAPTER", lambda h: h.name, "adapter types")
    return _FOUND


def get_adapter(name: str) -> AdapterType:
    found = adapter_types()
    if name not in found:
        raise ConfigError(f"adapter type {name!r} is not one of {', '.join(sorted(found))}")
    return found[name]


def adapter_of_state(state) -> AdapterType:
    """The type whose weights a (peft-named) state dict holds; refuses a mix or none."""
    kinds = {h.name for h in adapter_types().values() for k in state if h.owns(k)}
    if "dora" in kinds:  # DoRA's state is LoRA's plus a magnitude
        kinds.discard("lora")
    if len(kinds) != 1:
        raise ConfigError(f"cannot tell the adapter type of these weights (found {sorted(kinds) or 'none'})")
    return adapter_types()[kinds.pop()]


__all__ = ["ADAPTER_TYPES", "AdapterType", "adapter_types", "get_adapter", "adapter_of_state"]
