"""The result of training: what flows on the LOWVRAM_LORA edge."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TrainedLora:
    state_dict: dict[str, torch.Tensor]  # peft names: "transformer_blocks.0.attn.to_q.lora_A.weight", fp32 CPU
    rank: int
    alpha: float
    family: str
    variant: str
    steps: int  # optimizer steps actually taken
    requested_steps: int
    loss_history: list[float] = field(default_factory=list)
    lr_history: list[float] = field(default_factory=list)
    dataset_hash: str = ""
    base_model: str = ""
    interrupted: bool = False
    seconds: float = 0.0
    peak_vram_gb: float = 0.0
    settings: dict = field(default_factory=dict)
    model_config: dict = field(default_factory=dict)  # the transformer's config (LoRA export needs its shapes)
    sample_grids: list = field(default_factory=list)  # paths of the sample grids written while training
    sample_seconds: float = 0.0  # time spent sampling (not in the step times)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank
