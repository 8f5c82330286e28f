"""What every model family provides to the engine.

A family (Flux.1, Flux.2) is one small object: its diffusers class, its
shipped configs, how to read its original single-file names, which modules get a
LoRA, and how a training batch becomes the transformer's inputs. The loader, the
trainer and LoRA export only talk to this interface.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol

import torch
from torch import nn

from .flux1_names import BflParam


@dataclass(frozen=True)
class TextEncoderSpec:
    """One text encoder of a pipeline folder and what we keep from it."""

    subfolder: str  # "text_encoder_2"
    tokenizer_subfolder: str  # "tokenizer_2"
    output: str  # "pooled" (one vector), "sequence" (one per token), "stacked" (hidden_layers, concatenated)
    max_length: int
    cache_key: str  # name of the tensor in the cache ("pooled_prompt_embeds")
    # "stacked" only: which hidden states (0 = embeddings, k = output of k decoder layers) are
    # concatenated per token, and the chat format the prompt is wrapped in ("mistral3", "qwen3").
    hidden_layers: tuple[int, ...] = ()
    prompt_format: str = "plain"


def block_lora_targets(model: nn.Module, double: tuple[str, ...], single: tuple[str, ...]) -> list[str]:
    """Full module names of ``double`` targets in every double block and ``single`` in every single block
    (Flux.1 and Flux.2 share the block list names ``transformer_blocks`` / ``single_transformer_blocks``)."""
    names = [f"transformer_blocks.{i}.{t}" for i in range(len(model.transformer_blocks)) for t in double]
    return names + [f"single_transformer_blocks.{i}.{t}" for i in range(len(model.single_transformer_blocks))
                    for t in single]


def meta_model(family: "ModelFamily", config: dict[str, Any]) -> nn.Module:
    """The family's transformer built on the meta device (no memory): the one place models are made
    without weights, for shape checks, footprints and loading by assignment."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        return family.transformer_class().from_config(config)


def load_shipped_config(filename: str) -> dict[str, Any]:
    """Small transformer config JSONs ship inside the package: no hub access, ever."""
    text = resources.files(__package__).joinpath("configs", filename).read_text()
    return json.loads(text)


class ModelFamily(Protocol):
    id: str
    display_name: str
    variants: dict[str, str]  # variant id -> shipped config file
    diffusers_class_name: str
    text_encoders: tuple[TextEncoderSpec, ...]
    vae_class_name: str  # the diffusers VAE class of the family's pipelines

    def text_encoder_specs(self, variant: str) -> tuple[TextEncoderSpec, ...]: ...

    def latents_from_vae(self, vae: Any, mean: torch.Tensor) -> torch.Tensor: ...

    def transformer_class(self) -> type[nn.Module]: ...

    def param_table(self, config: dict[str, Any]) -> list[BflParam]: ...

    def looks_like_single_file(self, keys: set[str]) -> bool: ...

    def block_lists(self, model: nn.Module) -> list[nn.ModuleList]: ...

    def lora_target_modules(self, model: nn.Module) -> list[str]: ...

    def default_max_sequence_length(self, variant: str) -> int: ...

    def text_widths(self, config: dict[str, Any]) -> dict[str, int]: ...

    def model_inputs(
        self,
        model: nn.Module,
        latents: torch.Tensor,
        embeds: dict[str, torch.Tensor],
        timesteps: torch.Tensor,
        guidance: float,
    ) -> dict[str, Any]: ...

    def unpack_prediction(self, pred: torch.Tensor, latents: torch.Tensor) -> torch.Tensor: ...

    def timestep_shift_mu(self, latents: torch.Tensor) -> float: ...
