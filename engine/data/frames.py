"""Which source frames a training window uses: fps resampling by timestamps, then windows of 4k+1 frames.

Pure index arithmetic on a clip's frame timestamps (no decoding), so a dataset's windows are known, checked and
keyed for the cache before any pixel is decoded.
"""
from __future__ import annotations

import bisect
import random
from collections.abc import Sequence

from ..hashing import stable_hash
from .buckets import assign_frame_count

# Float slack when comparing a target time with a frame's timestamp: k / fps and a container's rational
# pts land a few ulps apart for the same instant (0.1 * 3 != 3 / 10 in floats).
_EPS = 1e-6


def resample_to_fps(timestamps: Sequence[float], end: float, fps: float) -> list[int]:
    """Source frame indices of the clip resampled to ``fps``: for each target time ``t0 + k / fps`` before
    ``end``, the frame on screen then (the last one whose timestamp is <= that time).

    ``timestamps``: each source frame's presentation time in seconds, ascending; ``end``: when the last
    frame stops showing. Timestamps rather than the container's nominal rate, so variable-frame-rate phone
    clips and GIFs with per-frame delays keep real-time motion speed. A target rate above the source's
    repeats frames; ``fps`` 0 keeps every source frame.
    """
    count = len(timestamps)
    if count == 0:
        return []
    if fps <= 0 or count == 1:
        return list(range(count))
    start = timestamps[0]
    indices = []
    k = 0
    while True:
        t = start + k / fps
        if t >= end - _EPS:
            break
        indices.append(bisect.bisect_right(timestamps, t + _EPS) - 1)
        k += 1
    return indices or [0]


def window_starts(available: int, count: int, window: str, n: int, seed: int, key: str) -> list[int]:
    """Start positions (into the resampled frames) of a clip's windows of ``count`` frames.

    head: [0]. uniform: ``n`` starts spread evenly from 0 to the last possible start (one window = the head,
    as ``numpy.linspace(0, last, n)`` truncated would give). random: ``n`` distinct starts drawn from a
    generator seeded by ``seed`` and ``key`` (the clip's file name), so a clip gets the same windows on every
    run and adding another clip changes none of them. Fewer windows come back when the clip has fewer
    distinct starts than ``n``.
    """
    if count > available:
        raise ValueError(f"a window of {count} frames does not fit {available} frames")
    last = available - count
    if window == "head":
        return [0]
    if window == "uniform":
        if n == 1:
            return [0]
        return sorted({i * last // (n - 1) for i in range(n)})
    if window == "random":
        # A str seed is hashed by random.Random itself (sha512), independent of PYTHONHASHSEED.
        rng = random.Random(stable_hash(["video-window", seed, key]))
        return sorted(rng.sample(range(last + 1), min(n, last + 1)))
    raise ValueError(f"window={window!r} is not one of head, uniform, random")


def clip_windows(timestamps: Sequence[float], end: float, fps: float, frame_counts: Sequence[int], window: str,
                 n: int, seed: int, key: str) -> tuple[int, int, list[tuple[int, ...]]]:
    """(frames available after resampling, the window's frame count or 0 when the clip is too short,
    the windows as tuples of source frame indices)."""
    resampled = resample_to_fps(timestamps, end, fps)
    count = assign_frame_count(len(resampled), frame_counts)
    if count is None:
        return len(resampled), 0, []
    starts = window_starts(len(resampled), count, window, n, seed, key)
    return len(resampled), count, [tuple(resampled[s:s + count]) for s in starts]
