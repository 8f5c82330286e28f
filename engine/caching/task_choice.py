"""The user's text-to-video / image-to-video choice on a checkpoint that does both (LTX-2.3 / 2.5): the variant the
cache is built for. Such a family lists its image-to-video variants beside the text-to-video ones on the same shipped
config (``FirstFrameCondition`` from ``first_frame``); shapes always match the text-to-video one first, so the choice
(``VideoConfig.image_to_video``) picks the image-to-video twin here, and the cache, its keys, training and previews
follow the variant as they do for Wan I2V. No family is named: the twin is the variant of the same config file."""
from __future__ import annotations

from dataclasses import replace

from ..errors import ConfigError


def image_to_video_variant(family, variant: str) -> str:
    """``variant`` itself where it takes a first frame (an I2V checkpoint), else its image-to-video twin."""
    if family.first_frame(variant) is not None:
        return variant
    config = family.variants.get(variant)
    twins = [v for v, c in family.variants.items() if c == config and v != variant and family.first_frame(v) is not None]
    if config is None or not twins:
        raise ConfigError(f"image_to_video is on, but {family.display_name} ({variant}) has no image-to-video mode; "
                          f"turn image_to_video off, or load an image-to-video checkpoint")
    return twins[0]


def choose_task(models, video):
    """The cache's models (``CacheModels``) for the chosen task: unchanged unless ``video.image_to_video``."""
    if video is None or not video.image_to_video:
        return models
    return replace(models, variant=image_to_video_variant(models.family, models.variant))
