"""A part of a transformer block that streams and is checkpointed on its own (``ModelFamily.block_parts``, Wan's
``parts.py``): a module like any other, which can also say which of its outputs carry no gradient."""
from __future__ import annotations

from torch import nn


class BlockPart(nn.Module):
    def constant_outputs(self, *args) -> tuple[int, ...]:
        """Indices of the outputs that carry no gradient for these inputs (read by the activation offloader's
        checkpoint, ``engine/offload/activations.py``, which marks them non-differentiable): none by default."""
        return ()
