"""Decode one image into the tensor the VAE encoder expects.

The VAE takes RGB in [-1, 1] at exactly the bucket size. Getting there without
distortion means: respect the camera's EXIF rotation, flatten transparency onto
white (what viewers show), scale so the image covers the bucket, and crop the
overflow evenly from both sides.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import torch
from PIL import Image, ImageOps

from ..errors import DatasetError

_IMAGE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)

# Lets a large downscale first use PIL's fast integer reduce(), then LANCZOS for the
# rest; quality stays indistinguishable and big photos load several times faster.
_REDUCING_GAP = 3.0

Box = tuple[float, float, float, float]


def load_image_tensor(
    path: Union[str, os.PathLike[str]], bucket: tuple[int, int], flip: bool = False
) -> torch.Tensor:
    """Return the image at ``path`` as a float32 (3, height, width) tensor in [-1, 1].

    ``bucket`` is (width, height). The image is scaled to cover it (aspect kept) and
    center-cropped, so nothing is stretched; ``flip`` mirrors it left-right (the
    augmentation DataConfig.flip asks for).
    """
    width, height = _check_bucket(bucket)
    path = Path(path)
    try:
        with Image.open(path) as opened:
            img = _to_rgb(ImageOps.exif_transpose(opened))
            img = _cover_and_crop(img, width, height)
    except _IMAGE_ERRORS as exc:
        raise DatasetError(
            f"cannot decode image {path.name} in {path.parent}: {exc}. "
            "The file is corrupt or truncated; re-export it or remove it from the folder"
        ) from exc
    if flip:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return _to_tensor(img)


def _check_bucket(bucket: tuple[int, int]) -> tuple[int, int]:
    """Validate (width, height) early: a bad bucket is a programming error, not a bad file."""
    width, height = (int(v) for v in bucket)
    if width <= 0 or height <= 0:
        raise ValueError(f"bucket {bucket} must be two positive sizes (width, height)")
    return width, height


def _to_rgb(img: Image.Image) -> Image.Image:
    """Convert any PIL mode to 8-bit RGB, compositing transparency over white.

    A plain ``convert("RGB")`` would drop alpha and expose whatever colour hides
    under transparent pixels (often black), which the LoRA would then learn.
    """
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        # 16-bit/float greyscale: convert("L") clips instead of scaling down to 8 bits.
        img = img.convert("I")
        peak = img.getextrema()[1] or 1
        scale = 255.0 / 65535.0 if peak > 255 else 1.0
        img = img.point(lambda v: v * scale).convert("L")
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def _center_crop_box(src_width: int, src_height: int, width: int, height: int) -> Box:
    """The centred source region with the bucket's aspect ratio, as large as fits."""
    if src_width * height > width * src_height:  # source is wider than the bucket
        crop_width = src_height * width / height
        left = (src_width - crop_width) / 2
        return (left, 0.0, left + crop_width, float(src_height))
    crop_height = src_width * height / width
    top = (src_height - crop_height) / 2
    return (0.0, top, float(src_width), top + crop_height)


def _cover_and_crop(img: Image.Image, width: int, height: int) -> Image.Image:
    """Scale to cover (width, height) and center-crop, in one resampling pass.

    Resizing only the cropped source box is equivalent to resize-then-crop, but
    avoids rounding the intermediate size and resampling pixels that get thrown away.
    """
    box = _center_crop_box(img.width, img.height, width, height)
    shrinking = (box[2] - box[0]) > width
    return img.resize(
        (width, height),
        Image.Resampling.LANCZOS if shrinking else Image.Resampling.BICUBIC,
        box=box,
        reducing_gap=_REDUCING_GAP if shrinking else None,
    )


def _to_tensor(img: Image.Image) -> torch.Tensor:
    """8-bit RGB PIL image -> float32 (3, H, W) in [-1, 1]."""
    data = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
    pixels = data.view(img.height, img.width, 3).permute(2, 0, 1)
    return pixels.to(torch.float32).div_(127.5).sub_(1.0).contiguous()
