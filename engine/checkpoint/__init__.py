"""The one checkpoint reader: what a file or folder is, and what its tensors are.

- ``files``: raw safetensors access (headers, row ranges) for every file the engine reads;
- ``tensors``: every decoding rule (prefixes, fp8, scaled fp8, ComfyUI ``comfy_quant``), with named
  refusals for what cannot be decoded (nvfp4, other quantized formats, GGUF, pickles);
- ``identity``: a transformer checkpoint's identity (family, variant, config), made once and passed on, and its
  tensors under diffusers names, loaded or read row by row;
- ``kinds/``: the kinds of checkpoint (diffusers folder, single file, slab), one file each, found by file name;
- ``transformer``: ``identify`` and ``open_checkpoint``, through the kind that claims a path.

Loading, the slab build, the footprint before loading, cache identification, the Load node and
single-file text encoders all read through here.
"""
from .files import SLAB_FORMAT, SafetensorsFile
from .kinds import CheckpointKind, checkpoint_kinds, get_kind
from .tensors import DECODER_VERSION, StoredTensor, TensorStore, is_side_tensor, open_files, refuse_unreadable_form
from .transformer import (
    KEY_PREFIXES, Checkpoint, CheckpointIdentity, SourceTensor, expected_single_file_shapes, identify,
    open_checkpoint, resolve_path,
)

__all__ = [
    "Checkpoint", "CheckpointIdentity", "CheckpointKind", "DECODER_VERSION", "KEY_PREFIXES", "SLAB_FORMAT",
    "SafetensorsFile", "SourceTensor", "StoredTensor", "TensorStore", "expected_single_file_shapes", "identify",
    "is_side_tensor", "checkpoint_kinds", "get_kind", "open_checkpoint", "open_files", "refuse_unreadable_form", "resolve_path",
]
