"""Text-embedding and latent caches on disk."""
from .cache import CachedItem, DatasetCache, build_dataset_cache, open_dataset_cache, resolve_pipeline_folder
from .layer_major import layer_major, main_layer_list

__all__ = [
    "CachedItem", "DatasetCache", "build_dataset_cache", "layer_major", "main_layer_list",
    "open_dataset_cache", "resolve_pipeline_folder",
]
