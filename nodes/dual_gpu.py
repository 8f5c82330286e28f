"""Dual-GPU Split: how Train LoRA uses two (or more) GPUs.

Tooltips come from ParallelConfig's help text (engine/parallel/config.py). The engine does the work:
split mode in the training process (engine/parallel/split.py), data parallel in one worker process
per GPU (engine/runs/launch.py).
"""
from __future__ import annotations

from . import schema as io
from .load_model import CATEGORY


def _help(name: str, extra: str = "") -> str:
    from ..engine.config import field_help
    from ..engine.parallel.config import ParallelConfig  # torch-free module

    return field_help(ParallelConfig, name, extra)


def _max_virtual_stages() -> int:
    from ..engine.parallel.config import MAX_VIRTUAL_STAGES

    return MAX_VIRTUAL_STAGES


def _modes() -> tuple[str, ...]:
    from ..engine.parallel.config import MODES  # torch-free module

    return MODES


DESCRIPTION = (
    "Train on two GPUs. split: the model's blocks are cut in two, each GPU holds (and streams) its part, "
    "for a model too big for one card. data_parallel: each GPU trains on its own images with the whole "
    "streamed model, and the LoRA gradients are averaged: about twice the images per second. experts: both experts "
    "of Wan 2.2 A14B at once, Train LoRA's model on the first GPU and its preview_partner on the second; Save LoRA "
    "then writes two LoRAs. Connect it to "
    "Train LoRA's split input; Offload Config still chooses resident / stream / auto for each GPU."
)


class LowVRAMDualGPUSplit(io.Node):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowVRAMDualGPUSplit", display_name="Dual-GPU Split", category=CATEGORY, description=DESCRIPTION,
            outputs=[io.Output("LOWVRAM_SPLIT", "split", "Multi-GPU settings for Train LoRA's split input.")],
            inputs=[
                io.Combo("mode", list(_modes()), default="split", tooltip=_help("mode")),
                io.String("devices", default="cuda:0,cuda:1", tooltip=_help("devices", "Comma-separated.")),
                io.Int("cut", default=-1, min=-1, max=1024, tooltip=_help("cut")),
                io.String("vram_budget_gb", default="0", tooltip=_help(
                    "vram_budget_gb", "Comma-separated, e.g. 12,12; one value applies to every GPU.")),
                # optional: API graphs saved before it existed still validate (1 = no pipelining, as before)
                io.Int("micro_batches", default=1, min=0, max=64, optional=True, tooltip=_help("micro_batches")),
                io.Int("virtual_stages", default=1, min=0, max=_max_virtual_stages(), optional=True,
                       tooltip=_help("virtual_stages")),
                io.Boolean("one_process_per_gpu", default=False, optional=True, tooltip=_help("one_process_per_gpu")),
            ])

    @classmethod
    def execute(cls, mode: str = "split", devices: str = "cuda:0,cuda:1", cut: int = -1,
                vram_budget_gb: str = "0", micro_batches: int = 1, virtual_stages: int = 1,
                one_process_per_gpu: bool = False) -> io.NodeOutput:
        from ..engine.parallel.config import ParallelConfig, parse_budgets, parse_devices

        return io.NodeOutput(ParallelConfig(mode=mode, devices=parse_devices(devices), cut=cut,
                                            vram_budget_gb=parse_budgets(vram_budget_gb),
                                            micro_batches=int(micro_batches), virtual_stages=int(virtual_stages),
                                            one_process_per_gpu=bool(one_process_per_gpu)))
