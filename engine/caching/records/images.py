"""Record source: a folder of captioned images (``data.scan_dataset``), one cache item per image."""
from __future__ import annotations

from ...data import scan_dataset
from ...hashing import sha256_file
from .base import CaptionSource


class ImageSource(CaptionSource):
    label = "images"

    def scan(self, log):
        return scan_dataset(self.data_cfg, log=log)

    def items(self, records, buckets, keys, flip):
        return self.keyed(records, buckets, keys, flip, path_of=lambda r: r.image_path, content_of=sha256_file,
                          frames_of=lambda r: None)
