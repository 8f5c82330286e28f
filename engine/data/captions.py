"""Caption controls: tag shuffling with the first tags kept, and the variants a dataset cache holds.

Text encoders run only while the cache is built (layer by layer, streamed: a 24B encoder cannot run beside the
model at every step), so a shuffled caption must be encoded before training. The cache therefore holds a fixed
number of orders of each caption (``caption_variants``: the caption as written, then shuffles), and training picks
one per step at random. Each shuffle is a pure function of the caption, the kept count and the variant's index, so
a rebuild finds every variant again and encodes only new ones (another caption, more variants, another kept count).

Tags are the comma-separated parts of a caption; the trigger word, prepended as "trigger, caption", is the first
tag, so ``keep_tags=1`` keeps it in front (sd-scripts' ``keep_tokens`` does the same).
"""
from __future__ import annotations

import random

from ..hashing import stable_hash


def split_tags(caption: str) -> list[str]:
    return [t.strip() for t in caption.split(",") if t.strip()]


def shuffled_caption(caption: str, keep: int, variant: int) -> str:
    """Variant 0: the caption as written. Others: the tags after the first ``keep`` in a shuffled order, seeded by
    (caption, keep, variant), joined by ", "."""
    if variant == 0:
        return caption
    tags = split_tags(caption)
    head, tail = tags[:keep], tags[keep:]
    random.Random(stable_hash([caption, keep, variant])).shuffle(tail)
    return ", ".join(head + tail)


def caption_variants(caption: str, keep: int, count: int) -> list[str]:
    """The first ``count`` distinct orders of ``caption`` in the sequence of variants 0, 1, 2, ... (fewer when it
    has fewer orders): a prefix of the next count's, so asking for more variants adds to those cached."""
    out: dict[str, None] = {}
    for v in range(16 * count):  # enough tries to find ``count`` distinct orders whenever that many exist
        out.setdefault(shuffled_caption(caption, keep, v))
        if len(out) == count:
            break
    return list(out)
