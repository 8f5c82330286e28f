"""Dataset side of training: find images, clips and captions, bucket them, decode them to tensors."""
from .buckets import (
    VideoBucket,
    assign_bucket,
    assign_frame_count,
    assign_video_bucket,
    check_frame_counts,
    make_buckets,
)
from .dataset import (
    IMAGE_EXTENSIONS,
    ImageRecord,
    build_caption,
    expand_repeats,
    read_caption,
    read_image_size,
    scan_dataset,
)
from .frames import clip_windows, resample_to_fps, window_starts
from .images import load_image_tensor
from .video import (
    CLIP_EXTENSIONS,
    ClipError,
    ClipInfo,
    ClipTooShortError,
    EmptyClipError,
    UnreadableClipError,
    clip_content_hash,
    load_clip_tensor,
    probe_clip,
)
from .video_config import VideoConfig
from .video_dataset import ClipRecord, scan_video_dataset

__all__ = [
    "CLIP_EXTENSIONS",
    "ClipError",
    "ClipInfo",
    "ClipRecord",
    "ClipTooShortError",
    "EmptyClipError",
    "IMAGE_EXTENSIONS",
    "ImageRecord",
    "UnreadableClipError",
    "VideoBucket",
    "VideoConfig",
    "assign_bucket",
    "assign_frame_count",
    "assign_video_bucket",
    "build_caption",
    "check_frame_counts",
    "clip_content_hash",
    "clip_windows",
    "expand_repeats",
    "load_clip_tensor",
    "load_image_tensor",
    "make_buckets",
    "probe_clip",
    "read_caption",
    "read_image_size",
    "resample_to_fps",
    "scan_dataset",
    "scan_video_dataset",
    "window_starts",
]
