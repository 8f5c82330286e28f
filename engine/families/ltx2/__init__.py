"""LTX-2.3 / LTX-2.5 (Lightricks' joint audio-video model): the family folder (``family.py``, ``names.py``,
``text.py``, ``vae.py``, ``fixtures.py``, ``templates.py``)."""
from .family import Ltx2Family

FAMILY = Ltx2Family()

__all__ = ["FAMILY", "Ltx2Family"]
