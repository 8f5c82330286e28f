"""Loading models from local files (never a hub)."""
from .dtypes import resolve_device, resolve_dtype
from .transformer_loading import TransformerSource, load_transformer, resolve_transformer_source

__all__ = ["TransformerSource", "load_transformer", "resolve_device", "resolve_dtype", "resolve_transformer_source"]
