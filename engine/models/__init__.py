"""Loading models from local files (never a hub)."""
from .dtypes import resolve_device, resolve_dtype
from .transformer_loading import load_transformer

__all__ = ["load_transformer", "resolve_device", "resolve_dtype"]
