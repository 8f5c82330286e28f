"""LoRA Adapter: which kind of adapter Train LoRA trains (LoRA, LoHa, LoKr, DoRA), its own settings, a LoRA file to
continue from, EMA of its weights, and loadable snapshots every N steps.

Plugged into Train LoRA's optional ``adapter`` socket; unconnected, Train LoRA trains plain LoRA. Tooltips come from
the help text of AdapterConfig's fields (engine/config.py). Rank and alpha stay on Train LoRA (every type has them).
Settings of a type other than the chosen one are ignored: AdapterConfig resets them to their defaults, so changing
them neither alters the result nor retrains (the run's identity is unchanged).
"""
from __future__ import annotations

from . import schema as io
from .load_model import CATEGORY


def _help(name: str, extra: str = "") -> str:
    from ..engine.config import AdapterConfig, field_help

    return field_help(AdapterConfig, name, extra)


DESCRIPTION = (
    "Chooses the adapter Train LoRA trains: lora, loha (LoHa), lokr (LoKr) or dora (DoRA), from peft, on every "
    "model and memory mode LoRA trains on. All are saved so ComfyUI's own LoRA loader applies them exactly; "
    "LoHa and LoKr files load in ComfyUI only (diffusers has no loader for them). Also: continue from a LoRA file, "
    "an EMA of the weights (saved as its own file beside the plain one; previews can draw with it), loadable "
    "snapshots every N steps."
)


class LowVRAMLoraAdapter(io.Node):
    @classmethod
    def define_schema(cls) -> io.Schema:
        from ..engine.config import ADAPTER_TYPES

        return io.Schema(
            node_id="LowVRAMLoraAdapter", display_name="LoRA Adapter (LowVRAM)", category=CATEGORY,
            description=DESCRIPTION,
            outputs=[io.Output("LOWVRAM_ADAPTER", "adapter", "The adapter settings, for Train LoRA's adapter input.")],
            inputs=[
                io.Combo("type", list(ADAPTER_TYPES), default="lora", tooltip=_help("type")),
                io.Int("lokr_factor", default=-1, min=-1, max=4096, tooltip=_help("lokr_factor")),
                io.Boolean("lokr_decompose_both", default=False, tooltip=_help("lokr_decompose_both")),
                io.String("continue_from", default="",
                          tooltip=_help("continue_from", "A full path, or a file name in ComfyUI's models/loras "
                                                         "folder.")),
                io.Float("ema_decay", default=0.0, min=0.0, max=0.9999, step=0.001, round=False,
                         tooltip=_help("ema_decay")),
                io.Int("snapshot_every", default=0, min=0, max=1_000_000, tooltip=_help("snapshot_every")),
                io.Int("snapshot_keep", default=3, min=0, max=10_000, tooltip=_help("snapshot_keep")),
                # Last, and optional: UI-format workflows store widget values by position, and API-format ones
                # saved before it have no value for it.
                io.Boolean("ema_previews", default=True, optional=True, tooltip=_help("ema_previews")),
            ])

    @classmethod
    def execute(cls, type: str = "lora", lokr_factor: int = -1, lokr_decompose_both: bool = False,
                continue_from: str = "", ema_decay: float = 0.0, snapshot_every: int = 0,
                snapshot_keep: int = 3, ema_previews: bool = True) -> io.NodeOutput:
        from pathlib import Path

        from ..engine.config import AdapterConfig
        from .paths import output_dir, resolve_file

        path = continue_from.strip()
        if path and not Path(path).expanduser().is_absolute():
            path = str(resolve_file(path, ("loras",)))
        return io.NodeOutput(AdapterConfig(
            type=type, lokr_factor=lokr_factor, lokr_decompose_both=lokr_decompose_both, continue_from=path,
            ema_decay=ema_decay, ema_previews=ema_previews, snapshot_every=snapshot_every, snapshot_keep=snapshot_keep,
            snapshot_dir=str(output_dir() / "loras" / "snapshots") if snapshot_every else ""))
