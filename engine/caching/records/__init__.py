"""The records phase of a cache build: which kind of dataset the model takes, chosen once (``record_source``).

One file per source, each a ``RecordSource`` (``base.py``): ``images.py`` (captioned images), ``clips.py``
(captioned clips, cached per window), ``edit_pairs.py`` (an edit model's target / instruction / control images).
"""
from __future__ import annotations

from typing import Sequence

from ...config import DataConfig
from ...data import VideoConfig
from ...data.options import DatasetOptions
from ...errors import ConfigError
from ..model_sources import CacheModels
from .base import CaptionSource, RecordSource
from .clips import ClipSource
from .edit_pairs import EditPairSource
from .images import ImageSource


def record_source(models: CacheModels, data_cfg: DataConfig, video: VideoConfig | None,
                  control_dirs: Sequence, options: DatasetOptions | None = None) -> RecordSource:
    """The one place that tells an edit dataset, a video dataset and an image dataset apart: an edit model (a variant with
    ``ControlImages``, ``takes_pairs``) takes pairs, ``video`` clips, anything else images. Settings the chosen source
    cannot honour are refused here, before any file is read."""
    family, variant = models.family, models.variant
    pairs = takes_pairs(models, data_cfg, control_dirs)
    if options is not None and options.mask_source == "alpha" and video:
        raise ConfigError("mask_source='alpha' reads an image's alpha channel; clips carry their masks in a mask clip "
                          "('<name>_mask.mp4' beside each clip: mask_source='beside', or masks/<name>.mp4: 'folder')")
    if options is not None and options.captions_vary and pairs:
        raise ConfigError(f"shuffle_tags and caption_dropout change captions, but {family.display_name} ({variant}) "
                          f"reads each pair's instruction with its control images; turn them off for edit models")
    if options is not None and options.preservation_prompt.strip() and pairs:
        raise ConfigError(f"preservation_prompt: {family.display_name} ({variant}) reads each prompt with its control "
                          f"images, so a class prompt alone has no meaning for it; clear preservation_prompt for edit "
                          f"models")
    if pairs:
        if video:
            raise ConfigError(f"{family.display_name} ({variant}) is an image edit model; it takes no video dataset")
        return EditPairSource(models, data_cfg, control_dirs, options)
    if control_dirs:
        raise ConfigError(f"control folders were given but {family.display_name} ({variant}) is not an edit model; "
                          f"clear control_folder, or load an edit model (Qwen-Image-Edit, Flux.1 Kontext, Flux.2)")
    return ClipSource(models, data_cfg, video, options) if video else ImageSource(models, data_cfg, options)


def takes_pairs(models: CacheModels, data_cfg: DataConfig, control_dirs: Sequence) -> bool:
    """Whether the dataset is read as edit pairs: the variant takes control images (``ControlImages``) and either needs
    them (Qwen-Image-Edit, Kontext) or, where they are optional (Flux.2), the dataset has them: control folders given,
    or ``control/`` (``controls/``) inside the dataset folder."""
    from pathlib import Path

    from ...data.pairs import CONTROL_FOLDER_NAMES

    control = models.family.control_images(models.variant)
    if control is None:
        return False
    if not control.optional or control_dirs:
        return True
    folder = Path(str(data_cfg.path).strip()).expanduser()
    return any((folder / name).is_dir() for name in CONTROL_FOLDER_NAMES)


__all__ = ["CaptionSource", "ClipSource", "EditPairSource", "ImageSource", "RecordSource", "record_source",
           "takes_pairs"]
