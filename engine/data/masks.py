"""Loss masks of training images: where each comes from, checked before any model loads, decoded like its image.

A mask says how much each pixel's loss counts: white (255) fully, black (0) not at all, grey in between. It comes
from ``<name>_mask.<ext>`` beside the image (``beside``), ``masks/<name>.<ext>`` in the dataset folder
(``folder``), or the image's alpha channel (``alpha``). It is cropped exactly as its image (EXIF rotation, cover the
bucket, centre crop, the same flip), kept at the bucket's pixel size in the cache, and brought to the latent grid at
training time by an area resize: each latent cell's weight is the mean of the mask over the pixels it covers (the
rule of sd-scripts' ``apply_masked_loss``, ``F.interpolate(mode="area")``).
"""
from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image, ImageOps

from ..errors import DatasetError
from .dataset import IMAGE_EXTENSIONS, MASK_SUFFIX, is_mask_file, read_image_size  # noqa: F401 (re-exported)
from .images import _check_bucket, _cover_and_crop

_IMAGE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)


def mask_file(image: Path, source: str) -> Path | None:
    """The mask file of ``image`` for ``source`` ('beside' or 'folder'; any image extension), or None when there is
    none; 'alpha' masks live in the image itself."""
    if source == "alpha":
        return image
    folder, stem = (image.parent, image.stem + MASK_SUFFIX) if source == "beside" else (image.parent / "masks", image.stem)
    for ext in IMAGE_EXTENSIONS:
        for candidate in (folder / f"{stem}{ext}", folder / f"{stem}{ext.upper()}"):
            if candidate.is_file():
                return candidate
    return None


def mask_problem(image: Path, size: tuple[int, int], source: str) -> str | None:
    """Why ``image`` (displayed size ``size``) has no usable mask for ``source``, or None when it has one. Reads
    headers only."""
    path = mask_file(image, source)
    if path is None:
        where = (f"'{image.stem}{MASK_SUFFIX}.png' beside it" if source == "beside"
                 else f"'masks/{image.stem}.png' in the dataset folder")
        return f"{image.name}: no mask ({where})"
    if source == "alpha":
        with Image.open(path) as img:
            if not _has_alpha(img):
                return f"{image.name}: no alpha channel (mode {img.mode}) to take the mask from"
        return None
    mask_size = read_image_size(path)
    if mask_size != tuple(size):
        return (f"{image.name}: its mask {path.name} is {mask_size[0]}x{mask_size[1]}, the image "
                f"{size[0]}x{size[1]}; a mask must have its image's size")
    return None


def load_mask(image: Path, source: str, bucket: tuple[int, int], flip: bool = False) -> torch.Tensor:
    """The mask of ``image`` at the bucket's pixel size, (height, width) uint8, cropped and flipped as
    ``load_image_tensor`` crops and flips the image."""
    width, height = _check_bucket(bucket)
    path = mask_file(image, source)
    if path is None:
        raise DatasetError(f"the mask of {image} is gone since the dataset was scanned; run the cache again")
    try:
        with Image.open(path) as opened:
            img = ImageOps.exif_transpose(opened)
            gray = _alpha(img) if source == "alpha" else _luminance(img)
            gray = _cover_and_crop(gray, width, height)
    except _IMAGE_ERRORS as exc:
        raise DatasetError(f"cannot decode the mask {path}: {exc}; re-export it or remove it") from exc
    if flip:
        gray = gray.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    data = torch.frombuffer(bytearray(gray.tobytes()), dtype=torch.uint8)
    return data.view(gray.height, gray.width).clone()


def latent_mask(mask: torch.Tensor, latent_hw: tuple[int, int]) -> torch.Tensor:
    """A pixel mask (H, W) uint8 or (B, H, W) -> weights in [0, 1] on the latent grid (h, w) / (B, h, w): the
    mean of the mask over each latent cell (area resize)."""
    m = mask.float().div(255.0)
    batched = m.dim() == 3
    m = m if batched else m[None]
    out = torch.nn.functional.interpolate(m[:, None], size=tuple(latent_hw), mode="area")[:, 0]
    return out if batched else out[0]


def _has_alpha(img: Image.Image) -> bool:
    return img.mode in ("RGBA", "LA", "PA", "La", "RGBa") or (img.mode == "P" and "transparency" in img.info)


def _alpha(img: Image.Image) -> Image.Image:
    if not _has_alpha(img):
        raise DatasetError(f"the image (mode {img.mode}) has no alpha channel to take the mask from")
    return img.convert("RGBA").getchannel("A")


def _luminance(img: Image.Image) -> Image.Image:
    """A mask file as 8-bit grey: an RGB(A) mask by its luminance (transparency ignored: the colour is the mask)."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        img = img.convert("I")
        scale = 255.0 / 65535.0 if (img.getextrema()[1] or 0) > 255 else 1.0
        return img.point(lambda v: v * scale).convert("L")
    if img.mode in ("RGBA", "LA", "PA"):
        img = img.convert("RGB")
    return img.convert("L")
