"""Find the clips of a video dataset folder, pair each with its caption and cut its training windows.

A video dataset folder holds, directly in it, clips (.mp4, .webm, .mov, .mkv, .m4v, animated .gif/.webp),
folders of frame images (one folder = one clip, its caption named after the folder: ``walk/`` + ``walk.txt``)
and images (one-frame clips), each with a same-stem caption. Only headers and timestamps are read here, so the
whole dataset is checked, windows included, before a model loads.

A clip that cannot be used (unreadable, no frames, shorter than the smallest frame count) is skipped with a
printed line naming it and why: one bad file in a hundred should not stop a night's training. A folder with
no usable clip at all is an error that lists every skip and the fix.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..config import DataConfig
from ..errors import DatasetError
from .dataset import MAX_LISTED, _caption_files, _dataset_folder, _missing_captions_message, build_caption, read_caption
from .clip_masks import is_mask_clip
from .frames import clip_windows
from .video import CLIP_EXTENSIONS, ClipError, ClipInfo, ClipTooShortError, clip_kind, probe_clip
from .video_config import VideoConfig


@dataclass(frozen=True)
class ClipRecord:
    """One training window of a clip: its source frame indices (presentation order) and the clip's
    displayed size, which picks the resolution bucket. ``window`` numbers the clip's windows from 0."""

    path: Path
    caption: str
    width: int
    height: int
    frames: tuple[int, ...]
    window: int = 0

    @property
    def frame_count(self) -> int:
        return len(self.frames)


def scan_video_dataset(cfg: DataConfig, video: VideoConfig, log: Callable[[str], None] | None = None,
                       skip: Callable[[Path], bool] | None = None) -> list[ClipRecord]:
    """Every usable window of every clip directly in ``cfg.path``, clips in name order, windows in time order.

    ``log`` (default: print) gets one line per skipped clip and per ignored entry, so nothing is dropped
    silently. Missing captions are an error (as for images): the fix is in the folder, not in one clip. Mask clips
    beside their clips (``<name>_mask``) are never training clips; ``skip``: other entries that are not clips (the
    ``masks/`` folder of masked loss).
    """
    say = log or print
    folder = _dataset_folder(cfg.path)
    files, clips = _entries(folder, say)
    clips = [c for c in clips if not is_mask_clip(c) and not (skip is not None and skip(c))]
    if not clips:
        accepted = ", ".join(ext.lstrip(".") for ext in CLIP_EXTENSIONS)
        raise DatasetError(f"no clips or images found in {folder}: put {accepted} files, or folders of frame "
                           f"images (one per clip), directly in it")
    captions = _pair(clips, _caption_files(files, cfg.caption_extension), cfg)
    records: list[ClipRecord] = []
    skipped: list[str] = []
    for clip in clips:
        try:
            records += _windows(probe_clip(clip, video.frames_folder_fps), captions[clip], video)
        except ClipError as exc:
            skipped.append(f"{clip.name} ({exc.reason})")
            say(f"dataset: skipped '{clip.name}': {exc.reason}; {exc.fix}")
    if not records:
        listed = "; ".join(skipped[:MAX_LISTED]) + (f"; ... and {len(skipped) - MAX_LISTED} more"
                                                    if len(skipped) > MAX_LISTED else "")
        raise DatasetError(
            f"no usable clip in {folder}: every one was skipped: {listed}. Replace the unreadable files, or for "
            f"clips that are too short lower frame_counts (smallest now {min(video.frame_counts)}) or fps "
            f"(now {video.fps:g}; 0 keeps every source frame)")
    return records


def _entries(folder: Path, say: Callable[[str], None]) -> tuple[list[Path], list[Path]]:
    """(plain files, clips) directly in ``folder``, by name; hidden entries skipped (macOS "._x.mp4")."""
    try:
        entries = sorted(folder.iterdir(), key=lambda p: p.name)
    except OSError as exc:
        raise DatasetError(f"cannot list dataset folder {folder}: {exc}") from exc
    files, clips = [], []
    for p in entries:
        if p.name.startswith("."):
            continue
        if p.is_file():
            files.append(p)
            if clip_kind(p) is not None:
                clips.append(p)
        elif p.is_dir():
            clips.append(p)  # a folder of frames; one with none is skipped by name when probed
        elif p.is_symlink():
            say(f"dataset: '{p.name}' is a broken link (to '{os.readlink(p)}') and is skipped")
    return files, clips


def _clip_stem(clip: Path) -> str:
    """The caption's stem: a file's stem, a frames folder's whole name ("walk.v2/" -> "walk.v2.txt")."""
    return clip.name if clip.is_dir() else clip.stem


def _pair(clips: list[Path], captions: dict[str, Path], cfg: DataConfig) -> dict[Path, str]:
    """Each clip's caption (trigger word included); an error listing the clips without one."""
    out, missing = {}, []
    for clip in clips:
        caption_file = captions.get(_clip_stem(clip))
        text = (read_caption(caption_file) if caption_file is not None else "") or cfg.default_caption
        if text is None:
            missing.append(clip.name)
        else:
            out[clip] = build_caption(text, cfg.trigger_word)
    if missing:
        raise DatasetError(_missing_captions_message(missing, cfg.caption_extension, noun="clip"))
    return out


def _windows(info: ClipInfo, caption: str, video: VideoConfig) -> list[ClipRecord]:
    """The clip's windows as records; a still image is one window of one frame, whatever frame_counts says."""
    if info.kind == "image":
        return [ClipRecord(info.path, caption, info.width, info.height, (0,))]
    available, count, windows = clip_windows(info.timestamps, info.end, video.fps, video.frame_counts,
                                             video.window, video.windows_per_clip, video.seed, info.path.name)
    if not windows:
        at = f"at {video.fps:g} fps" if video.fps else "(every source frame)"
        raise ClipTooShortError(
            info.path, f"it has {available} frames {at} ({info.end - info.timestamps[0]:.2f} s), fewer than the "
                       f"smallest frame count {min(video.frame_counts)}",
            "lower frame_counts or fps, or remove the clip")
    return [ClipRecord(info.path, caption, info.width, info.height, frames, i) for i, frames in enumerate(windows)]
