"""Offload Config: how the model's memory is managed while training.

The node shows what people set on most runs: mode, compile and the VRAM and RAM budgets. The planner's own choices
(resident, prefetched and disk blocks, activation offload, recompute, micro-batches, the int8 matmul path...) are
Offload Tuning's (nodes/offload_tuning.py), an optional node plugged into ``tuning``; unplugged, its defaults, which
are the values these widgets had here. Tooltips come from the help text of OffloadConfig's fields
(engine/offload/config.py), so each trade-off is explained once.
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
    "The planner's own choices (resident and disk blocks, prefetch, activation offload, recompute, int8 compute...) "
    "are Offload Tuning's: plug one into tuning to override one."
)

#: Offload Config's widgets in the order workflows saved before 2026-11-28 hold their values (UI format: by
#: position; older files hold a prefix of it, as each widget was added at the end). Since then all but mode,
#: compile and the budgets are Offload Tuning's; such a file is read by these names (nodes/moved_settings.py; the
#: editor's web/moved_settings.js holds the same list).
LEGACY_WIDGETS = ("mode", "vram_budget_gb", "resident_blocks", "prefetch_depth", "activation_offload",
                  "gradient_checkpointing", "max_pinned_fraction", "int8_compute", "recompute_chunks",
                  "optimizer_on_host", "micro_batch_size", "compile", "activation_memory_budget", "outer_on_host",
                  "ram_budget_gb", "disk_blocks")


def is_legacy_layout(values: list) -> bool:
    """Whether a UI-format ``widgets_values`` list is in ``LEGACY_WIDGETS``' order: its 2nd value is
    vram_budget_gb's number where today's layout has compile's text."""
    return len(values) >= 2 and not isinstance(values[1], str)


class LowVRAMOffloadConfig(io.Node):
    # How a workflow saved before Offload Tuning holds its values (host/workflow.py reads it).
    LEGACY_WIDGETS = LEGACY_WIDGETS
    is_legacy_layout = staticmethod(is_legacy_layout)

    @classmethod
    def moved_inputs(cls) -> dict:
        from .moved_settings import moved_inputs
        from .offload_tuning import OPTION_NODES

        return moved_inputs(OPTION_NODES)

    @classmethod
    def define_schema(cls) -> io.Schema:
        from ..engine.offload.config import COMPILE_MODES

        return io.Schema(
            node_id="LowVRAMOffloadConfig", display_name="Offload Config", category=CATEGORY,
            description=DESCRIPTION, hidden=["unique_id", "prompt"],
            outputs=[io.Output("LOWVRAM_OFFLOAD", "offload", "Memory settings for Train LoRA.")],
            inputs=[
                io.Combo("mode", ["auto", "resident", "stream"], default="auto", tooltip=_help("mode")),
                io.Combo("compile", list(COMPILE_MODES), default="auto", tooltip=_help("compile")),
                io.Float("vram_budget_gb", default=0.0, min=0.0, max=1024.0, step=0.5, tooltip=_help("vram_budget_gb")),
                io.Float("ram_budget_gb", default=0.0, min=0.0, max=4096.0, step=0.5, tooltip=_help("ram_budget_gb")),
                io.Custom("LOWVRAM_OFFLOAD_TUNING", "tuning", optional=True,
                          tooltip="From Offload Tuning: override the planner's own choices (resident, prefetched "
                                  "and disk blocks, activation offload, recompute, micro-batches, int8 compute...). "
                                  "Unconnected: the planner chooses."),
            ])

    @classmethod
    def execute(cls, mode: str = "auto", compile: str = "auto", vram_budget_gb: float = 0.0,
                ram_budget_gb: float = 0.0, tuning=None, **legacy) -> io.NodeOutput:
        """``legacy``: a setting that moved to Offload Tuning, given by name (a Python caller, or a workflow saved
        before the move: nodes/moved_settings.py)."""
        from ..engine.offload import OffloadConfig
        from .moved_settings import legacy_values, merge
        from .offload_tuning import OPTION_NODES

        t = merge("Offload Config", OPTION_NODES, {"tuning": tuning},
                  {**legacy_values(cls, cls.hidden.prompt, cls.hidden.unique_id), **legacy}, _log)
        for name in ("activation_offload", "optimizer_on_host", "outer_on_host"):
            if t[name] not in ("auto", "on", "off"):
                raise ValueError(f"{name}={t[name]!r} is not one of auto, on, off")

        def tri(name: str):  # auto / on / off -> None / True / False
            return None if t[name] == "auto" else t[name] == "on"

        return io.NodeOutput(OffloadConfig(
            mode=mode, vram_budget_gb=vram_budget_gb, ram_budget_gb=ram_budget_gb,
            resident_blocks=None if t["resident_blocks"] < 0 else t["resident_blocks"],
            prefetch_depth=t["prefetch_depth"] or None, activation_offload=tri("activation_offload"),
            gradient_checkpointing=t["gradient_checkpointing"], max_pinned_fraction=t["max_pinned_fraction"],
            int8_compute=t["int8_compute"], recompute_chunks=t["recompute_chunks"] or None,
            optimizer_on_host=tri("optimizer_on_host"), micro_batch_size=t["micro_batch_size"] or None,
            compile=compile, activation_memory_budget=t["activation_memory_budget"], outer_on_host=tri("outer_on_host"),
            disk_blocks=None if t["disk_blocks"] < 0 else t["disk_blocks"],
            allocator_margin_gb=t["allocator_margin_gb"] or None,
        ))


def _log(message: str) -> None:
    """A by-name value over a plugged Offload Tuning's (the graph's two answers): said in the console."""
    print(f"lowvram-lora: Offload Config: {message}", flush=True)
