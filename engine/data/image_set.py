"""Images and captions handed over in memory (ComfyUI's dataset nodes: Load Image-Text (from Folder), and the nodes
that resize, crop or shuffle their lists), made into a dataset folder that a cache build reads like any other.

Why a folder: every phase of a cache build (the scan, buckets, latents, the validation split, multi-resolution)
reads a dataset folder and keys an image by its file's bytes. Writing the images once, as lossless PNG files under
the cache, lets all of them run unchanged, so images from ComfyUI are cached exactly as the same images in a folder
are: the same crop and resampling, the same caption (text) keys. The folder is named by a hash of the pixels and
captions (``ImageCaptionSet.key``): the same images and captions find the same folder, and with it their cache
entries, again; any changed pixel or caption makes a new folder.

Pixels: ComfyUI's IMAGE is float (B, H, W, C) in [0, 1]; it is stored as 8-bit, round(x * 255). That is exact for
images ComfyUI read from 8-bit files (its loaders give v / 255), and within half a level for images its nodes
resampled. Nothing here imports ComfyUI: the tensors are its convention only.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ..errors import DatasetError
from ..fileio import explain_os_error

#: What ComfyUI's dataset node puts out and how to connect it, for the messages.
_HOW = ("connect the 'images' and 'texts' outputs of ComfyUI's Load Image-Text (from Folder) (or of the nodes "
        "after it) to Images to Dataset")


@dataclass(frozen=True)
class ImageCaptionSet:
    """The images (each (H, W, 3) uint8) and their captions ("" where none), in the order given; ``key`` is a hash of
    both, the name of the folder they are written to."""

    images: tuple[torch.Tensor, ...]
    captions: tuple[str, ...]
    key: str

    def __len__(self) -> int:
        return len(self.images)


def image_caption_set(images: Sequence[torch.Tensor] | torch.Tensor,
                      texts: Sequence[str] | str | None = None) -> ImageCaptionSet:
    """``images``: ComfyUI IMAGE tensors, each (H, W, C) or a batch (B, H, W, C), C 3 (RGB) or 4 (RGBA: composited over
    white, as a folder's transparent images are), floats in [0, 1] (values outside are clipped, as ComfyUI's Save
    Image does). ``texts``: one caption per image, or one for all, or none. Bad input is a DatasetError naming it."""
    frames = _frames(images)
    captions = _captions(texts, len(frames))
    h = hashlib.sha256()
    for frame, caption in zip(frames, captions):
        h.update(repr((tuple(frame.shape), len(caption.encode()))).encode())
        h.update(frame.numpy().tobytes())
        h.update(caption.encode())
    return ImageCaptionSet(tuple(frames), tuple(captions), h.hexdigest()[:24])


def _frames(images) -> list[torch.Tensor]:
    if isinstance(images, torch.Tensor):
        images = [images]
    if images is None or len(images) == 0:
        raise DatasetError(f"images: no images were given; {_HOW}")
    frames = []
    for i, tensor in enumerate(images):
        if not isinstance(tensor, torch.Tensor) or tensor.ndim not in (3, 4) or tensor.shape[-1] not in (3, 4):
            what = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise DatasetError(f"images: item {i + 1} is {what}, not a ComfyUI IMAGE (height, width, 3 channels, or a "
                               f"batch of them); {_HOW}")
        batch = tensor if tensor.ndim == 4 else tensor[None]
        if batch.shape[1] < 1 or batch.shape[2] < 1:
            raise DatasetError(f"images: item {i + 1} is empty ({tuple(tensor.shape)}); remove it from the list")
        batch = batch.detach().float().cpu()
        if not torch.isfinite(batch).all():
            raise DatasetError(f"images: item {i + 1} holds NaN or infinite pixel values; check the nodes that made "
                               f"it (a normalisation dividing by zero?)")
        batch = batch.clamp(0, 1)
        if batch.shape[-1] == 4:  # over white, as engine/data/images.py flattens a transparent file
            rgb, alpha = batch[..., :3], batch[..., 3:]
            batch = rgb * alpha + (1 - alpha)
        frames.extend((batch * 255).round().to(torch.uint8).contiguous())
    return frames


def _captions(texts, count: int) -> list[str]:
    if texts is None:
        return [""] * count
    if isinstance(texts, str):
        texts = [texts]
    texts = list(texts)
    bad = [i + 1 for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        raise DatasetError(f"texts: item {bad[0]} is not text; {_HOW}")
    if len(texts) == 1:
        return texts * count
    if len(texts) != count:
        raise DatasetError(f"images and texts differ in number: {count} images but {len(texts)} captions; {_HOW}, "
                           f"from the same dataset, so each image has its caption")
    return texts


def write_image_set(image_set: ImageCaptionSet, root: str | Path, default_caption: str | None = None) -> Path:
    """The folder ``root/<key>`` holding the set as ``000000.png`` + ``000000.txt`` ... (file-name order is the
    set's order), written once: an existing folder of that key is complete (it is built under a temporary name and
    renamed) and reused. Images without a caption get no .txt (the dataset scan then uses ``default_caption``);
    without a default they are an error naming them by position."""
    from PIL import Image

    missing = [i + 1 for i, c in enumerate(image_set.captions) if not c.strip()]
    if missing and not (default_caption or "").strip():
        listed = ", ".join(map(str, missing[:20])) + (f" ... and {len(missing) - 20} more" if len(missing) > 20 else "")
        raise DatasetError(f"images {listed} (of {len(image_set)}, counted from 1) have no caption: connect the "
                           f"'texts' output of Load Image-Text (from Folder) (a .txt beside each image in its "
                           f"folder), or set default_caption on Cache Text Embeds")
    root = Path(root)
    folder = root / image_set.key
    if folder.is_dir():
        return folder
    tmp = root / f".{image_set.key}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        for i, (pixels, caption) in enumerate(zip(image_set.images, image_set.captions)):
            Image.fromarray(pixels.numpy(), "RGB").save(tmp / f"{i:06d}.png", format="PNG")
            if caption.strip():
                (tmp / f"{i:06d}.txt").write_text(caption, encoding="utf-8")
        try:
            tmp.rename(folder)
        except OSError:
            if not folder.is_dir():  # not another process that wrote the same set first
                raise
    except OSError as exc:
        raise explain_os_error(exc, "the images of the 'images' input as a dataset folder", tmp) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
