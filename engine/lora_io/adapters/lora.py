"""Plain LoRA: delta = B @ A * alpha/r (peft ``LoraConfig``; ComfyUI ``lora_A``/``lora_B`` + ``alpha``)."""
from __future__ import annotations

import torch

from ._base import AdapterType, Part, block_rows, scalar, stacked


class Lora(AdapterType):
    name = "lora"
    suffixes = ("lora_A.weight", "lora_B.weight")
    diffusers_loads = True

    def peft_config(self, settings, targets, **extra):
        from peft import LoraConfig

        return LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                          target_modules=targets, init_lora_weights=True, **extra)

    def param_count(self, in_features, out_features, settings):
        return settings.rank * (in_features + out_features)

    def rank_of(self, module_state):
        return module_state["lora_A.weight"].shape[0]

    def fold(self, module_state, scale):
        return {k: (v * scale if k == "lora_B.weight" else v) for k, v in module_state.items()}

    def comfyui(self, module_state):
        down = module_state["lora_A.weight"]
        return {"lora_A.weight": down, "lora_B.weight": module_state["lora_B.weight"],
                "alpha": scalar(down.shape[0])}

    def join(self, native: str, parts: list[Part]) -> dict[str, torch.Tensor]:
        """down = the parts' A stacked (rank = the sum), up = block-diagonal over the fused rows."""
        rows = sum(r for _, r, _ in parts)
        down = stacked(parts, "lora_A.weight")
        return {"lora_A.weight": down, "lora_B.weight": block_rows(parts, "lora_B.weight", rows),
                "alpha": scalar(down.shape[0])}


ADAPTER = Lora()
