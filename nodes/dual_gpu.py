"""Dual-GPU Split: how Train LoRA uses two (or more) GPUs.

Tooltips come from ParallelConfig's help text (engine/parallel/config.py). The engine does the work:
split mode in the training process (engine/parallel/split.py), data parallel in one worker process
per GPU (engine/runs/launch.py).
"""
from __future__ import annotations

from .load_model import CATEGORY


def _help(name: str, extra: str = "") -> str:
    from ..engine.parallel.config import help_text  # torch-free module

    return help_text(name) + (" " + extra if extra else "")


class LowVRAMDualGPUSplit:
    DESCRIPTION = (
        "Train on two GPUs. split: the model's blocks are cut in two, each GPU holds (and streams) its part, "
        "for a model too big for one card. data_parallel: each GPU trains on its own images with the whole "
        "streamed model, and the LoRA gradients are averaged: about twice the images per second. Connect it to "
        "Train LoRA's split input; Offload Config still chooses resident / stream / auto for each GPU."
    )
    CATEGORY = CATEGORY
    RETURN_TYPES = ("LOWVRAM_SPLIT",)
    RETURN_NAMES = ("split",)
    OUTPUT_TOOLTIPS = ("Multi-GPU settings for Train LoRA's split input.",)
    FUNCTION = "configure"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "mode": (["split", "data_parallel"], {"default": "split", "tooltip": _help("mode")}),
                "devices": ("STRING", {"default": "cuda:0,cuda:1", "tooltip": _help("devices", "Comma-separated.")}),
                "cut": ("INT", {"default": -1, "min": -1, "max": 1024, "tooltip": _help("cut")}),
                "vram_budget_gb": ("STRING", {"default": "0", "tooltip": _help(
                    "vram_budget_gb", "Comma-separated, e.g. 12,12; one value applies to every GPU.")}),
            }
        }

    def configure(self, mode: str = "split", devices: str = "cuda:0,cuda:1", cut: int = -1,
                  vram_budget_gb: str = "0"):
        from ..engine.parallel.config import ParallelConfig, parse_budgets, parse_devices

        return (ParallelConfig(mode=mode, devices=parse_devices(devices), cut=cut,
                               vram_budget_gb=parse_budgets(vram_budget_gb)),)
