"""Dataset Options: masked loss and a validation split, into Cache Text Embeds' optional ``options`` socket.

Tooltips come from the help text of DatasetOptions' fields (engine/data/options.py), written once there.
"""
from __future__ import annotations

from . import schema as io
from .load_model import CATEGORY

DESCRIPTION = (
    "Optional dataset controls for Cache Text Embeds: loss masks (a '<name>_mask.png' beside each image, a masks/ "
    "folder, or the alpha channel), a held-out validation split (a fraction of the images, or a folder), caption "
    "dropout and tag shuffling (a fixed number of shuffled orders cached per caption), a folder of "
    "regularization images with their own captions, the class prompt of differential output preservation, and more "
    "sizes to cache each image at (multi-resolution). Plug "
    "its output into Cache Text Embeds' 'options' input; pair it with Loss & Validation Options on Train LoRA."
)


def _help(name: str, extra: str = "") -> str:
    from ..engine.config import field_help
    from ..engine.data.options import DatasetOptions

    return field_help(DatasetOptions, name, extra)


class LowVRAMDatasetOptions(io.Node):
    @classmethod
    def define_schema(cls) -> io.Schema:
        from ..engine.data.options import MASK_SOURCES, MISSING_MASK

        return io.Schema(
            node_id="LowVRAMDatasetOptions", display_name="Dataset Options", category=CATEGORY,
            description=DESCRIPTION,
            outputs=[io.Output("LOWVRAM_DATASET_OPTIONS", "options", "Dataset controls for Cache Text Embeds.")],
            inputs=[
                io.Combo("mask_source", list(MASK_SOURCES), default="none", tooltip=_help("mask_source")),
                io.Combo("missing_mask", list(MISSING_MASK), default="error", tooltip=_help("missing_mask")),
                io.Float("validation_fraction", default=0.0, min=0.0, max=0.9, step=0.05,
                         tooltip=_help("validation_fraction")),
                io.String("validation_folder", default="",
                          tooltip=_help("validation_folder", "A relative path is looked up as dataset_path is.")),
                io.Float("caption_dropout", default=0.0, min=0.0, max=0.95, step=0.01,
                         tooltip=_help("caption_dropout")),
                io.Boolean("shuffle_tags", default=False, tooltip=_help("shuffle_tags")),
                io.Int("keep_tags", default=1, min=0, max=64, tooltip=_help("keep_tags")),
                io.Int("caption_variants", default=4, min=2, max=64, tooltip=_help("caption_variants")),
                io.String("reg_folder", default="",
                          tooltip=_help("reg_folder", "A relative path is looked up as dataset_path is.")),
                # Optional (added later): graphs saved before them still validate, and leave them off.
                io.String("preservation_prompt", default="", tooltip=_help("preservation_prompt"), optional=True),
                io.String("resolutions", default="", tooltip=_help("resolutions"), optional=True),
            ])

    @classmethod
    def execute(cls, mask_source: str = "none", missing_mask: str = "error", validation_fraction: float = 0.0,
                validation_folder: str = "", caption_dropout: float = 0.0, shuffle_tags: bool = False,
                keep_tags: int = 1, caption_variants: int = 4, reg_folder: str = "",
                preservation_prompt: str = "", resolutions: str = "") -> io.NodeOutput:
        from ..engine.data.options import DatasetOptions, parse_resolutions
        from .paths import resolve_dataset_path

        folder = str(resolve_dataset_path(validation_folder.strip())) if validation_folder.strip() else ""
        reg = str(resolve_dataset_path(reg_folder.strip())) if reg_folder.strip() else ""
        return io.NodeOutput(DatasetOptions(mask_source=mask_source, missing_mask=missing_mask,
                                            validation_fraction=validation_fraction, validation_folder=folder,
                                            caption_dropout=caption_dropout, shuffle_tags=shuffle_tags,
                                            keep_tags=keep_tags, caption_variants=caption_variants,
                                            reg_folder=reg, preservation_prompt=preservation_prompt.strip(),
                                            resolutions=parse_resolutions(resolutions)))
