"""Handlers found by file name: the one way a folder of the engine is read as a registry.

Model families (a folder each), text-encoder kinds and checkpoint kinds (a file each) are all found this way, so adding
one is adding a file or folder and nothing else: no list to edit. Modules whose names start with ``_`` or ``test_`` are
not handlers.
"""
from __future__ import annotations

import pkgutil
from importlib import import_module
from typing import Any, Callable, Iterable


def discover(package: str, path: Iterable[str], attribute: str, name_of: Callable[[Any], str], what: str,
             packages: bool = False, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """name -> the ``attribute`` of every module (``packages``: every sub-package) of ``package`` found on ``path``,
    in module-name order; a module without the attribute is not a handler. Two handlers of one name are refused."""
    found: dict[str, Any] = {}
    for info in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
        if info.ispkg != packages or info.name.startswith(("_", "test_")) or info.name in skip:
            continue
        handler = getattr(import_module(f"{package}.{info.name}"), attribute, None)
        if handler is None:
            continue
        name = name_of(handler)
        if name in found:
            raise RuntimeError(f"two {what} are named {name!r} ({package}.{info.name} is the second)")
        found[name] = handler
    return found
