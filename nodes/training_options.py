"""Training Options and Preview Options: Train LoRA's rarely changed settings, in two small nodes that plug into its
optional ``training_options`` and ``preview_options`` sockets, so the node itself shows only what people change
(steps, learning rate, rank, alpha, batch size, seed, how often to preview).

Unplugged, Train LoRA uses these nodes' defaults, which are the values it used before the settings moved here: a
saved workflow trains as before. Workflows saved while the settings were Train LoRA's own widgets still load: see
``LEGACY_WIDGETS`` in nodes/train_lora.py. Tooltips come from the help text of TrainConfig's and SamplingConfig's
fields, written once there.
"""
from __future__ import annotations

from . import schema as io
from .load_model import CATEGORY
from .moved_settings import defaults, option_values  # noqa: F401  (their users import them from here)


def _train(name: str) -> str:
    from ..engine.config import TrainConfig, field_help

    return field_help(TrainConfig, name)


def _sample(name: str) -> str:
    from ..engine.config import field_help
    from ..engine.sampling import SamplingConfig

    return field_help(SamplingConfig, name)


class LowVRAMTrainingOptions(io.Node):
    @classmethod
    def define_schema(cls) -> io.Schema:
        from ..engine.config import OPTIMIZERS

        return io.Schema(
            node_id="LowVRAMTrainingOptions", display_name="Training Options", category=CATEGORY,
            description="Optional optimizer settings for Train LoRA: gradient accumulation, learning-rate schedule "
                        "and warmup, the optimizer, gradient clipping, the training guidance value and how often a "
                        "resumable state is saved. Unplugged: the defaults shown here.",
            outputs=[io.Output("LOWVRAM_TRAINING_OPTIONS", "training_options",
                               "Optimizer and schedule settings for Train LoRA's training_options input.")],
            inputs=[
                io.Int("gradient_accumulation", default=1, min=1, max=256, tooltip=_train("gradient_accumulation")),
                io.Combo("lr_scheduler", ["constant", "cosine"], default="constant", tooltip=_train("lr_scheduler")),
                io.Int("warmup_steps", default=0, min=0, max=100_000, tooltip=_train("warmup_steps")),
                io.Combo("optimizer", list(OPTIMIZERS), default="adamw", tooltip=_train("optimizer")),
                io.Float("max_grad_norm", default=1.0, min=0.0, max=100.0, step=0.1, tooltip=_train("max_grad_norm")),
                io.Float("guidance", default=1.0, min=0.0, max=10.0, step=0.1, tooltip=_train("guidance")),
                io.Int("save_every", default=0, min=-1, max=1_000_000, tooltip=_train("save_every")),
            ])

    @classmethod
    def execute(cls, **values) -> io.NodeOutput:
        return io.NodeOutput(option_values(cls, values))


class LowVRAMPreviewOptions(io.Node):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowVRAMPreviewOptions", display_name="Preview Options", category=CATEGORY,
            description="Optional settings of Train LoRA's sample grids (turned on by its sample_every): sampling "
                        "steps, resolution, seed, guidance, and whether a grid is drawn before training. "
                        "Unplugged: the defaults shown here.",
            outputs=[io.Output("LOWVRAM_PREVIEW_OPTIONS", "preview_options",
                               "Sample-grid settings for Train LoRA's preview_options input.")],
            inputs=[
                io.Int("sample_steps", default=20, min=1, max=200, tooltip=_sample("steps")),
                io.Int("sample_resolution", default=512, min=64, max=2048, step=16, tooltip=_sample("resolution")),
                io.Int("sample_seed", default=42, min=0, max=0xFFFFFFFF, tooltip=_sample("seed")),
                io.Float("sample_guidance", default=3.5, min=0.0, max=20.0, step=0.1, tooltip=_sample("guidance")),
                io.Boolean("sample_at_start", default=True, tooltip=_sample("at_start")),
            ])

    @classmethod
    def execute(cls, **values) -> io.NodeOutput:
        return io.NodeOutput(option_values(cls, values))


#: Train LoRA's sockets for these nodes, and the node that feeds each.
OPTION_NODES = {"training_options": LowVRAMTrainingOptions, "preview_options": LowVRAMPreviewOptions}
