"""Batches that never mix aspect-ratio buckets, in a seed-determined order."""
from __future__ import annotations

import random
from collections import defaultdict
from typing import Iterator, Sequence, TypeVar

T = TypeVar("T")


def bucket_batches(items: Sequence[T], batch_size: int, seed: int, bucket_of) -> Iterator[list[T]]:
    """Endless stream of batches; each epoch reshuffles items within buckets and the
    batch order across buckets. A bucket's remainder forms a smaller last batch rather
    than being dropped (small datasets would otherwise lose images)."""
    rng = random.Random(seed)
    while True:
        groups: dict = defaultdict(list)
        for it in items:
            groups[bucket_of(it)].append(it)
        batches = []
        for key in sorted(groups):
            group = groups[key]
            rng.shuffle(group)
            batches += [group[i:i + batch_size] for i in range(0, len(group), batch_size)]
        rng.shuffle(batches)
        yield from batches
