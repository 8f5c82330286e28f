from .family import Flux1Family

FAMILY = Flux1Family()

