"""lowvram-lora: low-VRAM LoRA training for huge diffusion transformers.

This directory is two things at once:
- a ComfyUI custom-node pack: ComfyUI calls ``comfy_entrypoint`` (its V3 node API) and serves
  ``WEB_DIRECTORY``;
- the Python package ``lowvram_lora`` (``pip install -e .``), whose engine is usable
  on its own: ``from lowvram_lora.engine import ...``.

Importing it must stay cheap so ComfyUI starts fast: nothing here imports the nodes, ComfyUI or torch;
node classes import torch and the engine only when they execute. No ``NODE_CLASS_MAPPINGS``: ComfyUI
would take it instead of ``comfy_entrypoint`` (nodes/__init__.py says why it is not needed).
"""

WEB_DIRECTORY = "./web"
from .engine.version import VERSION as __version__


async def comfy_entrypoint():
    """ComfyUI's V3 entry point: the ``ComfyExtension`` listing the pack's nodes as ``io.ComfyNode`` classes."""
    from .nodes import NODES
    from .nodes.v3 import comfy_extension

    return comfy_extension(NODES)


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint", "__version__"]
