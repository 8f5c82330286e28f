"""What a transformer checkpoint is (``CheckpointIdentity``) and its tensors under diffusers names (``Checkpoint``).

The identity is made once (``transformer.identify``, by the kind of checkpoint that claims the path: ``kinds/``)
and passed on: the Load node's ``ModelInfo`` carries it into the run, and a data-parallel worker gets it as JSON
(``to_json`` / ``from_json``) instead of identifying the checkpoint again.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelLoadError
from ..families import ModelFamily, get_family, meta_model
from ..hashing import sampled_data_hash
from .files import SafetensorsFile
from .kinds import CheckpointKind, get_kind
from .tensors import DECODER_VERSION, TensorStore

#: Wrapper prefixes transformer checkpoints carry in the wild (ComfyUI full checkpoints, trainers' exports).
KEY_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")


@dataclass(frozen=True)
class CheckpointIdentity:
    """What a transformer checkpoint is: resolved once, passed on (the LOWVRAM_MODEL edge carries it)."""

    kind: str  # the name of its kind (``kinds/``): "diffusers" | "single_file" | "slab"
    path: Path  # the transformer folder or the .safetensors file
    pipeline_folder: Path | None  # the enclosing diffusers pipeline folder, if any
    family: ModelFamily
    variant: str
    config: dict[str, Any] = field(default_factory=dict, compare=False)  # the transformer's config

    @property
    def form(self) -> CheckpointKind:
        """The kind of checkpoint this is, which opens, loads and sizes it."""
        return get_kind(self.kind)

    def to_json(self) -> dict[str, Any]:
        """The identity as JSON, for a process that must not identify the checkpoint again (a data-parallel
        worker)."""
        return {"kind": self.kind, "path": str(self.path),
                "pipeline_folder": str(self.pipeline_folder) if self.pipeline_folder is not None else None,
                "family": self.family.id, "variant": self.variant, "config": self.config}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CheckpointIdentity:
        """The identity ``to_json`` wrote, as it was made (nothing is read from the checkpoint)."""
        pipeline = data.get("pipeline_folder")
        return cls(get_kind(data["kind"]).name, Path(data["path"]), Path(pipeline) if pipeline else None,
                   get_family(data["family"]), data["variant"], dict(data.get("config") or {}))


@dataclass(frozen=True)
class SourceTensor:
    """Where one diffusers tensor lives in the checkpoint."""

    name: str  # diffusers name ("transformer_blocks.0.attn.to_q.weight")
    source: str  # logical name in the store ("double_blocks.0.img_attn.qkv.weight")
    row_offset: int  # first row inside ``source`` (fused tensors hold several)
    shape: tuple[int, ...]  # diffusers shape
    dtype: torch.dtype  # as stored in the checkpoint
    scaled: bool = False  # a scale is multiplied in: reads come back as fp32
    swap_halves: bool = False  # BFL final modulation: (shift, scale) -> (scale, shift)
    flat: bool = False  # stored flattened to one axis (NativeParam.flat): Krea 2's block modulation

    @property
    def stored_float(self) -> torch.dtype:
        """What ``Checkpoint.read`` returns: the stored dtype, or fp32 when a scale has to be applied."""
        return torch.float32 if self.scaled else self.dtype


@dataclass
class Checkpoint:
    """A transformer checkpoint's identity plus every diffusers tensor, decoded on read."""

    identity: CheckpointIdentity
    store: TensorStore
    tensors: dict[str, SourceTensor]
    config_bytes: bytes = b""

    @property
    def kind(self) -> str:
        return self.identity.kind

    @property
    def path(self) -> Path:
        return self.identity.path

    @property
    def family(self) -> ModelFamily:
        return self.identity.family

    @property
    def variant(self) -> str:
        return self.identity.variant

    @property
    def config(self) -> dict[str, Any]:
        return self.identity.config

    @property
    def files(self) -> list[SafetensorsFile]:
        return self.store.files

    def read(self, name: str, row_start: int = 0, row_count: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of diffusers tensor ``name``, decoded (``stored_float`` dtype; ``out``: uint8 buffer to reuse)."""
        t = self.tensors[name]
        rows = t.shape[0] if t.shape else 1
        row_count = rows - row_start if row_count is None else row_count
        if t.swap_halves:  # small (2 x hidden rows): read whole, swap, slice
            a, b = self.store.read(t.source, t.row_offset, rows).chunk(2, dim=0)
            return torch.cat([b, a], dim=0)[row_start: row_start + row_count]
        if t.flat:  # small (a modulation table): read whole, reshape, slice
            return self.store.read(t.source).reshape(t.shape)[row_start: row_start + row_count]
        x = self.store.read(t.source, t.row_offset + row_start, row_count, out=out)
        return x.reshape(()) if not t.shape else x

    def state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Every diffusers tensor decoded and cast to ``dtype`` (floating ones), one at a time."""
        out = {}
        for name in self.tensors:
            x = self.read(name)
            out[name] = x.to(dtype) if x.is_floating_point() else x
        return out

    def load_model(self, dtype: torch.dtype) -> torch.nn.Module:
        """The family's transformer on the CPU in ``dtype``: built on the meta device, every tensor assigned."""
        model = meta_model(self.family, self.config)
        expected = model.state_dict()
        missing = sorted(set(expected) - set(self.tensors))
        wrong = [k for k, v in expected.items() if k in self.tensors and tuple(v.shape) != self.tensors[k].shape]
        if missing or wrong:
            first = f"'{missing[0]}' is missing" if missing else f"'{wrong[0]}' has the wrong shape"
            raise ModelLoadError(f"'{self.path}' does not fit {self.family.display_name} ({self.variant}): "
                                 f"{len(missing)} tensors missing, {len(wrong)} of the wrong shape; first: {first}")
        extra = sorted(set(self.tensors) - set(expected))
        if extra:
            raise ModelLoadError(f"'{self.path}' has {len(extra)} tensors {self.family.display_name} does not use, "
                                 f"first '{extra[0]}'; is this a {self.family.display_name} checkpoint?")
        model.load_state_dict(self.state_dict(dtype), strict=True, assign=True)
        model.requires_grad_(False)
        return model.eval()

    def fingerprint(self) -> dict[str, Any]:
        """Sizes, header hashes and sampled data: identifies the weights without reading them.

        ``key`` leaves out the path, so a moved checkpoint still finds its slab; it includes the decoder
        version when a decoding rule that changed applies to this file, so a slab built under the old rule
        is not reused (``legacy_key`` is the key the older rules gave)."""
        files = [{"name": f.path.name, "size": f.size, "header_sha256": f.header_sha256} for f in self.files]
        config_sha = hashlib.sha256(self.config_bytes).hexdigest() if self.config_bytes else None
        # Sampled data too: a fine-tune saved like its base has the same headers and sizes.
        ident = [[f["size"], f["header_sha256"], _sampled(f_obj)] for f, f_obj in zip(files, self.files)] + [config_sha]
        legacy = hashlib.sha256(json.dumps(ident).encode()).hexdigest()
        if any(t.scale_rule == "weight_scale" for t in self.store.entries.values()):
            ident.append({"decoder": DECODER_VERSION})
        headers = hashlib.sha256(b"".join(f.header_bytes for f in self.files)).hexdigest()
        return {
            "kind": self.kind,
            "path": str(self.path.resolve()),
            "size": sum(f["size"] for f in files),
            "header_sha256": headers,
            "files": files,
            "config_sha256": config_sha,
            "decoder_version": DECODER_VERSION,
            "key": hashlib.sha256(json.dumps(ident).encode()).hexdigest(),
            "legacy_key": legacy,
        }

    @property
    def stem(self) -> str:
        """A readable name for a slab file: the checkpoint's file or folder name."""
        return self.identity.form.readable_name(self.path)



def _sampled(f: SafetensorsFile) -> str:
    with open(f.path, "rb") as fh:
        return sampled_data_hash(fh, 8 + len(f.header_bytes), f.size).hex()
