"""The training engine: pure Python + torch; never imports ComfyUI."""
from . import quiet as _quiet

_quiet.install()  # before any engine module imports torch/diffusers/torchao
