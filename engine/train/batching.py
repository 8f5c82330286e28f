"""Batches that never mix aspect-ratio buckets, in a seed-determined order."""
from __future__ import annotations

import random
from collections import defaultdict
from typing import Iterator, Sequence, TypeVar

import torch

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


def micro_generator(seed: int, global_index: int) -> torch.Generator:
    """The CPU generator for one global micro-batch: a pure function of (seed, index), so any
    rank (or a resumed run) draws exactly what a single uninterrupted process would."""
    # splitmix64-style mixing keeps nearby (seed, index) pairs far apart as generator seeds.
    x = (seed * 0x9E3779B97F4A7C15 + global_index + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return torch.Generator().manual_seed((x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF)
