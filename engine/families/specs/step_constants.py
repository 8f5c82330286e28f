"""``StepConstants``: the modules of a transformer whose output is a constant of the training step.

AdaLN modulation and the time / guidance / pooled-text embedders read only the timestep, the guidance scale and
the pooled text. None of them is trained, so their outputs carry no gradient and are the same in the forward and in
the checkpointed recompute. A family declares them here (on its ``MemoryProfile``, ``step_constants``); the training
loop's modulation window (``engine/train/step_window.py``) then draws the next K steps ahead, computes these modules
for all K steps in one pass, keeps the small outputs on the GPU, and the blocks stream without their weights.

- ``source``: the module whose output is the step's conditioning vector (the time embedding), as the transformer's
  forward calls it once per forward. Its output is captured per call (a forward stopped right after it) and stored
  too, so the embedder's own Linears run once per window as well.
- ``modules``: name patterns (``fnmatch`` over full module names, ``*`` for a block index) of the modules fed by that
  vector, each with the form of its input: ``silu`` (``silu(vector)``: ``AdaLayerNormZero.linear``,
  ``nn.Sequential(SiLU, Linear)``'s Linear) or ``same`` (the vector itself). A subclass overrides ``module_input``
  where a model feeds a module something else (Qwen-Image-Edit-2511's text modulation reads the first half of a
  doubled batch).
- ``unsupported(config)``: why a model of the family cannot use the window (a forward that calls the source twice),
  or None.
"""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

#: Input forms a declared module may take (``StepConstants.modules``).
INPUT_FORMS = ("silu", "same")


@dataclass(frozen=True)
class StepConstants:
    """The per-step-constant modules of a family's transformer (see the module doc)."""

    source: str
    modules: dict[str, str]

    def __post_init__(self) -> None:
        bad = {p: f for p, f in self.modules.items() if f not in INPUT_FORMS}
        if bad:
            raise ValueError(f"StepConstants modules {bad}: input forms are {', '.join(INPUT_FORMS)}")

    def unsupported(self, config: dict[str, Any]) -> str | None:
        """Why a model with ``config`` cannot use the window (None: it can)."""
        return None

    def resolve(self, model: nn.Module) -> list[tuple[str, nn.Module, str]]:
        """(full name, module, input form) of every declared module the model has, in module order."""
        out = []
        for name, module in model.named_modules():
            for pattern, form in self.modules.items():
                if fnmatchcase(name, pattern):
                    out.append((name, module, form))
                    break
        return out

    def vector(self, output: Any) -> torch.Tensor:
        """The conditioning vector in the source's output (the output itself by default)."""
        return output

    def module_input(self, name: str, form: str, vector: torch.Tensor, config: dict[str, Any]) -> torch.Tensor:
        """What module ``name`` (declared with input ``form``) is fed, given the source's output ``vector``."""
        return torch.nn.functional.silu(vector) if form == "silu" else vector
