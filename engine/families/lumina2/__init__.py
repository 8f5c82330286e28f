"""Lumina 2 (Alpha-VLLM Lumina-Image-2.0): the family folder (``family.py``: the interface; ``names.py``:
native NextDiT <-> diffusers names; ``fixtures.py``: tiny pipelines and files; ``configs/``)."""
from .family import Lumina2Family

FAMILY = Lumina2Family()

__all__ = ["FAMILY", "Lumina2Family"]
