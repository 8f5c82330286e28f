"""Record source: a folder of captioned images (``data.scan_dataset``), one cache item per image; with masked loss
(``DatasetOptions.mask_source``), each item also names its mask entry."""
from __future__ import annotations

from dataclasses import replace

from ...data import scan_dataset
from ...data.masks import mask_file, mask_problem
from ...data.options import DatasetOptions
from ...errors import DatasetError
from ...hashing import sha256_file
from .base import CaptionSource

#: How many images without a usable mask a message lists.
_LISTED = 20


class ImageSource(CaptionSource):
    label = "images"

    def __init__(self, models, data_cfg, options: DatasetOptions | None = None):
        super().__init__(models, data_cfg)
        self.options = options or DatasetOptions()

    def scan(self, log):
        source = self.options.mask_source
        records = scan_dataset(self.data_cfg, log=log)  # masks beside their images are left out by the scan

        if source == "none":
            return records
        return with_masks(records, source, self.options.missing_mask, log)

    def items(self, records, buckets, keys, flip):
        items = self.keyed(records, buckets, keys, flip, path_of=lambda r: r.image_path, content_of=sha256_file,
                           frames_of=lambda r: None)
        source = self.options.mask_source
        if source == "none":
            return items
        return [replace(it, mask_key=keys.mask(sha256_file(mask_file(rec.image_path, source)), it.bucket, flip,
                                               source))
                for it, rec in zip(items, records)]


def with_masks(records, source: str, missing: str, log, image_of=lambda r: r, what: str = "image"):
    """The records whose mask is usable; the others are an error listing them (``missing='error'``) or left out,
    each named in the log (``'skip'``). Never a silent full mask. ``image_of``: a record's ``ImageRecord`` (an edit
    pair's target: only the target is masked), ``what`` names it in messages."""
    problems = {id(r): mask_problem(image_of(r).image_path, (image_of(r).width, image_of(r).height), source)
                for r in records}
    bad = [problems[id(r)] for r in records if problems[id(r)] is not None]
    if not bad:
        return records
    if missing == "error":
        more = f" ... and {len(bad) - _LISTED} more" if len(bad) > _LISTED else ""
        raise DatasetError(f"masked loss (mask_source={source!r}): {len(bad)} {what}(s) have no usable mask: "
                           f"{'; '.join(bad[:_LISTED])}{more}. Add the masks, or set missing_mask='skip' to train "
                           f"without those {what}s")
    for problem in bad:
        log(f"masked loss: skipping {problem}")
    kept = [r for r in records if problems[id(r)] is None]
    if not kept:
        raise DatasetError(f"masked loss (mask_source={source!r}): no {what} has a usable mask, so none is left to "
                           f"train on; add the masks or set mask_source='none'")
    return kept
