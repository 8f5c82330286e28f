"""Look at a checkpoint without loading its weights (what Load Quantized Slab does).

Reading the safetensors header is enough to know the family, the variant and
whether every tensor has the right shape, so a wrong file is reported before
any heavy work starts, and nothing touches a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..caching.hashing import path_identity
from ..config import ModelConfig
from ..families import get_family
from .transformer_loading import identify_diffusers_folder, identify_single_file, resolve_transformer_source


@dataclass
class ModelInfo:
    """What flows on the LOWVRAM_MODEL edge: where the weights are and what they are."""

    config: ModelConfig
    family: str
    variant: str
    kind: str  # "diffusers" | "single_file" | "slab"
    identity: str  # content identity of the weights (header hashes), keys trained-result reuse

    def describe(self) -> str:
        what = {"slab": "int8 slab", "single_file": "single file", "diffusers": "diffusers folder"}[self.kind]
        return f"{get_family(self.family).display_name} ({self.variant}) from {what} {self.config.transformer_path}"


def inspect_transformer(config: ModelConfig) -> ModelInfo:
    source = resolve_transformer_source(config.transformer_path)
    if source.kind == "single_file":
        from ..slab.load import is_slab_file, open_slab, resolve_slab_family

        if is_slab_file(source.path):
            slab = open_slab(source.path)  # quick verify: size + header against the manifest
            family = resolve_slab_family(slab, config.family)
            resolved = replace(config, transformer_path=str(source.path.resolve()), family=family.id)
            return ModelInfo(resolved, family.id, slab.variant, "slab", path_identity(source.path))
    if source.kind == "diffusers":
        family, variant, _ = identify_diffusers_folder(source.path, config.family)
    else:
        family, variant, _ = identify_single_file(source.path, config.family)
    resolved = replace(config, transformer_path=str(Path(config.transformer_path).resolve()), family=family.id)
    return ModelInfo(resolved, family.id, variant, source.kind, path_identity(source.path))
