"""Record source: a folder of captioned clips (``data.scan_video_dataset``; an image counts as a one-frame clip),
one cache item per clip window; with masked loss (``DatasetOptions.mask_source``), each window also names its mask
entry (``data.clip_masks``: one mask frame per clip frame)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ...data import VideoConfig, clip_content_hash, scan_video_dataset
from ...data.clip_masks import clip_mask_file, clip_mask_problem
from ...data.options import DatasetOptions
from ...data.video import probe_clip
from ...errors import DatasetError
from .base import CaptionSource

_LISTED = 20  # how many clips without a usable mask a message lists


class ClipSource(CaptionSource):
    label = "clip windows"

    def __init__(self, models, data_cfg, video: VideoConfig, options: DatasetOptions | None = None):
        super().__init__(models, data_cfg)
        self.video = video
        self.options = options or DatasetOptions()

    def scan(self, log):
        source = self.options.mask_source
        skip = (lambda p: p.is_dir() and p.name == "masks") if source == "folder" else None
        records = scan_video_dataset(self.data_cfg, self.video, log=log, skip=skip)
        return records if source == "none" else self._with_masks(records, source, log)

    def items(self, records, buckets, keys, flip):
        items = self.keyed(records, buckets, keys, flip, path_of=lambda r: r.path, content_of=clip_content_hash,
                           frames_of=lambda r: list(r.frames))
        source = self.options.mask_source
        if source == "none":
            return items
        content = {}
        for rec in records:
            if rec.path not in content:
                content[rec.path] = clip_content_hash(clip_mask_file(rec.path, source))
        return [replace(it, mask_key=keys.mask(content[rec.path], it.bucket, flip, source, list(rec.frames)))
                for it, rec in zip(items, records)]

    def _with_masks(self, records, source: str, log):
        """The windows of clips whose mask is usable; the others an error listing them (``missing_mask='error'``) or
        left out, each named in the log (``'skip'``). Never a silent full mask."""
        fps = self.video.frames_folder_fps
        problems: dict[Path, str | None] = {}
        for rec in records:
            if rec.path not in problems:
                count = probe_clip(rec.path, fps).frame_count
                problems[rec.path] = clip_mask_problem(rec.path, (rec.width, rec.height), count, source, fps)
        bad = [p for p in problems.values() if p is not None]
        if bad and self.options.missing_mask == "error":
            more = f" ... and {len(bad) - _LISTED} more" if len(bad) > _LISTED else ""
            raise DatasetError(f"masked loss (mask_source={source!r}): {len(bad)} clip(s) have no usable mask: "
                               f"{'; '.join(bad[:_LISTED])}{more}. Add the masks, or set missing_mask='skip' to train "
                               f"without those clips")
        for problem in bad:
            log(f"masked loss: skipping {problem}")
        kept = [r for r in records if problems[r.path] is None]
        if not kept:
            raise DatasetError(f"masked loss (mask_source={source!r}): no clip has a usable mask, so none is left to "
                               f"train on; add the masks or set mask_source='none'")
        return kept
