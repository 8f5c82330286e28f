"""Z-Image (Tongyi-MAI Turbo and Base, 6B): the family folder (``family.py``, ``names.py``, ``fixtures.py``)."""
from .family import ZImageFamily

FAMILY = ZImageFamily()

__all__ = ["FAMILY", "ZImageFamily"]
