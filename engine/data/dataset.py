"""Find the images of a dataset folder and pair each with its caption.

Everything here only reads file headers and small text files, so a bad dataset
is reported in seconds, before any model is loaded or any latent is cached.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
import os
from pathlib import Path
from typing import Callable
from typing import Optional

from PIL import Image

from ..config import DataConfig
from ..errors import ConfigError, DatasetError

#: Lower-case suffixes recognised as images.
IMAGE_EXTENSIONS: tuple[str, ...] = (".png", ".jpg", ".jpeg", ".webp")
#: How many offending file names an error message lists before summarising the rest.
MAX_LISTED = 20

_EXIF_ORIENTATION = 0x0112
# EXIF orientations 5-8 rotate by 90 degrees, so the displayed image has width and height swapped.
_ROTATED_ORIENTATIONS = (5, 6, 7, 8)

# What PIL raises for unreadable, truncated, or absurdly large files.
_IMAGE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)


@dataclass(frozen=True)
class ImageRecord:
    """One training image: where it is, what it shows, and its size as displayed.

    ``width``/``height`` are the full-resolution size after EXIF orientation, so that
    bucket assignment matches what :func:`load_image_tensor` actually produces.
    """

    image_path: Path
    caption: str
    width: int
    height: int


MASK_SUFFIX = "_mask"


def is_mask_file(path: Path) -> bool:
    """A ``<name>_mask.<ext>`` file beside an image ``<name>.<ext>``: a mask, never a training image itself
    (whether or not masked loss is on)."""
    if not (path.stem.endswith(MASK_SUFFIX) and path.suffix.lower() in IMAGE_EXTENSIONS):
        return False
    stem = path.stem[: -len(MASK_SUFFIX)]
    return any((path.parent / f"{stem}{ext}").is_file() or (path.parent / f"{stem}{ext.upper()}").is_file()
               for ext in IMAGE_EXTENSIONS)


def scan_dataset(cfg: DataConfig, log: Callable[[str], None] | None = None,
                 skip: Callable[[Path], bool] | None = None) -> list[ImageRecord]:
    """List the images directly inside ``cfg.path`` with their captions, sorted by file name.

    Sorting makes runs reproducible across file systems (directory order is arbitrary).
    Repeats are not expanded here; use :func:`expand_repeats`. ``log`` gets a one-line
    notice for each sub-folder and broken link that is skipped. A mask beside its image (``<name>_mask.png``,
    engine/data/masks.py) is never a training image; ``skip(path)`` True leaves out other files.
    """
    folder = _dataset_folder(cfg.path)
    files = [p for p in _visible_files(folder, log or (lambda msg: None)) if not is_mask_file(p)]
    if skip is not None:
        files = [p for p in files if not skip(p)]
    images = _image_files(folder, files)
    captions = _caption_files(files, cfg.caption_extension)
    pairs = _pair_captions(images, captions, cfg)
    return [_make_record(path, caption) for path, caption in pairs]


def expand_repeats(records: Sequence[ImageRecord], repeats: int) -> list[ImageRecord]:
    """Return the records repeated ``repeats`` times (the whole list, then again).

    Repeating the whole list rather than each item keeps one full pass over the data
    before any image appears twice, when the caller iterates in order.
    """
    if repeats < 1:
        raise ConfigError(f"repeats={repeats} must be >= 1")
    return list(records) * repeats


def build_caption(caption: str, trigger_word: str) -> str:
    """Prefix the trigger word ("trigger, caption"), so the LoRA learns a handle to call it by."""
    trigger = trigger_word.strip()
    caption = caption.strip()
    if trigger and caption:
        return f"{trigger}, {caption}"
    return trigger or caption


def read_caption(path: Path) -> str:
    """Read a caption file as UTF-8 (a BOM is tolerated), joining its lines with spaces.

    Text encoders see one line anyway; stray newlines from editors would otherwise
    end up as odd tokens.
    """
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"caption file {path} is not valid UTF-8 ({exc.reason}); re-save it as UTF-8") from exc
    except OSError as exc:
        raise DatasetError(f"cannot read caption file {path}: {exc}") from exc
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def read_image_size(path: Path) -> tuple[int, int]:
    """Return (width, height) as displayed, reading only the header (no full decode)."""
    try:
        with Image.open(path) as img:
            width, height = img.size
            orientation = img.getexif().get(_EXIF_ORIENTATION, 1)
    except _IMAGE_ERRORS as exc:
        raise DatasetError(
            f"cannot read image {path.name} in {path.parent}: {exc}. "
            "The file is corrupt or not really an image; re-export it or remove it from the folder"
        ) from exc
    if width <= 0 or height <= 0:
        raise DatasetError(f"image {path} has an empty size {width}x{height}; remove it from the folder")
    if orientation in _ROTATED_ORIENTATIONS:
        return height, width
    return width, height


def _dataset_folder(path: str) -> Path:
    """Resolve the configured path, failing with a fix-it message when it is not a folder."""
    if not path or not str(path).strip():
        raise DatasetError("the dataset path is empty: set it to a folder of images with .txt captions")
    folder = Path(str(path).strip()).expanduser()
    if not folder.exists():
        raise DatasetError(f"dataset folder {folder} does not exist; check the path (absolute paths are safest)")
    if not folder.is_dir():
        raise DatasetError(f"dataset path {folder} is a file, not a folder; point it at the folder holding the images")
    return folder


def _visible_files(folder: Path, log: Callable[[str], None] = lambda msg: None) -> list[Path]:
    """Plain files directly in ``folder``, sorted by name, without hidden ones.

    Hidden files are skipped because macOS leaves "._photo.jpg" metadata files next
    to real images; they carry an image suffix but are not images.
    """
    try:
        entries = list(folder.iterdir())
    except OSError as exc:
        raise DatasetError(f"cannot list dataset folder {folder}: {exc}") from exc
    files = []
    for p in sorted(entries, key=lambda p: p.name):
        if p.name.startswith("."):
            continue
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            log(f"dataset: sub-folder '{p.name}' is skipped (only files directly in '{folder}' are used)")
        elif p.is_symlink():
            log(f"dataset: '{p.name}' is a broken link (to '{os.readlink(p)}') and is skipped")
    return files


def _image_files(folder: Path, files: list[Path]) -> list[Path]:
    """The image files among ``files`` (the folder's listing); an error when there are none."""
    images = [p for p in files if p.suffix.lower() in IMAGE_EXTENSIONS]
    if not images:
        accepted = ", ".join(ext.lstrip(".") for ext in IMAGE_EXTENSIONS)
        raise DatasetError(
            f"no images found in {folder}: put {accepted} files directly in it (sub-folders are not searched)"
        )
    return images


def _normalise_extension(extension: str) -> str:
    """".txt", "txt" and ".TXT" all mean the same caption suffix."""
    extension = extension.strip().lower()
    return extension if extension.startswith(".") else f".{extension}"


def _caption_files(files: list[Path], extension: str) -> dict[str, Path]:
    """Map file stem -> caption file, matching the suffix case-insensitively."""
    suffix = _normalise_extension(extension)
    return {p.stem: p for p in files if p.suffix.lower() == suffix}


def _pair_captions(
    images: list[Path], captions: dict[str, Path], cfg: DataConfig
) -> list[tuple[Path, str]]:
    """Attach to each image its caption (trigger word included), or fail listing the uncaptioned."""
    pairs: list[tuple[Path, str]] = []
    missing: list[str] = []
    for image in images:
        caption = _caption_for(image, captions, cfg.default_caption)
        if caption is None:
            missing.append(image.name)
        else:
            pairs.append((image, build_caption(caption, cfg.trigger_word)))
    if missing:
        raise DatasetError(_missing_captions_message(missing, cfg.caption_extension))
    return pairs


def _caption_for(image: Path, captions: dict[str, Path], default: Optional[str]) -> Optional[str]:
    """The image's caption text, the default when it has none (or an empty one), else None."""
    caption_file = captions.get(image.stem)
    text = read_caption(caption_file) if caption_file is not None else ""
    if text:
        return text
    return default


def _missing_captions_message(missing: list[str], extension: str, noun: str = "image") -> str:
    """Name up to MAX_LISTED images (or clips) without captions and say the two ways to fix it."""
    listed = ", ".join(missing[:MAX_LISTED])
    more = len(missing) - MAX_LISTED
    if more > 0:
        listed += f" ... and {more} more"
    suffix = _normalise_extension(extension)
    return (
        f"{len(missing)} {noun}(s) have no caption (or an empty one): {listed}. "
        f"Add a same-name {suffix} file next to each {noun}, or set default_caption "
        f"to use one caption for all uncaptioned {noun}s"
    )


def _make_record(path: Path, caption: str) -> ImageRecord:
    """Read the image's header to complete its record."""
    width, height = read_image_size(path)
    return ImageRecord(image_path=path, caption=caption, width=width, height=height)
