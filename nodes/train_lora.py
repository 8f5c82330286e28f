"""Train LoRA: runs the engine's training loop; shows the loss curve."""
from __future__ import annotations

import os
import uuid

from . import schema as io
from .load_model import CATEGORY
from .paths import cache_dir, output_dir, temp_dir


DESCRIPTION = (
    "Trains a LoRA on the cached dataset with flow matching (the objective Flux was trained with). "
    "Shows progress with loss, learning rate, seconds per step and peak VRAM, and the loss curve when done. "
    "Rerunning with identical inputs reuses the finished run instead of training again."
)


#: Train LoRA's widgets in the order workflows saved before 2026-11-28 hold their values (UI format: by position;
#: older files hold a prefix of it, as each widget was added at the end). Since then the rarely changed ones are
#: Training Options' and Preview Options' widgets. The editor's extension (web/moved_settings.js, the same list) and
#: the headless runner (host/workflow.py) read such a file by these names; Train LoRA takes the moved ones by name.
LEGACY_WIDGETS = ("steps", "learning_rate", "rank", "alpha", "batch_size", "gradient_accumulation", "lr_scheduler",
                  "warmup_steps", "training_seed", "guidance", "max_grad_norm", "optimizer", "save_every",
                  "sample_every", "sample_steps", "sample_resolution", "sample_seed", "sample_at_start",
                  "sample_guidance", "sample_frames")


def is_legacy_layout(values: list) -> bool:
    """Whether a UI-format ``widgets_values`` list is in ``LEGACY_WIDGETS``' order: its 7th value is lr_scheduler's
    text where today's layout has sample_every's number (every saved layout had at least 13 values)."""
    return len(values) >= 7 and isinstance(values[6], str)


class LowVRAMTrainLoRA(io.Node):
    # How a workflow saved before Training Options and Preview Options holds its values (host/workflow.py reads it).
    LEGACY_WIDGETS = LEGACY_WIDGETS
    is_legacy_layout = staticmethod(is_legacy_layout)

    @classmethod
    def moved_inputs(cls) -> dict:
        from .moved_settings import moved_inputs
        from .training_options import OPTION_NODES

        return moved_inputs(OPTION_NODES)

    @classmethod
    def define_schema(cls) -> io.Schema:
        from ..engine.config import LoraSettings, TrainConfig, field_help

        def train(name: str, extra: str = "") -> str:
            return field_help(TrainConfig, name, extra)

        return io.Schema(
            node_id="LowVRAMTrainLoRA", display_name="Train LoRA (LowVRAM)",  # ComfyUI has a built-in "Train LoRA"
            category=CATEGORY, description=DESCRIPTION, hidden=["unique_id", "prompt"],
            outputs=[
                io.Output("LOWVRAM_LORA", "lora", "The trained LoRA weights and their loss history."),
                io.Output("IMAGE", "loss_curve", "The loss curve as an image."),
                io.Output("IMAGE", "samples", "The last sample grid (prompts x checkpoints); a blank image when "
                                              "sampling is off."),
                # After the older outputs: UI-format workflows link outputs by position.
                io.Output("LORA_MODEL", "lora_model",
                          "The LoRA in ComfyUI's own form, for its Load LoRA Model node (LoraModelLoader): apply it "
                          "to a MODEL from ComfyUI's loaders and sample in this graph. The same tensors Save LoRA "
                          "writes (bf16), so it samples as the saved file does through LoraLoaderModelOnly; with EMA "
                          "on, the EMA's file when LoRA Adapter's ema_previews is on."),
                io.Output("LOSS_MAP", "loss_map", "The loss per step, for ComfyUI's Plot Loss Graph node."),
            ],
            inputs=[
                io.Custom("LOWVRAM_MODEL", "model", tooltip="The base model from Load Quantized Slab."),
                io.Custom("LOWVRAM_DATASET", "dataset", tooltip="The cached dataset from Cache Text Embeds."),
                io.Custom("LOWVRAM_OFFLOAD", "offload", tooltip="Memory settings from Offload Config."),
                io.Int("steps", default=1000, min=1, max=1_000_000,
                       tooltip=train("steps")),
                io.Float("learning_rate", default=1e-4, min=1e-6, max=1.0, step=1e-6, round=False,
                         tooltip=train("learning_rate")),
                io.Int("rank", default=16, min=1, max=256,
                       tooltip=field_help(LoraSettings, "rank")),
                io.Float("alpha", default=16.0, min=0.01, max=1024.0, step=0.5,
                         tooltip=field_help(LoraSettings, "alpha")),
                io.Int("batch_size", default=1, min=1, max=64,
                       tooltip=train("batch_size")),
                # Not named "seed": ComfyUI gives inputs named seed a "control after generate"
                # widget that defaults to randomize, which would retrain on every queue.
                io.Int("training_seed", default=42, min=0, max=0xFFFFFFFF,
                       tooltip=train("seed", "Change it to train again with identical settings.")),
                io.Int("sample_every", default=0, min=0, max=1_000_000, tooltip=_sample_help("every")),
                io.Int("sample_frames", default=17, min=1, max=257, step=4, tooltip=_sample_help("frames")),
                io.Custom("LOWVRAM_SPLIT", "split", optional=True,
                          tooltip="From Dual-GPU Split: train across two GPUs (split the model, or data "
                                  "parallel). Unconnected: one GPU."),
                io.Custom("LOWVRAM_MODEL", "preview_partner", optional=True, tooltip=_partner_help()),
                io.Custom("LOWVRAM_ADAPTER", "adapter", optional=True,
                          tooltip="From LoRA Adapter: train LoHa, LoKr or DoRA instead of LoRA, with their own "
                                  "settings. Unconnected: plain LoRA."),
                io.Custom("LOWVRAM_LOSS_OPTIONS", "loss_options", optional=True,
                          tooltip="From Loss & Validation Options: masked-loss weight, validation loss, CSV and "
                                  "TensorBoard logs. Unconnected: the defaults, without logs."),
                io.Custom("LOWVRAM_TRAINING_OPTIONS", "training_options", optional=True,
                          tooltip="From Training Options: gradient accumulation, learning-rate schedule and warmup, "
                                  "optimizer, gradient clipping, guidance, save_every. Unconnected: their defaults."),
                io.Custom("LOWVRAM_PREVIEW_OPTIONS", "preview_options", optional=True,
                          tooltip="From Preview Options: the sample grids' steps, resolution, seed, guidance and "
                                  "the grid before training. Unconnected: their defaults."),
            ])

    @classmethod
    def execute(cls, model, dataset, offload, steps: int = 1000, learning_rate: float = 1e-4, rank: int = 16,
                alpha: float = 16.0, batch_size: int = 1, training_seed: int = 42, sample_every: int = 0,
                sample_frames: int = 17, split=None, preview_partner=None, adapter=None, loss_options=None,
                training_options=None, preview_options=None, **legacy) -> io.NodeOutput:
        """``legacy``: a setting that moved to Training Options or Preview Options, given by name (a Python caller,
        or a workflow saved before the move: nodes/moved_settings.py)."""
        from ..engine.config import LoraSettings, TrainConfig
        from ..engine.sampling import SamplingConfig
        from ..engine.runs.result_reuse import train_or_reuse
        from .moved_settings import legacy_values
        from .progress import free_comfy_vram, make_callback

        free_comfy_vram()
        callback = make_callback(cls.hidden.unique_id)
        o = moved_settings(training_options, preview_options,
                           {**legacy_values(cls, cls.hidden.prompt, cls.hidden.unique_id), **legacy}, callback.log)
        warmup_steps = o["warmup_steps"]
        if warmup_steps and warmup_steps >= steps:
            # A shipped workflow's warmup (50) must not break a short test run (steps=20).
            clamped = steps // 10
            callback.log(f"warmup_steps={warmup_steps} is not below steps={steps}; using {clamped} "
                         f"(a tenth of the steps) for this run")
            warmup_steps = clamped
        lora_cfg = LoraSettings(rank=rank, alpha=alpha, **({"adapter": adapter} if adapter is not None else {}))
        train_cfg = TrainConfig(
            steps=steps, learning_rate=learning_rate, batch_size=batch_size,
            gradient_accumulation=o["gradient_accumulation"], lr_scheduler=o["lr_scheduler"],
            warmup_steps=warmup_steps, seed=training_seed, guidance=o["guidance"], max_grad_norm=o["max_grad_norm"],
            optimizer=o["optimizer"], save_every=o["save_every"],
        )
        sampling = SamplingConfig(every=sample_every, steps=o["sample_steps"], resolution=o["sample_resolution"],
                                  seed=o["sample_seed"], at_start=o["sample_at_start"],
                                  guidance=o["sample_guidance"], frames=sample_frames)
        extra = {"loss": loss_options, "log_dir": output_dir() / "lowvram_logs" / uuid.uuid4().hex[:12]} \
            if loss_options is not None else {}  # unplugged: the call (and the run's key) as before
        lora = train_or_reuse(model, dataset, lora_cfg, train_cfg, cache_dir(), callback,
                              parallel=split, offload=offload, sampling=sampling, preview_partner=preview_partner,
                              sample_dir=output_dir() / "lowvram_samples" / uuid.uuid4().hex[:12], **extra)
        image, ui = _loss_curve_outputs(lora)
        _add_sample_clips(lora, ui)
        if lora.snapshots:  # LoRA Adapter's snapshot_every: the loadable files kept, listed under the node
            ui["snapshots"] = list(lora.snapshots)
        return io.NodeOutput(lora, image, _samples_output(lora), _comfy_lora(lora),
                             {"loss": [float(x) for x in lora.loss_history]}, ui=ui)


def moved_settings(training_options, preview_options, legacy: dict, log=None) -> dict:
    """The settings Training Options and Preview Options hold, by name (nodes/moved_settings.py ``merge``): a value
    given to Train LoRA by name over the plugged node's values, over the node's defaults (what Train LoRA used
    before)."""
    from .moved_settings import merge
    from .training_options import OPTION_NODES

    return merge("Train LoRA", OPTION_NODES,
                 {"training_options": training_options, "preview_options": preview_options}, legacy, log)


def _comfy_lora(lora) -> dict:
    """LORA_MODEL: ComfyUI's LoRA key form of this family (empty when training stopped before its first step): the
    EMA's when the previews drew with it (LoRA Adapter's ema_previews)."""
    from ..engine.lora_io.files import lora_tensors

    return lora_tensors(lora.as_ema() if lora.ema_in_previews else lora) if lora.state_dict else {}


def _partner_help() -> str:
    from ..engine.sampling import PREVIEW_PARTNER_HELP

    return PREVIEW_PARTNER_HELP


def _sample_help(name: str) -> str:
    from ..engine.config import field_help
    from ..engine.sampling import SamplingConfig

    return field_help(SamplingConfig, name)


def _samples_output(lora):
    """The last sample grid as an IMAGE tensor (1, H, W, 3); 64x64 black when there is none."""
    import numpy as np
    import torch

    grids = [p for p in lora.sample_grids if os.path.exists(p)]
    if not grids:
        return torch.zeros(1, 64, 64, 3)
    from PIL import Image

    with Image.open(grids[-1]) as img:
        return torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0)[None]


def _add_sample_clips(lora, ui: dict) -> None:
    """A video model's last checkpoint clips (animated WebPs in ComfyUI's output folder) after the loss curve in
    the node's preview, with ComfyUI's ``animated`` flag (as its SaveAnimatedWEBP returns them): the frontend then
    shows them as animated images instead of drawing a still."""
    from pathlib import Path

    from ..engine.sampling import saved_clips

    grids = [p for p in lora.sample_grids if os.path.exists(p)]
    if not grids:
        return
    root = output_dir().resolve()
    clips = saved_clips(grids[-1])
    entries = []
    for p in clips:
        try:
            entries.append({"filename": p.name, "subfolder": Path(p).parent.resolve().relative_to(root).as_posix(),
                            "type": "output"})
        except ValueError:  # a sample folder outside the output folder (headless runs): the frontend cannot show it
            pass
    if entries:
        ui["images"] = ui.get("images", []) + entries
        ui["animated"] = [True]


def _loss_curve_outputs(lora):
    """The curve as an IMAGE tensor (1, H, W, 3) in [0, 1] and a UI preview entry."""
    import numpy as np
    import torch

    from ..engine.plotting import render_loss_curve

    val = lora.settings.get("validation") or {}
    img = render_loss_curve(lora.loss_history, title=f"training loss, rank {lora.rank}",
                            validation=list(zip(val.get("steps", []), val.get("loss", []))))
    tensor = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)[None]
    name = f"lowvram_loss_{uuid.uuid4().hex[:8]}.png"
    # Every ui value is a list: ComfyUI concatenates them across calls (execution.py).
    ui = {"final_loss": [round(lora.loss_history[-1], 6)] if lora.loss_history else [], "steps": [lora.steps]}
    folder = temp_dir()  # the curve as the node's preview image (ComfyUI, or lowvram-lora serve)
    os.makedirs(folder, exist_ok=True)
    img.save(os.path.join(folder, name))
    ui["images"] = [{"filename": name, "subfolder": "", "type": "temp"}]
    return tensor, ui
