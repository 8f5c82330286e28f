"""Dataset side of training: find images and captions, bucket them, decode them to tensors."""
from .buckets import assign_bucket, make_buckets
from .dataset import (
    IMAGE_EXTENSIONS,
    ImageRecord,
    build_caption,
    expand_repeats,
    read_caption,
    read_image_size,
    scan_dataset,
)
from .images import load_image_tensor

__all__ = [
    "IMAGE_EXTENSIONS",
    "ImageRecord",
    "assign_bucket",
    "build_caption",
    "expand_repeats",
    "load_image_tensor",
    "make_buckets",
    "read_caption",
    "read_image_size",
    "scan_dataset",
]
