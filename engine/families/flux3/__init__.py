"""FLUX.3 Image Klein (Black Forest Labs, 5.5B; Base and the step-distilled flow map): the family folder
(``family.py``, ``names.py``, ``fixtures.py``, ``templates.py``)."""
from .family import Flux3Family

FAMILY = Flux3Family()

__all__ = ["FAMILY", "Flux3Family"]
