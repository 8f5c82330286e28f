"""The result of training: what flows on the LOWVRAM_LORA edge, and how a run hands it over whole.

``write_trained`` / ``read_trained`` keep every field (loss history, settings, sample grids), not only
the weights a LoRA file holds: the finished-run cache (engine/runs/result_reuse.py) and a data-parallel
worker's result (engine/runs/worker.py -> launch.py) use them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from ..fileio import atomic_write, write_json_atomic


@dataclass
class TrainedLora:
    state_dict: dict[str, torch.Tensor]  # peft names ("...attn.to_q.lora_A.weight", "...to_q.hada_w1_a"), fp32 CPU
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
    # The other expert's LoRA of a two-expert run (Dual-GPU Split mode 'experts', engine/runs/experts.py), which
    # Save LoRA writes beside this one. Not stored with this run: each expert's run is stored under its own key.
    companion: Optional["TrainedLora"] = field(default=None, compare=False, repr=False)
    adapter: str = "lora"  # the adapter type (engine/lora_io/adapters/): which names state_dict holds
    snapshots: list = field(default_factory=list)  # paths of the loadable snapshots kept (engine/train/snapshots.py)
    # The EMA of the weights (LoRA Adapter's ema_decay; engine/train/ema.py), the same names as state_dict; empty
    # when off. Save LoRA writes it as its own file beside the plain one (``as_ema``).
    ema_state_dict: dict = field(default_factory=dict, repr=False)
    weights: str = "last"  # which weights state_dict holds: "last", or "ema" (``as_ema``): a saved file says it

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def as_ema(self) -> "TrainedLora":
        """This run with its EMA weights as the weights (what the ``_ema`` file holds)."""
        if not self.ema_state_dict:
            raise ValueError("this run kept no EMA of its weights (LoRA Adapter's ema_decay is 0)")
        return replace(self, state_dict=self.ema_state_dict, ema_state_dict={}, companion=None, weights="ema")

    @property
    def ema_in_previews(self) -> bool:
        """Whether its previews (and Train LoRA's lora_model output) use the EMA weights: LoRA Adapter's
        ema_previews, with an EMA kept."""
        adapter = (self.settings.get("lora") or {}).get("adapter") or {}
        return bool(self.ema_state_dict) and bool(adapter.get("ema_previews", True))


_EMA = "ema/"  # the EMA weights' names in a stored run's .safetensors, beside the plain ones


def read_trained(folder: Path, name: str) -> TrainedLora | None:
    """A TrainedLora written by ``write_trained`` (weights .safetensors + metadata .json), or None."""
    weights, info = Path(folder) / f"{name}.safetensors", Path(folder) / f"{name}.json"
    if not (weights.exists() and info.exists()):
        return None
    try:
        meta = json.loads(info.read_text())
        tensors = load_file(str(weights))
        return TrainedLora(state_dict={k: v for k, v in tensors.items() if not k.startswith(_EMA)},
                           ema_state_dict={k[len(_EMA):]: v for k, v in tensors.items() if k.startswith(_EMA)},
                           **meta)
    except Exception:  # unreadable or from another layout: a miss
        return None


def write_trained(folder: Path, name: str, lora: TrainedLora, what: str) -> None:
    """Weights (and their EMA, under ``ema/`` names) first, then the metadata JSON, which marks the pair complete
    (both atomic)."""
    meta = {f.name: getattr(lora, f.name) for f in fields(lora)
            if f.name not in ("state_dict", "companion", "ema_state_dict")}
    tensors = {**lora.state_dict, **{_EMA + k: v for k, v in lora.ema_state_dict.items()}}
    with atomic_write(Path(folder) / f"{name}.safetensors", what) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    write_json_atomic(Path(folder) / f"{name}.json", meta, what, indent=None)
