"""Silence the known-harmless warnings that importing our dependencies prints.

Only these exact messages are dropped; anything else from the same loggers still shows:

- torch >= 2.11 (``torch.utils._pytree``): "<enum ...> is an Enum subclass and is now natively
  supported by torch.compile ... register_constant() ... deprecated", once per enum that
  torchao registers at import;
- diffusers (``diffusers.quantizers.torchao.torchao_quantizer``): "Unable to import `torchao`
  Tensor objects", printed when the installed torchao and torch versions disagree on private
  names; it matters only for loading torchao-serialized checkpoints, which we never do;
- torchao (``torchao``, ``torchao.kernel.intmm``): "Failed to load .../_C_*.so" and "Detected no
  triton" on CPU-only or other-CUDA builds, where those optional kernels are unused;
- transformers >= 5 (``transformers.utils.import_utils``): "`CLIPImageProcessor` requires torchvision
  (not installed); falling back to `CLIPImageProcessorPil`" and the same for `SiglipImageProcessor`,
  once each per process. diffusers' Flux pipeline and IP-adapter modules import these names at module
  level (``diffusers/pipelines/flux/pipeline_flux.py``, ``diffusers/loaders/ip_adapter.py``), so every run
  that loads diffusers' Flux code prints them. They only concern IP-adapter image encoding, which we
  never run, and transformers falls back to the PIL processor anyway; torchvision is not a dependency
  (ComfyUI brings its own). Other messages of that logger (a missing backend we do use) still show.
"""
from __future__ import annotations

import logging

_KNOWN = {
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
    "diffusers.quantizers.torchao.torchao_quantizer": ("Unable to import `torchao` Tensor objects",),
    "torchao": ("Failed to load", "Could not load this library"),
    "torchao.kernel.intmm": ("Detected no triton",),
    "transformers.utils.import_utils": ("requires torchvision (not installed); falling back to",),
}


class _DropKnown(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True
        return not any(f in message for f in self.fragments)


def install() -> None:
    """Idempotent: attach one filter per logger."""
    for name, fragments in _KNOWN.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) for f in logger.filters):
            logger.addFilter(_DropKnown(fragments))
