"""The multi-resolution phase of a cache build (Dataset Options' ``resolutions``): each training image also cached at
other sizes.

Each size has its own aspect buckets (``data.make_buckets`` at that size, the dataset's bucket step and aspect limit);
an image at another size is another item with its own latent key (the key names the bucket, so the main size's entries
are the ones they were) and the same caption entries. Batches group items by bucket (``CachedItem.batch_key``), so a
batch never mixes sizes; the planner plans for the dataset's largest item (``offload.footprint.workload_for``).
Held-out (validation) images are not trained at any size; validation and regularization images stay at the main size.
"""
from __future__ import annotations

from ..data import make_buckets
from ..data.options import DatasetOptions
from .items import CachedItem


def other_sizes(options: DatasetOptions | None, source, records: list, data_cfg, keys, held_out: list[CachedItem]
                ) -> list[CachedItem]:
    """The training items at every size of ``options.resolutions`` but the main one (``data_cfg.resolution``)."""
    sizes = sorted(set(options.resolutions) - {data_cfg.resolution}) if options is not None else []
    held = {it.image for it in held_out}
    items = []
    for size in sizes:
        buckets = make_buckets(size, data_cfg.bucket_step, data_cfg.max_aspect)
        items += [it for it in source.items(records, buckets, keys, data_cfg.flip) if it.image not in held]
    return items
