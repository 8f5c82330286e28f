"""Offload Config: how the model's memory is managed while training."""
from __future__ import annotations

from .load_model import CATEGORY


class LowVRAMOffloadConfig:
    DESCRIPTION = (
        "How weights, activations and recomputation are managed during training. Today: all weights resident on "
        "one device, with or without gradient checkpointing."
    )
    CATEGORY = CATEGORY
    RETURN_TYPES = ("LOWVRAM_OFFLOAD",)
    RETURN_NAMES = ("offload",)
    OUTPUT_TOOLTIPS = ("Memory settings for Train LoRA.",)
    FUNCTION = "configure"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "mode": (["resident"], {
                    "default": "resident",
                    "tooltip": "resident: every weight stays on the GPU (needs ~25 GB for Flux.1-dev at 1024).",
                }),
                "gradient_checkpointing": ("BOOLEAN", {
                    "default": True,
                    "tooltip": "Recompute each block's activations during backward instead of storing them: "
                               "much less VRAM for about a third more compute. Keep it on.",
                }),
            }
        }

    def configure(self, mode: str = "resident", gradient_checkpointing: bool = True):
        from ..engine.offload import OffloadConfig

        return (OffloadConfig(mode=mode, gradient_checkpointing=gradient_checkpointing),)
