"""Krea 2 (Krea AI Raw and Turbo, 12.8B): the family folder (``family.py``, ``names.py``, ``fixtures.py``)."""
from .family import Krea2Family

FAMILY = Krea2Family()

__all__ = ["FAMILY", "Krea2Family"]
