"""Offload Config: how the model's memory is managed while training.

Tooltips come from the help text of OffloadConfig's fields (engine/offload/config.py),
so each trade-off is explained once. Widgets cannot hold None: -1 / 0 / "auto" stand
for "let the planner choose", as each tooltip says.

The node shows the settings people change: mode, the VRAM and RAM budgets and the int8 compute path. The
rest are ComfyUI "advanced" inputs (``advanced=True``), drawn only when the node's advanced toggle is on: they
keep their places, so UI-format workflows (widget values by position) load unchanged.
"""
from __future__ import annotations

from . import schema as io
from .load_model import CATEGORY


def _help(name: str, extra: str = "") -> str:
    from ..engine.config import field_help
    from ..engine.offload.config import OffloadConfig  # torch-free module

    return field_help(OffloadConfig, name, extra)


DESCRIPTION = (
    "How weights, activations and recomputation are managed during training. 'auto' plans from a VRAM budget: "
    "everything resident when it fits, otherwise transformer blocks stream from pinned host RAM to the GPU just "
    "ahead of use (forward and backward order), overlapped with compute. It also plans for a host RAM budget "
    "(ram_budget_gb). The plan (predicted peak VRAM and host RAM, bytes streamed per step) is printed before "
    "training and checked after the first steps. "
    "Streaming needs a CUDA GPU; on a CPU 'auto' trains resident. "
    "The planner's own choices (resident and disk blocks, prefetch, activation offload, recompute, compile...) are "
    "advanced inputs: show them with the node's advanced toggle to override one."
)


class LowVRAMOffloadConfig(io.Node):
    @classmethod
    def define_schema(cls) -> io.Schema:
        from ..engine.offload.config import COMPILE_MODES, INT8_COMPUTE_MODES

        return io.Schema(
            node_id="LowVRAMOffloadConfig", display_name="Offload Config", category=CATEGORY,
            description=DESCRIPTION, outputs=[io.Output("LOWVRAM_OFFLOAD", "offload", "Memory settings for Train LoRA.")],
            inputs=[
                io.Combo("mode", ["auto", "resident", "stream"], default="auto", tooltip=_help("mode")),
                io.Float("vram_budget_gb", default=0.0, min=0.0, max=1024.0, step=0.5, tooltip=_help("vram_budget_gb")),
                io.Int("resident_blocks", default=-1, min=-1, max=512, advanced=True,
                       tooltip=_help("resident_blocks", "-1 = let the planner choose.")),
                io.Int("prefetch_depth", default=0, min=0, max=8, advanced=True,
                       tooltip=_help("prefetch_depth", "0 = let the planner choose.")),
                io.Combo("activation_offload", ["auto", "on", "off"], default="auto", advanced=True,
                         tooltip=_help("activation_offload", "auto = let the planner choose.")),
                io.Boolean("gradient_checkpointing", default=True, advanced=True,
                           tooltip=_help("gradient_checkpointing")),
                io.Float("max_pinned_fraction", default=0.8, min=0.05, max=0.95, step=0.05, advanced=True,
                         tooltip=_help("max_pinned_fraction")),
                # Last: UI-format workflows store widget values by position.
                io.Combo("int8_compute", list(INT8_COMPUTE_MODES), default="dequant", tooltip=_help("int8_compute")),
                io.Int("recompute_chunks", default=0, min=0, max=64, advanced=True,
                       tooltip=_help("recompute_chunks", "0 = let the planner choose.")),
                io.Combo("optimizer_on_host", ["auto", "on", "off"], default="auto", advanced=True,
                         tooltip=_help("optimizer_on_host", "auto = let the planner choose.")),
                io.Int("micro_batch_size", default=0, min=0, max=64, advanced=True,
                       tooltip=_help("micro_batch_size", "0 = let the planner choose.")),
                io.Combo("compile", list(COMPILE_MODES), default="auto", advanced=True, tooltip=_help("compile")),
                io.Float("activation_memory_budget", default=1.0, min=0.05, max=1.0, step=0.05, advanced=True,
                         tooltip=_help("activation_memory_budget")),
                io.Combo("outer_on_host", ["auto", "on", "off"], default="auto", advanced=True,
                         tooltip=_help("outer_on_host", "auto = let the planner choose.")),
                io.Float("ram_budget_gb", default=0.0, min=0.0, max=4096.0, step=0.5, tooltip=_help("ram_budget_gb")),
                io.Int("disk_blocks", default=-1, min=-1, max=512, advanced=True,
                       tooltip=_help("disk_blocks", "-1 = let the planner choose.")),
            ])

    @classmethod
    def execute(cls, mode: str = "auto", vram_budget_gb: float = 0.0, resident_blocks: int = -1,
                prefetch_depth: int = 0, activation_offload: str = "auto", gradient_checkpointing: bool = True,
                max_pinned_fraction: float = 0.8, int8_compute: str = "dequant", recompute_chunks: int = 0,
                optimizer_on_host: str = "auto", micro_batch_size: int = 0, compile: str = "auto",
                activation_memory_budget: float = 1.0, outer_on_host: str = "auto",
                ram_budget_gb: float = 0.0, disk_blocks: int = -1) -> io.NodeOutput:
        from ..engine.offload import OffloadConfig

        for name, value in (("activation_offload", activation_offload), ("optimizer_on_host", optimizer_on_host),
                            ("outer_on_host", outer_on_host)):
            if value not in ("auto", "on", "off"):
                raise ValueError(f"{name}={value!r} is not one of auto, on, off")
        return io.NodeOutput(OffloadConfig(
            mode=mode, vram_budget_gb=vram_budget_gb, ram_budget_gb=ram_budget_gb,
            resident_blocks=None if resident_blocks < 0 else resident_blocks,
            prefetch_depth=None if prefetch_depth == 0 else prefetch_depth,
            activation_offload=None if activation_offload == "auto" else activation_offload == "on",
            gradient_checkpointing=gradient_checkpointing, max_pinned_fraction=max_pinned_fraction,
            int8_compute=int8_compute, recompute_chunks=recompute_chunks or None,
            optimizer_on_host=None if optimizer_on_host == "auto" else optimizer_on_host == "on",
            micro_batch_size=micro_batch_size or None, compile=compile,
            activation_memory_budget=activation_memory_budget,
            outer_on_host=None if outer_on_host == "auto" else outer_on_host == "on",
            disk_blocks=None if disk_blocks < 0 else disk_blocks,
        ))
