"""Look at a checkpoint without loading its weights (what Load Quantized Slab does).

Reading the safetensors header is enough to know the family, the variant and
whether every tensor has the right shape, so a wrong file is reported before
any heavy work starts, and nothing touches a GPU. The identity made here flows
on the LOWVRAM_MODEL edge, so the run does not identify the checkpoint again.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from ..checkpoint import CheckpointIdentity, identify
from ..config import ModelConfig
from ..families import get_family
from ..hashing import path_identity


@dataclass
class ModelInfo:
    """What flows on the LOWVRAM_MODEL edge: where the weights are and what they are."""

    config: ModelConfig
    family: str
    variant: str
    kind: str  # "diffusers" | "single_file" | "slab"
    identity: str  # content identity of the weights (header hashes), keys trained-result reuse
    checkpoint: CheckpointIdentity | None = field(default=None, compare=False)

    def describe(self) -> str:
        what = {"slab": "int8 slab", "single_file": "single file", "diffusers": "diffusers folder"}[self.kind]
        return f"{get_family(self.family).display_name} ({self.variant}) from {what} {self.config.transformer_path}"


def inspect_transformer(config: ModelConfig) -> ModelInfo:
    ident = identify(config.transformer_path, config.family)
    family, variant = ident.family, ident.variant
    if ident.kind == "slab":
        from ..slab.load import open_slab, resolve_slab_family

        slab = open_slab(ident.path)  # quick verify: size + header against the manifest
        family, variant = resolve_slab_family(slab, config.family), slab.variant
    where = ident.path if ident.kind == "slab" else Path(config.transformer_path)
    resolved = replace(config, transformer_path=str(where.resolve()), family=family.id)
    return ModelInfo(resolved, family.id, variant, ident.kind, path_identity(ident.path), ident)
