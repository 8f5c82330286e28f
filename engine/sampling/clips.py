"""Sample clips of a video family on disk: animated WebPs beside the grid, and the frame rate they play at."""
from __future__ import annotations

from pathlib import Path


def save_clip(frames: list, path, fps: float) -> None:
    """A clip's frames as an animated WebP (lossless: the frames come back pixel for pixel; ComfyUI's own
    SaveAnimatedWEBP defaults to lossless too), looping, ``fps`` frames per second."""
    frames[0].save(path, format="WEBP", save_all=True, append_images=frames[1:], lossless=True, quality=80,
                   method=4, duration=max(1, round(1000 / fps)), loop=0)


def load_clip(path) -> list:
    """The frames of an animated WebP written by ``save_clip``, as RGB PIL images."""
    from PIL import Image, ImageSequence

    with Image.open(path) as img:
        return [f.convert("RGB") for f in ImageSequence.Iterator(img)]


def clip_paths(grid: str | Path, prompts: int) -> list[Path]:
    """The animated WebPs of a checkpoint's clips, one per prompt, beside its grid: ``<grid stem>_pNN.webp``."""
    grid = Path(grid)
    return [grid.with_name(f"{grid.stem}_p{r:02d}.webp") for r in range(prompts)]


def saved_clips(grid: str | Path) -> list[Path]:
    """The clips saved beside a grid (``clip_paths``), in prompt order; none for an image family's grid."""
    grid = Path(grid)
    return sorted(grid.parent.glob(f"{grid.stem}_p[0-9][0-9].webp"))


def _dataset_fps(dataset) -> float:
    """The frame rate the dataset's clips were sampled at (its cache manifest's video settings), for playing the
    sample clips at the speed the model learned; 16 (Wan 2.1 / 2.2 A14B's) when the manifest does not say."""
    import json

    try:
        video = json.loads(Path(dataset.manifest_path).read_text()).get("video") or {}
        fps = float(video.get("fps") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        fps = 0.0
    return fps if fps > 0 else 16.0
