"""The caption-variants phase of a cache build (Dataset Options' shuffle_tags and caption_dropout).

Each training item names the text entries of its caption's other orders (``CachedItem.text_variants``,
``data.captions``: the shuffle is done before caching, a fixed number of variants, because the text encoders only
run here); caption dropout adds one entry, the empty caption, encoded as captions are. Validation items keep their
caption as written: the held-out loss must measure the same thing every time.
"""
from __future__ import annotations

from dataclasses import replace

from ..data.captions import caption_variants
from ..data.options import DatasetOptions
from .items import CachedItem, text_item
from .keys import CacheKeys


def caption_entries(options: DatasetOptions | None, items: list[CachedItem], keys: CacheKeys
                    ) -> tuple[list[CachedItem], list[CachedItem], str]:
    """(the items with their variants' text keys, the text entries to encode besides the captions, the empty
    caption's key or "")."""
    if options is None or not options.captions_vary:
        return items, [], ""
    extra: dict[str, CachedItem] = {}
    out = []
    for it in items:
        if options.shuffle_tags:
            others = caption_variants(it.caption, options.keep_tags, options.caption_variants)[1:]
            variant_keys = [keys.caption(c) for c in others]
            for caption, key in zip(others, variant_keys):
                extra.setdefault(key, text_item(caption, key))
            it = replace(it, text_variants=variant_keys)
        out.append(it)
    empty = ""
    if options.caption_dropout > 0:
        empty = keys.caption("")
        extra.setdefault(empty, text_item("", empty))
    return out, list(extra.values()), empty
