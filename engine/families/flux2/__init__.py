from .family import Flux2Family

FAMILY = Flux2Family()

