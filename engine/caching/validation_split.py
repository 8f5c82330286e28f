"""The validation split of a cache build: items held out of training, fixed by their files, not by the seed.

A fraction of the dataset (``DatasetOptions.validation_fraction``) or a folder of its own
(``validation_folder``). A fraction is taken by source file (an image; every window of a clip goes the same way),
ordered by a hash of the file's name: the same files are held out run to run, whatever the seed or the order the
folder lists them in, and adding an image moves no other image across the split.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from ..data.options import DatasetOptions
from ..errors import DatasetError
from ..hashing import stable_hash
from .items import CachedItem


def split_by_fraction(items: list[CachedItem], fraction: float) -> tuple[list[CachedItem], list[CachedItem]]:
    """(training items, validation items): ceil(fraction x files) source files held out, at least one, and at
    least one left to train on."""
    if fraction <= 0:
        return items, []
    files = sorted({it.image for it in items}, key=lambda f: stable_hash([Path(f).name]))
    if len(files) < 2:
        raise DatasetError(f"validation_fraction={fraction} needs at least 2 images (or clips) to hold one out; the "
                           f"dataset has {len(files)}. Add images, give a validation_folder, or set it to 0")
    held = set(files[: min(len(files) - 1, max(1, math.ceil(fraction * len(files))))])
    return [it for it in items if it.image not in held], [it for it in items if it.image in held]


def folder_items(options: DatasetOptions, data_cfg, make_source, buckets, keys, flip: bool, log,
                 name: str = "validation_folder") -> list[CachedItem]:
    """The items of the folder ``options.<name>``, scanned as the dataset is (same captions rules, trigger word,
    masks): ``make_source(data_cfg)`` is the build's record source for another folder."""
    folder = getattr(options, name).strip()
    try:
        source = make_source(replace(data_cfg, path=folder))
        records = source.scan(log)
    except DatasetError as exc:
        raise DatasetError(f"{name} '{folder}': {exc}") from None
    items = source.items(records, buckets, keys, flip)
    if not items:
        raise DatasetError(f"{name} '{folder}' holds no usable image; add captioned images or clear it")
    return items


def regularization_items(options: DatasetOptions | None, data_cfg, make_source, buckets, keys, flip,
                         log) -> list[CachedItem]:
    """The regularization folder's items: its own captions, no trigger word, no masks (class images, not the
    subject); none without a ``reg_folder``."""
    if options is None or not options.reg_folder.strip():
        return []
    reg_cfg = replace(data_cfg, trigger_word="")
    return folder_items(options, reg_cfg, lambda cfg: make_source(cfg, replace(options, mask_source="none")),
                        buckets, keys, flip, log, name="reg_folder")


def validation_items(options: DatasetOptions | None, items, data_cfg, make_source, buckets, keys, flip, log):
    """(training items, validation items) for the build's options."""
    if options is None or not options.validates:
        return items, []
    if options.validation_fraction > 0:
        return split_by_fraction(items, options.validation_fraction)
    return items, folder_items(options, data_cfg, make_source, buckets, keys, flip, log)
