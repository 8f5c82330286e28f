"""Autograd inside hosts that turn it off: ComfyUI runs every node under ``torch.inference_mode()``.

ComfyUI's ``PromptExecutor`` wraps the whole prompt in ``torch.inference_mode()``;
its own training node (``comfy_extras/nodes_train.py``) leaves it with
``torch.inference_mode(False)``. Two things follow for training:

- the training loop itself must run with inference mode off and grad on;
- tensors created under inference mode (by an earlier node, or a model loaded
  there) are *inference tensors*: autograd refuses to save them for backward, and
  they cannot be modified in place outside inference mode. They are replaced by
  ordinary copies before training (``make_autograd_safe``).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def autograd_enabled() -> Iterator[None]:
    """Leave inference mode (if a host entered it) and turn grad on, for the block's duration."""
    with torch.inference_mode(False), torch.enable_grad():
        yield


def make_autograd_safe(module: torch.nn.Module) -> int:
    """Replace every inference-tensor parameter and buffer of ``module`` with an ordinary copy
    (same device, dtype and ``requires_grad``). Call outside inference mode. Returns how many
    tensors were replaced (0 for a model loaded outside inference mode: nothing is copied)."""
    replaced = 0
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None and p.is_inference():
                sub._parameters[name] = torch.nn.Parameter(p.clone(), requires_grad=p.requires_grad)
                replaced += 1
        for name, b in list(sub._buffers.items()):
            if b is not None and b.is_inference():
                sub._buffers[name] = b.clone()
                replaced += 1
    return replaced


def autograd_safe_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or an ordinary copy when it is an inference tensor."""
    return t.clone() if t.is_inference() else t
