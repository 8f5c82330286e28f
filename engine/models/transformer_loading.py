"""Load a family's transformer from local files only, through the one checkpoint reader.

Every form ``engine/checkpoint`` accepts (a diffusers folder, a single file with original names in
any stored precision it decodes, a slab) comes back as a model on the CPU. Plain checkpoints are
built on the meta device and assigned tensor by tensor, so the weights exist once in RAM.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import CheckpointIdentity, identify
from ..families import ModelFamily


def load_transformer(
    path: str | Path | CheckpointIdentity, family_id: str = "auto", dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.nn.Module, ModelFamily, CheckpointIdentity, str]:
    """Returns (model on CPU in ``dtype``, family, identity, variant id). ``path`` may be an identity
    already made (the Load node's), so the checkpoint is not identified again.

    A slab (``*.slab.safetensors`` with its manifest, see ``engine/slab``) loads with its
    block Linears as int8 ``Int8Linear`` modules; its identity's kind is "slab"."""
    ident = path if isinstance(path, CheckpointIdentity) else identify(path, family_id)
    return ident.form.load_model(ident, dtype), ident.family, ident, ident.variant
