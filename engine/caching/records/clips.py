"""Record source: a folder of captioned clips (``data.scan_video_dataset``; an image counts as a one-frame clip),
one cache item per clip window."""
from __future__ import annotations

from ...data import VideoConfig, clip_content_hash, scan_video_dataset
from .base import CaptionSource


class ClipSource(CaptionSource):
    label = "clip windows"

    def __init__(self, models, data_cfg, video: VideoConfig):
        super().__init__(models, data_cfg)
        self.video = video

    def scan(self, log):
        return scan_video_dataset(self.data_cfg, self.video, log=log)

    def items(self, records, buckets, keys, flip):
        return self.keyed(records, buckets, keys, flip, path_of=lambda r: r.path, content_of=clip_content_hash,
                          frames_of=lambda r: list(r.frames))
