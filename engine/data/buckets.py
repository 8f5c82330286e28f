"""Aspect-ratio buckets.

Training every image at one square size either squashes or crops away a lot of
each non-square photo. Buckets instead offer a set of (width, height) shapes of
roughly equal pixel count (so every step costs about the same memory and time),
and each image goes to the shape closest to its own aspect ratio; only a thin
border is then cropped.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from ..errors import ConfigError

Bucket = tuple[int, int]


def _check_bucket_args(resolution: int, step: int, max_aspect: float) -> None:
    """Reject arguments that would give no buckets, with a message saying which to change."""
    if step < 1:
        raise ConfigError(f"bucket step={step} must be >= 1")
    if resolution < step:
        raise ConfigError(
            f"resolution={resolution} is smaller than bucket_step={step}: "
            "no bucket fits; raise resolution or lower bucket_step"
        )
    if max_aspect < 1.0:
        raise ConfigError(f"max_aspect={max_aspect} must be >= 1.0")


def _largest_side(other_side: int, max_area: int, step: int) -> int:
    """Largest multiple of ``step`` whose product with ``other_side`` stays within ``max_area``."""
    return (max_area // other_side) // step * step


def _within_aspect(width: int, height: int, max_aspect: float) -> bool:
    """True when long side / short side <= max_aspect (tiny slack for float input)."""
    return max(width, height) / min(width, height) <= max_aspect + 1e-9


def make_buckets(resolution: int, step: int = 64, max_aspect: float = 2.0) -> list[Bucket]:
    """Return the sorted (width, height) buckets for a target ``resolution``.

    For every long side that is a multiple of ``step``, the short side is the
    largest multiple of ``step`` keeping ``long * short <= resolution**2``: the
    pixel budget (and so the VRAM a step needs) never exceeds the square's, while
    wasting as little of it as the grid allows. Shapes beyond ``max_aspect`` are
    dropped, because extreme crops rarely match real photos. Every landscape
    bucket is mirrored into a portrait one, so 2:1 and 1:2 images are treated
    alike (choosing the height per *width* instead would not be symmetric). The
    square (resolution, resolution) is present whenever ``resolution`` is a
    multiple of ``step``.
    """
    _check_bucket_args(resolution, step, max_aspect)
    max_area = resolution * resolution
    # No admissible long side exceeds resolution * sqrt(max_aspect); go one step past it.
    max_long = int(resolution * math.sqrt(max_aspect)) + step
    buckets: set[Bucket] = set()
    for long_side in range(step, max_long + 1, step):
        short_side = _largest_side(long_side, max_area, step)
        if short_side < step or short_side > long_side:
            continue  # too small to be a bucket, or the portrait twin of a shorter long side
        if _within_aspect(long_side, short_side, max_aspect):
            buckets.add((long_side, short_side))
            buckets.add((short_side, long_side))
    if not buckets:
        raise ConfigError(
            f"no bucket of step {step} fits resolution={resolution} within max_aspect={max_aspect}; "
            "raise max_aspect or resolution"
        )
    return sorted(buckets)


def assign_bucket(width: int, height: int, buckets: Sequence[Bucket]) -> Bucket:
    """Pick the bucket whose aspect ratio is nearest to the image's.

    Distance is measured in log space so that 2:1 and 1:2 are equally far from
    1:1 (a plain ratio difference would favour landscape). On a tie the larger
    bucket wins, so the image keeps more of its detail.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"image size {width}x{height} must be positive")
    if not buckets:
        raise ValueError("buckets is empty; build them with make_buckets()")
    target = math.log(width / height)

    def key(bucket: Bucket) -> tuple[float, int]:
        distance = abs(math.log(bucket[0] / bucket[1]) - target)
        # Rounding makes mathematically equal distances compare equal despite float noise.
        return (round(distance, 9), -bucket[0] * bucket[1])

    return min(buckets, key=key)
