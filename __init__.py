"""lowvram-lora: low-VRAM LoRA training for huge diffusion transformers.

This directory is two things at once:
- a ComfyUI custom-node pack (ComfyUI imports it and reads the three names below);
- the Python package ``lowvram_lora`` (``pip install -e .``), whose engine is usable
  on its own: ``from lowvram_lora.engine import ...``.

Importing it must stay cheap so ComfyUI starts fast: node classes import torch and
the engine only when they execute.
"""

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

WEB_DIRECTORY = "./web"
from .engine.version import VERSION as __version__

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY", "__version__"]
