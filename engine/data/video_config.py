"""VideoConfig: how clips of a dataset folder become training windows (frame counts, fps, windows).

Each field carries its help text in ``metadata["help"]``; node tooltips come from :func:`help_text`.
The resolution buckets stay DataConfig's (``resolution``, ``bucket_step``, ``max_aspect``): a clip's frames
are bucketed exactly like images, and the frame count is a second bucket axis.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config import field_help
from ..errors import ConfigError
from .buckets import check_frame_counts

#: Where in a clip its training windows start.
WINDOWS = ("head", "uniform", "random")


@dataclass
class VideoConfig:
    frame_counts: tuple[int, ...] = field(default=(33,), metadata={"help": (
        "Frames per training window, each of the form 4k+1 (1, 5, 9, ..., 33, ..., 81): the video VAE keeps the "
        "first frame alone and packs every next 4 into one latent frame. Several counts are frame buckets: each "
        "clip trains at the longest count it fills (after resampling to fps). A clip shorter than the smallest "
        "count is skipped with a printed line naming it. More frames: more motion learned, more memory per step."
    )})
    fps: float = field(default=16.0, metadata={"help": (
        "Frame rate the clips are resampled to, by their timestamps, before windows are cut: the rate the model "
        "was trained at (Wan 2.1 and Wan 2.2 A14B: 16; Wan 2.2 TI2V-5B: 24), so motion speed matches what it "
        "knows. 0 keeps every source frame as it is."
    )})
    window: str = field(default="head", metadata={"help": (
        "Which frames of a clip train. head: one window from the first frame. uniform: windows_per_clip windows "
        "spread evenly from the start to the end. random: windows_per_clip windows at random starts, drawn once "
        "from seed and the clip's name (the same clips give the same windows on every run)."
    )})
    windows_per_clip: int = field(default=1, metadata={"help": (
        "How many windows uniform and random take from each clip (each is one training item, cached once). "
        "A clip too short for that many distinct windows gives as many as it has. head always takes one."
    )})
    seed: int = field(default=0, metadata={"help": "Seed of the random windows (with each clip's file name)."})
    image_to_video: bool = field(default=False, metadata={"help": (
        "Image-to-video, on a model whose one checkpoint does both (LTX-2.3 / 2.5): each clip is conditioned on its "
        "own first frame (given clean at timestep 0, left out of the loss) and previews start from a first frame "
        "of the dataset (sample prompt line i: clip window i). Off: text-to-video. Image-to-video checkpoints "
        "(Wan I2V) always condition on it; a model without an image-to-video mode refuses it."
    )})
    frames_folder_fps: float = field(default=16.0, metadata={"help": (
        "Frame rate of a clip given as a folder of frame images (they carry no timestamps): frame i is at "
        "i / frames_folder_fps seconds. Files in such a folder are read in name order."
    )})

    def __post_init__(self) -> None:
        self.frame_counts = check_frame_counts(tuple(self.frame_counts))
        for name in ("fps", "frames_folder_fps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name}={value!r} must be a finite number >= 0")
        if self.frames_folder_fps <= 0:
            raise ConfigError(f"frames_folder_fps={self.frames_folder_fps!r} must be > 0 (frames per second of "
                              f"a folder of frames)")
        if self.window not in WINDOWS:
            raise ConfigError(f"window={self.window!r} is not one of {', '.join(WINDOWS)}")
        if not isinstance(self.windows_per_clip, int) or isinstance(self.windows_per_clip, bool) \
                or self.windows_per_clip < 1:
            raise ConfigError(f"windows_per_clip={self.windows_per_clip!r} must be a whole number >= 1")
        if self.window == "head" and self.windows_per_clip != 1:
            raise ConfigError(f"window='head' takes one window per clip (windows_per_clip={self.windows_per_clip}); "
                              f"use window='uniform' or 'random' for several")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ConfigError(f"seed={self.seed!r} must be a whole number >= 0")


def help_text(name: str) -> str:
    """The help text of one VideoConfig field (node tooltips)."""
    return field_help(VideoConfig, name)
