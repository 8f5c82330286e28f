"""What every record source of a cache build does (``RecordSource``), and the part images and clips share: captions
encoded by the family's text encoders, sample prompts guided against one empty prompt (``CaptionSource``)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol, Sequence

from ...callbacks import TrainingCallback
from ...config import DataConfig
from ...data import assign_bucket
from ..entries import build_text, negative_specs
from ..items import CachedItem, SampleItems, text_item
from ..keys import CacheKeys
from ..model_sources import CacheModels


class RecordSource(Protocol):
    """Where a dataset's records come from and how they become cache entries: images, clip windows, edit pairs.
    ``records.record_source`` chooses one per build; the build calls these in order."""

    #: What one item is, for the build's summary line ("images", "clip windows").
    label: str

    def scan(self, log: Callable[[str], None]) -> list:
        """The dataset's records (files found, captions read), before any model loads."""

    def items(self, records: list, buckets, keys: CacheKeys, flip: bool) -> list[CachedItem]:
        """One cache item per record, keyed by what it depends on."""

    def samples(self, prompts: Sequence[str], records: list, keys: CacheKeys) -> SampleItems:
        """The sample prompts' entries, and the negatives the family's guidance samples against."""

    def build_text(self, cache_dir: Path, models: CacheModels, keys: CacheKeys, items: list[CachedItem],
                   samples: SampleItems, cb: TrainingCallback, stats: dict) -> None:
        """Write the text entries the cache lacks (captions, sample prompts, negatives)."""


class CaptionSource:
    """Images or clips captioned in text: the captions go through the family's text encoders, and a family sampled
    with classifier-free guidance samples every prompt against one empty prompt."""

    label = "images"

    def __init__(self, models: CacheModels, data_cfg: DataConfig):
        self.models, self.data_cfg = models, data_cfg

    def keyed(self, records: list, buckets, keys: CacheKeys, flip: bool, path_of: Callable, content_of: Callable,
              frames_of: Callable) -> list[CachedItem]:
        """One item per record at its bucket: ``path_of(record)`` the file, ``content_of(path)`` its content hash
        (computed once per file: a clip's windows share it), ``frames_of(record)`` a window's frames or None."""
        items = []
        content: dict[Path, str] = {}
        for rec in records:
            bucket = assign_bucket(rec.width, rec.height, buckets)
            source = path_of(rec)
            if source not in content:
                content[source] = content_of(source)
            frames = frames_of(rec)
            items.append(CachedItem(
                image=str(source), caption=rec.caption, bucket=tuple(bucket), text_key=keys.caption(rec.caption),
                latent_key=keys.latent(content[source], bucket, flip, frames), frames=frames or [],
            ))
        return items

    def samples(self, prompts: Sequence[str], records: list, keys: CacheKeys) -> SampleItems:
        made = [text_item(p, keys.caption(p)) for p in prompts]
        cfg = self.models.family.guidance(self.models.variant).mode == "cfg"
        return SampleItems(made, keys.empty_prompt(self.models.specs) if made and cfg else None)

    def build_text(self, cache_dir: Path, models: CacheModels, keys: CacheKeys, items: list[CachedItem],
                   samples: SampleItems, cb: TrainingCallback, stats: dict) -> None:
        build_text(cache_dir, models, models.specs, items + samples.prompts, keys.max_len, cb, stats)
        if samples.shared_negative is not None:  # not counted in the stats: it is no caption
            build_text(cache_dir, models, negative_specs(models.specs), [samples.shared_negative], keys.max_len,
                       cb, {})
