"""Offload Tuning: the planner's own choices (resident, prefetched and disk blocks, activation offload, recompute,
micro-batches, host-held optimizer and outer layers, the int8 matmul path, the pinned-RAM cap, the compiled blocks'
activation budget, the allocator margin), in a small optional node that plugs into Offload Config's ``tuning`` socket (issue 43). Offload
Config itself shows what people set on most runs: mode, compile and the VRAM and RAM budgets.

Unplugged, Offload Config uses this node's defaults, which are the values its own widgets had before they moved
here ("let the planner choose" for most): a saved workflow plans as before. Workflows saved while these were Offload
Config's widgets still load (nodes/offload_config.py ``LEGACY_WIDGETS``; nodes/moved_settings.py). Tooltips come
from the help text of OffloadConfig's fields (engine/offload/config.py). Widgets cannot hold None: -1 / 0 / "auto"
stand for "let the planner choose", as each tooltip says.
"""
from __future__ import annotations

from . import schema as io
from .load_model import CATEGORY
from .moved_settings import defaults, option_values  # noqa: F401  (defaults: its users import it from here)


def _help(name: str, extra: str = "") -> str:
    from ..engine.config import field_help
    from ..engine.offload.config import OffloadConfig  # torch-free module

    return field_help(OffloadConfig, name, extra)


class LowVRAMOffloadTuning(io.Node):
    @classmethod
    def define_schema(cls) -> io.Schema:
        from ..engine.offload.config import INT8_COMPUTE_MODES

        return io.Schema(
            node_id="LowVRAMOffloadTuning", display_name="Offload Tuning", category=CATEGORY,
            description="Optional overrides of the offload planner's own choices, for Offload Config's tuning input: "
                        "resident, prefetched and disk blocks, activation offload, recompute chunks, micro-batches, "
                        "the optimizer and outer layers on the host, the int8 matmul path, the pinned-RAM cap, "
                        "the compiled blocks' activation budget and the VRAM kept free for the allocator. Unplugged: the defaults shown here (the planner "
                        "chooses).",
            outputs=[io.Output("LOWVRAM_OFFLOAD_TUNING", "tuning", "Planner overrides for Offload Config's tuning "
                                                                   "input.")],
            inputs=[
                io.Int("resident_blocks", default=-1, min=-1, max=512,
                       tooltip=_help("resident_blocks", "-1 = let the planner choose.")),
                io.Int("prefetch_depth", default=0, min=0, max=8,
                       tooltip=_help("prefetch_depth", "0 = let the planner choose.")),
                io.Combo("activation_offload", ["auto", "on", "off"], default="auto",
                         tooltip=_help("activation_offload", "auto = let the planner choose.")),
                io.Boolean("gradient_checkpointing", default=True, tooltip=_help("gradient_checkpointing")),
                io.Float("max_pinned_fraction", default=0.8, min=0.05, max=0.95, step=0.05,
                         tooltip=_help("max_pinned_fraction")),
                io.Combo("int8_compute", list(INT8_COMPUTE_MODES), default="dequant", tooltip=_help("int8_compute")),
                io.Int("recompute_chunks", default=0, min=0, max=64,
                       tooltip=_help("recompute_chunks", "0 = let the planner choose.")),
                io.Combo("optimizer_on_host", ["auto", "on", "off"], default="auto",
                         tooltip=_help("optimizer_on_host", "auto = let the planner choose.")),
                io.Int("micro_batch_size", default=0, min=0, max=64,
                       tooltip=_help("micro_batch_size", "0 = let the planner choose.")),
                io.Float("activation_memory_budget", default=1.0, min=0.05, max=1.0, step=0.05,
                         tooltip=_help("activation_memory_budget")),
                io.Combo("outer_on_host", ["auto", "on", "off"], default="auto",
                         tooltip=_help("outer_on_host", "auto = let the planner choose.")),
                io.Int("disk_blocks", default=-1, min=-1, max=512,
                       tooltip=_help("disk_blocks", "-1 = let the planner choose.")),
                io.Float("allocator_margin_gb", default=0.0, min=0.0, max=16.0, step=0.25,
                         tooltip=_help("allocator_margin_gb", "0 = the family's measured margin.")),
            ])

    @classmethod
    def execute(cls, **values) -> io.NodeOutput:
        return io.NodeOutput(option_values(cls, values))


#: Offload Config's socket for this node.
OPTION_NODES = {"tuning": LowVRAMOffloadTuning}
