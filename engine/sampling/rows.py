"""The rows of one denoising step (prompts and guidance branches) grouped into forwards: which rows may share a
forward, and their embeddings merged into one batch."""
from __future__ import annotations

import torch


def batch_rows(rows: list[dict[str, torch.Tensor]], max_rows: int | None) -> list[tuple[list[int], dict]]:
    """Rows (each a batch of embeddings as ``DatasetCache.load_text`` gives them) -> the forwards of one denoising
    step: ``(row indexes, their embeddings as one batch)``. Rows go together when every fixed-shape tensor has one
    shape (``_row_kind``), at most ``max_rows`` (None: no limit) per forward, in order. The forwards of a kind are
    as even as they can be (5 rows at most 3: 3 + 2; 4 rows: 2 + 2, not 3 + 1): a streamed forward copies every
    block whatever its rows, so a forward of one row leaves the copies nothing to hide behind."""
    kinds: dict[tuple, list[int]] = {}
    for r, row in enumerate(rows):
        kinds.setdefault(_row_kind(row), []).append(r)
    limit = max(1, max_rows) if max_rows else len(rows)
    out = []
    for idx in kinds.values():
        forwards = -(-len(idx) // limit)
        start = 0
        for f in range(forwards):
            size = len(idx) // forwards + (1 if f < len(idx) % forwards else 0)
            part = idx[start:start + size]
            start += size
            out.append((part, merge_embeds([rows[r] for r in part])))
    return out


def _mask_of(key: str) -> str:
    """The mask of a variable-length encoder's states (``TextEncoderSpec.mask_key``: 1 = a real token)."""
    return f"{key}_mask"


def _row_kind(row: dict[str, torch.Tensor]) -> tuple:
    """What must be equal for rows to share a forward: the keys, and the shape and dtype of every tensor but a
    variable-length encoder's token axis (padded by ``merge_embeds``) and its mask."""
    out = []
    for key in sorted(row):
        t = row[key]
        if key.endswith("_mask") and key[: -len("_mask")] in row:
            continue
        tail = tuple(t.shape[2:]) if _mask_of(key) in row else tuple(t.shape[1:])
        out.append((key, tail, t.dtype))
    return tuple(out)


def merge_embeds(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Batches of embeddings of one ``_row_kind`` -> one batch. A variable-length encoder's states (those with a
    mask) keep each row's real tokens, zero-padded at the end to the longest with a new mask, as
    ``DatasetCache.collate_text`` pads a training batch and the families' pipelines pad batched prompts (the models
    attend to the real tokens only: Z-Image and Lumina 2 by their masks, Qwen-Image by its joint attention mask);
    every other tensor is concatenated as it is (T5 and umT5 states are padded to one length already)."""
    if len(rows) == 1:
        return dict(rows[0])
    out = {}
    for key in rows[0]:
        if key.endswith("_mask") and key[: -len("_mask")] in rows[0]:
            continue
        if _mask_of(key) not in rows[0]:
            out[key] = torch.cat([r[key] for r in rows])
            continue
        real = [t[m.bool()] for r in rows for t, m in zip(r[key], r[_mask_of(key)])]
        longest = max(t.shape[0] for t in real)
        padded = real[0].new_zeros((len(real), longest, *real[0].shape[1:]))
        mask = torch.zeros(len(real), longest, dtype=rows[0][_mask_of(key)].dtype)
        for i, t in enumerate(real):
            padded[i, : t.shape[0]] = t
            mask[i, : t.shape[0]] = 1
        out[key], out[_mask_of(key)] = padded, mask
    return out
