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


# --- frame-count buckets (video) -------------------------------------------------------------------
# A video bucket is (width, height, frames): the resolution part is exactly the image bucket above (same
# pixel budget per frame, same aspect choice); the frame part is one of the configured counts. Clips of one
# bucket batch together, as images of one aspect bucket do.

VideoBucket = tuple[int, int, int]


def check_frame_counts(counts: Sequence[int]) -> tuple[int, ...]:
    """The frame counts sorted and deduplicated, each of the form 4k+1 (1, 5, 9, ..., 33, ..., 81).

    Wan's VAE is causal in time: it keeps the first frame alone and packs every following 4 frames into one
    latent frame, so only 4k+1 pixel frames map onto whole latent frames (F_lat = (F - 1) / 4 + 1); the
    pipelines round ``num_frames`` the same way."""
    values = list(counts)
    if not values:
        raise ConfigError("frame_counts is empty: give at least one count of the form 4k+1, e.g. 33")
    for n in values:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1 or (n - 1) % 4:
            near = _nearest_4k1(n) if isinstance(n, (int, float)) and not isinstance(n, bool) else "33"
            raise ConfigError(
                f"frame count {n!r} is not of the form 4k+1 (1, 5, 9, ..., 33, ..., 81): the video VAE packs the "
                f"first frame alone and then 4 frames per latent frame; use {near}")
    return tuple(sorted(set(values)))


def _nearest_4k1(n: float) -> str:
    """The 4k+1 values around ``n``, as text for an error message."""
    below = max(1, int((n - 1) // 4) * 4 + 1)
    return f"{below} or {below + 4}" if below != n else str(below)


def assign_frame_count(available: int, counts: Sequence[int]) -> int | None:
    """The largest frame count that ``available`` frames can fill; None when even the smallest is too long.

    The largest, so that a long clip trains on as much motion as the settings allow; a shorter clip still
    trains at the longest count it fills, instead of being dropped or padded with repeated frames."""
    fitting = [n for n in counts if n <= available]
    return max(fitting) if fitting else None


def assign_video_bucket(width: int, height: int, frames: int, buckets: Sequence[Bucket]) -> VideoBucket:
    """The (width, height) image bucket of a frame (:func:`assign_bucket`) with the clip's frame count."""
    if frames < 1:
        raise ValueError(f"frames={frames} must be >= 1")
    return (*assign_bucket(width, height, buckets), frames)
