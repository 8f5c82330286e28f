"""Loss & Validation Options: the masked loss's weight, validation and logs, into Train LoRA's optional
``loss_options`` socket.

Tooltips come from the help text of LossOptions' fields (engine/train/loss_options.py), written once there.
"""
from __future__ import annotations

from . import schema as io
from .load_model import CATEGORY

DESCRIPTION = (
    "Optional loss and validation controls for Train LoRA: how much the area outside a loss mask counts, how "
    "often the validation loss (on Dataset Options' held-out split) is measured, TensorBoard logs, and how noise "
    "levels are drawn and weighted (the family's own recipe by default), regularization images' share and weight, "
    "differential output preservation's weight (its class prompt is on Dataset Options), and, for a model that "
    "holds its first frame (LTX-2 image-to-video), the share of clips trained as image-to-video. With it "
    "plugged in, each run writes a CSV log (loss, validation loss, lr, step time, VRAM, RAM) that Save LoRA puts "
    "beside the LoRA as '<name>_log.csv', and TensorBoard files under output/lowvram_logs/."
)


def _help(name: str, extra: str = "") -> str:
    from ..engine.config import field_help
    from ..engine.train.loss_options import LossOptions

    return field_help(LossOptions, name, extra)


class LowVRAMLossOptions(io.Node):
    @classmethod
    def define_schema(cls) -> io.Schema:
        from ..engine.train.loss_options import LOSS_WEIGHTINGS, TIMESTEP_SAMPLERS

        return io.Schema(
            node_id="LowVRAMLossOptions", display_name="Loss & Validation Options", category=CATEGORY,
            description=DESCRIPTION,
            outputs=[io.Output("LOWVRAM_LOSS_OPTIONS", "loss_options", "Loss, validation and log settings for "
                                                                       "Train LoRA.")],
            inputs=[
                io.Float("unmasked_weight", default=0.0, min=0.0, max=1.0, step=0.05, tooltip=_help("unmasked_weight")),
                io.Int("validation_every", default=0, min=-1, max=1_000_000, tooltip=_help("validation_every")),
                io.Int("validation_timesteps", default=4, min=1, max=64, tooltip=_help("validation_timesteps")),
                io.Boolean("tensorboard", default=True, tooltip=_help("tensorboard")),
                io.Combo("timestep_sampling", ["family"] + list(TIMESTEP_SAMPLERS), default="family",
                         tooltip=_help("timestep_sampling")),
                io.Float("logit_mean", default=0.0, min=-5.0, max=5.0, step=0.1, tooltip=_help("logit_mean")),
                io.Float("logit_std", default=1.0, min=0.05, max=5.0, step=0.05, tooltip=_help("logit_std")),
                io.Float("sigmoid_scale", default=1.0, min=0.05, max=5.0, step=0.05, tooltip=_help("sigmoid_scale")),
                io.Combo("loss_weighting", ["family"] + list(LOSS_WEIGHTINGS), default="family",
                         tooltip=_help("loss_weighting")),
                io.Float("snr_gamma", default=5.0, min=0.1, max=100.0, step=0.5, tooltip=_help("snr_gamma")),
                io.Float("reg_ratio", default=0.5, min=0.0, max=0.95, step=0.05, tooltip=_help("reg_ratio")),
                io.Float("prior_loss_weight", default=1.0, min=0.0, max=10.0, step=0.05,
                         tooltip=_help("prior_loss_weight")),
                io.Float("preservation_weight", default=0.0, min=0.0, max=10.0, step=0.05,  # optional: added later
                         tooltip=_help("preservation_weight"), optional=True),
                io.Float("first_frame_p", default=1.0, min=0.0, max=1.0, step=0.05,  # optional: added later
                         tooltip=_help("first_frame_p"), optional=True),
            ])

    @classmethod
    def execute(cls, unmasked_weight: float = 0.0, validation_every: int = 0, validation_timesteps: int = 4,
                tensorboard: bool = True, timestep_sampling: str = "family", logit_mean: float = 0.0,
                logit_std: float = 1.0, sigmoid_scale: float = 1.0, loss_weighting: str = "family",
                snr_gamma: float = 5.0, reg_ratio: float = 0.5, prior_loss_weight: float = 1.0,
                preservation_weight: float = 0.0, first_frame_p: float = 1.0) -> io.NodeOutput:
        from ..engine.train.loss_options import LossOptions

        return io.NodeOutput(LossOptions(unmasked_weight=unmasked_weight, validation_every=validation_every,
                                         validation_timesteps=validation_timesteps, tensorboard=tensorboard,
                                         timestep_sampling=timestep_sampling, logit_mean=logit_mean,
                                         logit_std=logit_std, sigmoid_scale=sigmoid_scale,
                                         loss_weighting=loss_weighting, snr_gamma=snr_gamma, reg_ratio=reg_ratio,
                                         prior_loss_weight=prior_loss_weight,
                                         preservation_weight=preservation_weight, first_frame_p=first_frame_p))
