"""Look at a checkpoint without loading its weights (what Load Quantized Slab does).

Reading the safetensors header is enough to know the family, the variant and
whether every tensor has the right shape, so a wrong file is reported before
any heavy work starts, and nothing touches a GPU. The identity made here flows
on the LOWVRAM_MODEL edge, so the run does not identify the checkpoint again.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

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
    kind: str  # the checkpoint's kind (engine/checkpoint/kinds): "diffusers" | "single_file" | "slab"
    identity: str  # content identity of the weights (header hashes), keys trained-result reuse
    checkpoint: CheckpointIdentity = field(compare=False)  # what the checkpoint is, made here once: the run uses it

    def to_json(self) -> dict[str, Any]:
        """All of it as JSON, for a process that uses this identity instead of making its own (a data-parallel
        worker)."""
        return {"config": asdict(self.config), "family": self.family, "variant": self.variant, "kind": self.kind,
                "identity": self.identity, "checkpoint": self.checkpoint.to_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelInfo:
        """What ``to_json`` wrote; nothing is read from the checkpoint."""
        return cls(model_config_from_json(data["config"]), data["family"], data["variant"], data["kind"],
                   data["identity"], CheckpointIdentity.from_json(data["checkpoint"]))

    def describe(self) -> str:
        return (f"{get_family(self.family).display_name} ({self.variant}) from {self.checkpoint.form.note_for(self.checkpoint) or self.checkpoint.form.description} "
                f"{self.config.transformer_path}")


def inspect_transformer(config: ModelConfig) -> ModelInfo:
    ident = identify(config.transformer_path, config.family)
    resolved = replace(config, transformer_path=str(Path(config.transformer_path).expanduser().resolve()),
                       family=ident.family.id)
    return ModelInfo(resolved, ident.family.id, ident.variant, ident.kind, path_identity(ident.path), ident)


def model_config_from_json(data: dict[str, Any]) -> ModelConfig:
    """A ``ModelConfig`` from ``asdict``'s JSON (its tuple came back as a list)."""
    return ModelConfig(**{**data, "text_encoder_files": tuple(data.get("text_encoder_files") or ())})


def model_info(model: ModelConfig | ModelInfo) -> ModelInfo:
    """A Load node's ``ModelInfo`` as it is; a ``ModelConfig`` (library use, tests) identified here."""
    return model if isinstance(model, ModelInfo) else inspect_transformer(model)
