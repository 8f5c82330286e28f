"""Loss masks of training clips (Wan and the other video families): one mask per frame, decoded like its clip.

A clip's mask is a mask clip found by name, as musubi-tuner's weighted-mask fork pairs a video with its mask by base
name, but per frame where that fork takes one still image per video: ``<name>_mask.<ext>`` beside the clip (a video,
an animated image, or a folder ``<name>_mask/`` of frame images; ``beside``), or ``masks/<name>.<ext>`` /
``masks/<name>/`` in the dataset folder (``folder``). A mask clip has exactly as many frames as its clip, frame i
masking frame i (a window's frames are the clip's source frames, so the mask's are the same indices); a still image
masks every frame alike. White trains, black not, grey is a weight (luminance, as an image's mask; ``masks.py``).

Each mask frame is cropped and flipped as the clip's frames are, kept at the bucket's pixel size in the cache
(``(F, H, W)`` uint8; a still ``(1, H, W)``), and brought to the latent grid at training time (``latent_clip_mask``):
area over each latent cell in space, and in time the video VAE's causal grouping: latent frame 0 encodes pixel frame
0 alone and latent frame j >= 1 pixel frames (j - 1) r + 1 .. j r (r: the VAE's temporal compression, 4 for Wan), so
each latent cell weighs the mean of the mask over the pixels and frames it encodes.
"""
from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from ..errors import DatasetError
from .dataset import MASK_SUFFIX
from .images import _cover_and_crop
from .masks import _luminance
from .video import CLIP_EXTENSIONS, ClipError, _decode, clip_kind, probe_clip

_SUFFIXES = CLIP_EXTENSIONS  # containers, animated images, still images


def _clip_name(clip: Path) -> str:
    return clip.name if clip.is_dir() else clip.stem


def clip_mask_file(clip: Path, source: str) -> Path | None:
    """The mask of ``clip`` for ``source`` ('beside' or 'folder'): a mask clip, a frames folder or a still image;
    None when there is none."""
    folder, stem = ((clip.parent, _clip_name(clip) + MASK_SUFFIX) if source == "beside"
                    else (clip.parent / "masks", _clip_name(clip)))
    if (folder / stem).is_dir():
        return folder / stem
    for ext in _SUFFIXES:
        for candidate in (folder / f"{stem}{ext}", folder / f"{stem}{ext.upper()}"):
            if candidate.is_file():
                return candidate
    return None


def is_mask_clip(path: Path) -> bool:
    """A ``<name>_mask`` clip, folder or image beside a clip ``<name>``: a mask, never a training clip itself (whether
    or not masked loss is on; the video scan leaves it out)."""
    name = path.name if path.is_dir() else path.stem
    if not name.endswith(MASK_SUFFIX) or (not path.is_dir() and clip_kind(path) is None):
        return False
    base = name[: -len(MASK_SUFFIX)]
    return (path.parent / base).is_dir() or any((path.parent / f"{base}{ext}").is_file()
                                                or (path.parent / f"{base}{ext.upper()}").is_file()
                                                for ext in _SUFFIXES)


def clip_mask_problem(clip: Path, size: tuple[int, int], frame_count: int, source: str,
                      frames_folder_fps: float = 16.0) -> str | None:
    """Why ``clip`` (displayed ``size``, ``frame_count`` source frames) has no usable mask, or None. Reads headers
    only (and one frame of the mask, as the clip probe does)."""
    path = clip_mask_file(clip, source)
    if path is None:
        where = (f"'{_clip_name(clip)}{MASK_SUFFIX}.mp4' (or a folder '{_clip_name(clip)}{MASK_SUFFIX}/' of frames, or "
                 f"a still '{_clip_name(clip)}{MASK_SUFFIX}.png') beside it" if source == "beside"
                 else f"'masks/{_clip_name(clip)}.mp4' (or a frames folder or a still image) in the dataset folder")
        return f"{clip.name}: no mask ({where})"
    try:
        info = probe_clip(path, frames_folder_fps)
    except ClipError as exc:
        return f"{clip.name}: its mask {path.name} cannot be read ({exc.reason})"
    if (info.width, info.height) != tuple(size):
        return (f"{clip.name}: its mask {path.name} is {info.width}x{info.height}, the clip {size[0]}x{size[1]}; a "
                f"mask must have its clip's size")
    if info.kind != "image" and info.frame_count != frame_count:
        return (f"{clip.name}: its mask {path.name} has {info.frame_count} frames, the clip {frame_count}; a mask "
                f"clip needs one frame per frame of its clip (or give one still image for every frame)")
    return None


def load_clip_mask(clip: Path, source: str, frames, bucket: tuple[int, int], flip: bool = False) -> torch.Tensor:
    """The mask of ``clip``'s window ``frames`` at the bucket's pixel size: (F, H, W) uint8, or (1, H, W) for a
    still mask (the same on every frame), cropped and flipped as ``load_clip_tensor`` crops and flips the frames."""
    width, height = (int(v) for v in bucket)
    path = clip_mask_file(Path(clip), source)
    if path is None:
        raise DatasetError(f"the mask of {clip} is gone since the dataset was scanned; run the cache again")
    still = probe_clip(path).kind == "image"  # a still file (a one-frame .gif too)
    wanted = [0] if still else sorted({int(i) for i in frames})
    decoded = {}
    for index, img in _decode(path, wanted):
        gray = _cover_and_crop(_luminance(img), width, height)
        if flip:
            gray = gray.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        decoded[index] = torch.frombuffer(bytearray(gray.tobytes()), dtype=torch.uint8).view(height, width).clone()
    missing = [i for i in wanted if i not in decoded]
    if missing:
        raise DatasetError(f"the mask {path} of {Path(clip).name} lacks frames {missing[:5]}; it must have one frame "
                           f"per frame of its clip. Re-export it, then cache again")
    return decoded[0][None] if still else torch.stack([decoded[int(i)] for i in frames])


def latent_clip_mask(mask: torch.Tensor, latent_grid: tuple[int, int, int]) -> torch.Tensor:
    """(B, F, H, W) pixel masks (uint8, F = 1 for a still) -> (B, F_lat, h, w) weights in [0, 1] on the latent grid:
    area in space, the causal grouping in time (the module's rule). A mask whose frame count is not 1 + (F_lat - 1) r
    for a whole r is a named error."""
    f_lat, h, w = (int(v) for v in latent_grid)
    b, f = mask.shape[:2]
    m = torch.nn.functional.interpolate(mask.float().div(255.0).flatten(0, 1)[:, None], size=(h, w), mode="area")
    m = m.view(b, f, h, w)
    if f == 1:  # a still mask: the same weight on every latent frame
        return m.expand(b, f_lat, h, w)
    if f_lat == 1 or (f - 1) % (f_lat - 1):
        raise DatasetError(f"a clip mask of {f} frames does not fit {f_lat} latent frames (a window of 1 + "
                           f"{f_lat - 1} x r frames); rebuild the dataset cache")
    r = (f - 1) // (f_lat - 1)
    return torch.cat([m[:, :1], m[:, 1:].reshape(b, f_lat - 1, r, h, w).mean(2)], dim=1)  # (B, F_lat, h, w)
