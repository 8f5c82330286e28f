"""Read clips: probe a clip's frame timestamps and size cheaply, decode chosen frames to a (3, F, H, W) tensor.

A clip is a video file (.mp4, .webm, .mov, ...), an animated .gif/.webp, a folder of frame images, or a still
image (a one-frame clip). Decoders:

- Video containers through PyAV (``av`` on PyPI). Its wheels bundle FFmpeg's libraries, so no system ffmpeg
  is needed (ComfyUI portable on Windows has none) and every common codec (H.264, H.265, VP9, AV1, ProRes)
  decodes; it exposes each frame's presentation timestamp, which fps resampling needs, and the display
  rotation phones record. It is maintained by the FFmpeg-in-Python community with wheels for every platform.
  (decord has no wheels for recent Pythons or macOS arm64; imageio-ffmpeg and torchvision.io wrap the same
  libraries with less control, torchvision's video reader is deprecated.)
- Animated GIF and WebP through Pillow, already a dependency: FFmpeg (8.1, PyAV 18) cannot decode animated
  WebP at all, and Pillow composites GIF frames (disposal, transparency) and reports each frame's delay.
- Frame folders and still images through Pillow, as images are read elsewhere (images.py).

Every failure is a named :class:`ClipError` subclass that says which file and why; the dataset scan turns them
into printed skips.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from PIL import Image, ImageOps

from ..errors import DatasetError
from ..hashing import sha256_file, stable_hash
from .dataset import IMAGE_EXTENSIONS, read_image_size
from .images import _IMAGE_ERRORS, _cover_and_crop, _to_rgb, _to_tensor

#: Video containers decoded with PyAV.
CONTAINER_EXTENSIONS: tuple[str, ...] = (".mp4", ".webm", ".mov", ".mkv", ".m4v")
#: Decoded with Pillow: animated (a clip) or still (a one-frame clip).
ANIMATED_EXTENSIONS: tuple[str, ...] = (".gif", ".webp")
#: Every file suffix a video dataset accepts.
CLIP_EXTENSIONS: tuple[str, ...] = tuple(dict.fromkeys(CONTAINER_EXTENSIONS + ANIMATED_EXTENSIONS + IMAGE_EXTENSIONS))

# Browsers show a GIF frame with a delay of 0 or 1 centisecond for 100 ms; such files are made to be seen that way.
_MIN_DELAY_MS = 20
_DEFAULT_DELAY_MS = 100


class ClipError(DatasetError):
    """One clip cannot be used; ``path`` names it and ``reason`` says why (the dataset scan prints both)."""

    def __init__(self, path: Path, reason: str, fix: str) -> None:
        self.path, self.reason, self.fix = Path(path), reason, fix
        super().__init__(f"clip '{self.path.name}' in {self.path.parent}: {reason}; {fix}")


class UnreadableClipError(ClipError):
    """The file is not a video the decoders read: corrupt, truncated, or no video stream."""


class EmptyClipError(ClipError):
    """The clip has no frames."""


class ClipTooShortError(ClipError):
    """The clip has fewer frames (after fps resampling) than the smallest frame count asked for."""


@dataclass(frozen=True)
class ClipInfo:
    """What a clip is, without its pixels: its frames' timestamps (seconds, ascending), when the last one
    stops showing, and the displayed size (rotation applied)."""

    path: Path
    kind: str  # "container" | "animated" | "frames" | "image"
    width: int
    height: int
    timestamps: tuple[float, ...]
    end: float

    @property
    def frame_count(self) -> int:
        return len(self.timestamps)


def clip_kind(path: Path) -> str | None:
    """How ``path`` is read, or None when it is no clip (a caption, a stray file)."""
    if path.is_dir():
        return "frames"
    suffix = path.suffix.lower()
    if suffix in CONTAINER_EXTENSIONS:
        return "container"
    if suffix in ANIMATED_EXTENSIONS:
        return "animated"  # a still .gif/.webp is found to have one frame, and reads as an image
    if suffix in IMAGE_EXTENSIONS:
        return "image"
    return None


def frame_files(folder: Path) -> list[Path]:
    """The frame images of a frames folder, in name order (hidden files left out, as in a dataset folder)."""
    return sorted((p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")
                   and p.suffix.lower() in IMAGE_EXTENSIONS), key=lambda p: p.name)


def probe_clip(path: Path, frames_folder_fps: float = 16.0) -> ClipInfo:
    """Read a clip's timestamps and size; decodes at most one frame (to find unreadable files early)."""
    path = Path(path)
    kind = clip_kind(path)
    if kind == "frames":
        return _probe_frames(path, frames_folder_fps)
    if kind == "container":
        return _probe_container(path)
    if kind == "animated":
        return _probe_animated(path)
    if kind == "image":
        width, height = _image_size(path)
        return ClipInfo(path, "image", width, height, (0.0,), 0.0)
    raise UnreadableClipError(path, f"'{path.suffix}' is not a clip or image suffix",
                              f"use one of {', '.join(CLIP_EXTENSIONS)} or a folder of frames")


def load_clip_tensor(path: Path, frames: Sequence[int], bucket: tuple[int, int], flip: bool = False) -> torch.Tensor:
    """The clip's source frames ``frames`` (indices in presentation order; repeats allowed) as a float32
    (3, F, H, W) tensor in [-1, 1], each frame scaled to cover ``bucket`` (width, height) and center-cropped
    like an image (images.py), mirrored left-right when ``flip``. The layout diffusers' video VAEs take once a
    batch axis is added."""
    path = Path(path)
    width, height = (int(v) for v in bucket)
    if width <= 0 or height <= 0:
        raise ValueError(f"bucket {bucket} must be two positive sizes (width, height)")
    if not frames:
        raise ValueError("frames is empty: a window has at least one frame")
    positions: dict[int, list[int]] = {}  # source frame -> where it goes in the window (repeats: several)
    for at, index in enumerate(frames):
        positions.setdefault(int(index), []).append(at)
    # Filled in place: an 81-frame 480x832 window is 390 MB in float32, so no second copy from a stack.
    out = torch.empty(3, len(frames), height, width)  # (3, F, H, W)
    done = set()
    for index, img in _decode(path, sorted(positions)):
        img = _cover_and_crop(_to_rgb(img), width, height)
        if flip:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        out[:, positions[index]] = _to_tensor(img)[:, None]
        done.add(index)
    missing = [i for i in sorted(positions) if i not in done]
    if missing:
        raise UnreadableClipError(path, f"frames {missing[:5]} could not be decoded (the file ends early or is "
                                        f"damaged after frame {max(done, default=-1)})",
                                  "re-export the clip or remove it from the folder, then cache again")
    return out


def clip_content_hash(path: Path) -> str:
    """A content key for the cache: the file's sha256, or for a frames folder the names and hashes of its
    frames in order (renaming or replacing one frame rebuilds the clip's latents)."""
    path = Path(path)
    if path.is_dir():
        return stable_hash([[p.name, sha256_file(p)] for p in frame_files(path)], length=64)
    return sha256_file(path)


# --- probing -----------------------------------------------------------------------------------------


def _image_size(path: Path) -> tuple[int, int]:
    try:
        return read_image_size(path)
    except DatasetError as exc:
        raise UnreadableClipError(path, f"the image cannot be read ({exc.__cause__ or exc})",
                                  "re-export it or remove it from the folder") from exc


def _probe_frames(folder: Path, fps: float) -> ClipInfo:
    files = frame_files(folder)
    if not files:
        raise EmptyClipError(folder, "the folder holds no frame images",
                             f"put its frames in it as {', '.join(IMAGE_EXTENSIONS)} files, or remove the folder")
    sizes = {}
    for p in files:
        try:
            sizes[p.name] = _image_size(p)
        except ClipError as exc:  # name the folder (the clip) and the frame
            raise UnreadableClipError(folder, f"frame {p.name}: {exc.reason}", exc.fix) from exc
    first = sizes[files[0].name]
    odd = [name for name, size in sizes.items() if size != first]
    if odd:
        raise UnreadableClipError(folder, f"frames differ in size: {files[0].name} is {first[0]}x{first[1]}, "
                                          f"{odd[0]} is {sizes[odd[0]][0]}x{sizes[odd[0]][1]}",
                                  "export every frame of a clip at one size")
    timestamps = tuple(i / fps for i in range(len(files)))
    return ClipInfo(folder, "frames", first[0], first[1], timestamps, len(files) / fps)


def _import_av():
    try:
        import av
    except ImportError as exc:
        raise DatasetError("reading video files needs PyAV, which is not installed: run `pip install av` in the "
                           "Python that runs ComfyUI (its wheels bring their own FFmpeg)") from exc
    return av


def _probe_container(path: Path) -> ClipInfo:
    """Timestamps from the demuxed packets (no decoding), plus one decoded frame for the size and rotation."""
    av = _import_av()

    if path.stat().st_size == 0:
        raise EmptyClipError(path, "the file is empty (0 bytes)", "copy it again or remove it from the folder")
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                # A recording stopped before its first frame is written like this (MP4 and MOV drop the track).
                raise EmptyClipError(path, "the file has no video frames (no video stream: stopped before the "
                                           "first frame, or audio only)", "remove it from the folder")
            stream = container.streams.video[0]
            base = stream.time_base
            pts, durations = [], []
            for packet in container.demux(stream):
                if packet.pts is not None and packet.size:  # the flush packet at the end has neither
                    pts.append(packet.pts)
                    durations.append(packet.duration or 0)
            if not pts:
                raise EmptyClipError(path, "the video stream has no frames", "remove it from the folder")
            container.seek(0, stream=stream)  # back to the start after demuxing to the end
            first = next(container.decode(stream), None)
    except ClipError:
        raise
    except av.FFmpegError as exc:
        raise UnreadableClipError(path, f"the video cannot be read ({exc})",
                                  "the file is corrupt, truncated or not a video; re-export it or remove it") from exc
    if first is None:
        raise EmptyClipError(path, "no frame of the video decodes", "re-export it or remove it from the folder")
    order = sorted(range(len(pts)), key=lambda i: pts[i])  # decode order -> presentation order
    times = tuple(float(pts[i] * base) for i in order)
    last = durations[order[-1]]
    step = float(last * base) if last > 0 else (statistics.median(b - a for a, b in zip(times, times[1:]))
                                                if len(times) > 1 else 0.0)
    width, height = first.width, first.height
    if _rotation(first) % 180:
        width, height = height, width
    return ClipInfo(path, "container", width, height, times, times[-1] + step)


def _rotation(frame) -> int:
    """The frame's display rotation in degrees counter-clockwise (phones record portrait clips as landscape
    frames plus this), a multiple of 90."""
    return int(round(getattr(frame, "rotation", 0) or 0)) % 360


def _probe_animated(path: Path) -> ClipInfo:
    try:
        with Image.open(path) as img:
            width, height = img.size
            count = getattr(img, "n_frames", 1)
            delays = []
            for i in range(count):
                img.seek(i)
                img.load()  # Pillow's WebP reader sets the frame's duration on load
                delays.append(_delay_ms(img.info.get("duration")))
    except _IMAGE_ERRORS as exc:
        raise UnreadableClipError(path, f"the animation cannot be read ({exc})",
                                  "the file is corrupt or truncated; re-export it or remove it") from exc
    if count < 1 or width <= 0 or height <= 0:
        raise EmptyClipError(path, "the animation has no frames", "remove it from the folder")
    if count == 1:
        width, height = _image_size(path)  # a still: read as an image (EXIF rotation included)
        return ClipInfo(path, "image", width, height, (0.0,), 0.0)
    times, t = [], 0.0
    for delay in delays:
        times.append(t)
        t += delay / 1000.0
    return ClipInfo(path, "animated", width, height, tuple(times), t)


def _delay_ms(value) -> float:
    """A GIF/WebP frame delay in ms; 0, 1 or missing show as 100 ms in browsers, so that is what they mean."""
    try:
        delay = float(value)
    except (TypeError, ValueError):
        return _DEFAULT_DELAY_MS
    return delay if delay >= _MIN_DELAY_MS else _DEFAULT_DELAY_MS


# --- decoding ----------------------------------------------------------------------------------------


def _decode(path: Path, wanted: list[int]) -> Iterator[tuple[int, Image.Image]]:
    """(index, PIL image) for each wanted index (sorted, distinct), in order; stops after the last."""
    kind = clip_kind(path)
    try:
        if kind == "frames":
            files = frame_files(path)
            for i in wanted:
                if i < len(files):
                    with Image.open(files[i]) as img:
                        yield i, ImageOps.exif_transpose(img).copy()
        elif kind == "container":
            yield from _decode_container(path, wanted)
        elif kind in ("animated", "image"):
            with Image.open(path) as img:
                if getattr(img, "n_frames", 1) == 1:
                    img = ImageOps.exif_transpose(img)
                for i in wanted:
                    if i < getattr(img, "n_frames", 1):
                        img.seek(i)
                        yield i, img.copy()
        else:
            raise UnreadableClipError(path, f"'{path.suffix}' is not a clip suffix", "remove it from the folder")
    except ClipError:
        raise
    except _IMAGE_ERRORS as exc:
        raise UnreadableClipError(path, f"a frame cannot be decoded ({exc})",
                                  "re-export the clip or remove it from the folder") from exc


def _decode_container(path: Path, wanted: list[int]) -> Iterator[tuple[int, Image.Image]]:
    """Decode the wanted frames. A frame's index is its rank in presentation order, found from its pts (the
    order the probe listed), so a decoder that drops a broken frame does not shift the later ones, and a window
    deep in a long clip can start at the keyframe before it instead of decoding the clip from its start."""
    av = _import_av()

    want, last = set(wanted), wanted[-1]
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            pts = sorted(p.pts for p in container.demux(stream) if p.pts is not None and p.size)
            rank = {p: i for i, p in enumerate(pts)}
            first = pts[wanted[0]] if wanted[0] < len(pts) else 0
            # backward: the keyframe at or before the first wanted frame; decoding from it rebuilds that frame.
            container.seek(first, stream=stream, backward=True, any_frame=False)
            for frame in container.decode(stream):
                if frame.pts is None or frame.pts not in rank:
                    raise UnreadableClipError(path, "a decoded frame has no timestamp the file lists",
                                              "re-export (remux) the clip, e.g. to .mp4, or remove it")
                index = rank[frame.pts]
                if index in want:
                    img = frame.to_image()  # RGB24, the colour conversion FFmpeg's swscale does
                    if _rotation(frame):
                        # Display matrix: rotate counter-clockwise by ``rotation`` (PyAV's and PIL's convention).
                        img = img.rotate(_rotation(frame), expand=True)
                    yield index, img
                if index >= last:
                    break
    except av.FFmpegError as exc:
        raise UnreadableClipError(path, f"the video cannot be decoded ({exc})",
                                  "the file is corrupt or truncated; re-export it or remove it") from exc
