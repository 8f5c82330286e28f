"""Slabs: a checkpoint quantized once (int8 per-row weights for every block Linear with fp32 row scales, or,
with ``bits=4``, int4 groups of 64 with fp16 scales and minima; everything else as stored), memory-mapped at load,
dequantized on the compute device right before each matmul. See format.py for the file layout."""
from .build import build_slab, default_slab_name, ensure_slab
from .format import FORMAT_VERSION, SLAB_SUFFIX, SlabError, manifest_path_for
from .int4_linear import Int4Linear, Int4LinearFunction
from .int8_linear import Int8Linear, Int8LinearFunction, int8_linear
from .load import is_slab_file, load_slab_transformer, open_slab, rebuild_command, verify_slab
from .quantize import dequantize_groups, dequantize_rows, quantize_groups, quantize_rows

__all__ = [
    "FORMAT_VERSION", "Int4Linear", "Int4LinearFunction", "Int8Linear", "Int8LinearFunction", "SLAB_SUFFIX",
    "SlabError", "build_slab",
    "default_slab_name", "dequantize_groups", "dequantize_rows", "ensure_slab", "int8_linear", "is_slab_file",
    "load_slab_transformer", "manifest_path_for", "open_slab", "quantize_groups", "quantize_rows",
    "rebuild_command", "verify_slab",
]
