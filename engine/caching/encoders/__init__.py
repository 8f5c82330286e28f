"""The kinds of text encoder a family may name (``TextEncoderSpec.kind``), one file each, found by file name.

Every module in this folder (but those starting with ``_``) defines ``KIND``, a ``TextEncoderKind``: what one
caption becomes (``output``), how a single file of it is told apart by its tensors, where its config and
tokenizer come from, what of the spec goes into the cache key, and how captions are encoded. The cache build,
the single-file matching and the embedded-tokenizer lookup ask the kind, so a new kind of encoder is a new file
here and no list elsewhere names the kinds. Found by ``pkgutil`` when first asked, as families are.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from ...discovery import discover
from ...errors import ConfigError, ModelLoadError

if TYPE_CHECKING:
    from ...families import ModelFamily, TextEncoderSpec
    from ..embedded_tokenizer import SpieceLayout
    from ..single_files import SingleFileSources

#: What one caption becomes: one vector (D,), one per token (L, D), or hidden states stacked per token (L, K * D).
OUTPUTS = ("pooled", "sequence", "stacked")


class TextEncoderKind(ABC):
    """One kind of text encoder. ``kind`` is the string families write in ``TextEncoderSpec.kind``;
    ``file_kind`` names a single file of it (``clip_l``: the shipped config ``configs/text/<file_kind>.json``,
    the key of ComfyUI's bundled tokenizer folder in ``tokenizer_dirs``, the tokenizer layout's name)."""

    kind: str
    file_kind: str
    display_name: str  # in messages: "T5-XXL"
    output: str  # one of OUTPUTS
    #: SentencePiece layouts of the tokenizers ComfyUI's files of this kind embed, by encoder name (the file kind,
    #: or a spec's ``architecture``): how the pipeline's tokenizer frames an encoding (``embedded_tokenizer``).
    spiece_layouts: dict[str, SpieceLayout] = {}
    #: ComfyUI's file that embeds the tokenizer, by encoder name (for the message when none is found).
    embedding_files: dict[str, str] = {}
    #: ComfyUI bundles a tokenizer for this kind (``tokenizer_dirs[file_kind]`` inside ComfyUI).
    comfyui_bundles_tokenizer: bool = False
    #: The encoder is read into host memory whole while it encodes (False: layer by layer from the file's memory map).
    #: The caching pass's RAM check counts it so (``caching/ram.py``).
    host_loads_whole: bool = True

    @abstractmethod
    def match(self, shapes: dict[str, tuple[int, ...]]) -> int:
        """How specifically a single file's tensors (name -> shape) are of this kind: 0 not at all, higher is more
        specific (the most specific kind that matches a file wins; two at the same level are an error)."""

    def caption_length(self, spec: TextEncoderSpec, max_length: int) -> int:
        """Tokens a caption is encoded at: the run's sequence length (a pooled encoder keeps its own)."""
        return max_length

    def cache_identity(self, spec: TextEncoderSpec) -> list:
        """What of the spec, beyond its folder, file, tokenizer and output, changes the cached embedding."""
        return []

    def companion_folders(self, spec: TextEncoderSpec) -> tuple[str, ...]:
        """Pipeline subfolders beside the encoder that it holds in host memory whole while it encodes (LTX-2's
        text connectors): the caching pass's RAM check counts them with the encoder (``caching/ram.py``)."""
        return ()

    def checkpoint_companions(self, spec: TextEncoderSpec, names: list[str]) -> list[str]:
        """With single files: the tensors of the model's all-in-one checkpoint (``names``: all of its tensors) that
        the encoder holds whole beside it (LTX-2.3's text connectors), for the caching pass's RAM check."""
        return []

    @abstractmethod
    def tokenizer_identity(self, path: Path, spec: TextEncoderSpec, singles: SingleFileSources) -> str:
        """The identity of the tokenizer a single file ``path`` is encoded with (part of the cache key)."""

    def load_file(self, path: Path, dtype: torch.dtype, tokenizer_dirs: dict[str, Path] | None):
        """(tokenizer, model) of a single file of this kind, loaded whole."""
        raise ModelLoadError(f"'{path}' is a {self.display_name} file, which is run layer by layer from its memory "
                             f"map, not loaded whole")

    @abstractmethod
    def encode(self, pipeline: Path | None, singles: SingleFileSources | None, family: ModelFamily,
               spec: TextEncoderSpec, captions: list[str], device: torch.device, dtype: torch.dtype, length: int,
               progress: Callable[[int, int], None] | None = None) -> list[torch.Tensor]:
        """One tensor per caption, on the CPU, from the pipeline folder's encoder or (``singles``) the file of
        ``spec.subfolder``."""


_FOUND: dict[str, TextEncoderKind] = {}


def encoder_kinds() -> dict[str, TextEncoderKind]:
    """kind -> handler, every module of this folder, in file-name order."""
    if not _FOUND:
        from . import __name__ as package, __path__ as here

        found = discover(package, here, "KIND", lambda k: k.kind, "text-encoder kinds")
        for kind in found.values():
            if kind.output not in OUTPUTS:
                raise RuntimeError(f"text-encoder kind {kind.kind!r} has output {kind.output!r}, not one of {OUTPUTS}")
        _FOUND.update(found)
    return _FOUND


def encoder_kind(kind: str) -> TextEncoderKind:
    """The handler of ``TextEncoderSpec.kind`` ``kind``."""
    try:
        return encoder_kinds()[kind]
    except KeyError:
        raise ConfigError(f"unknown text-encoder kind {kind!r}; one of: {', '.join(encoder_kinds())} "
                          f"(engine/caching/encoders/)") from None


def kind_of_file(path: Path, shapes: dict[str, tuple[int, ...]]) -> TextEncoderKind:
    """The kind a single text-encoder file is, from its tensors (``shapes``: name -> shape); an error naming the
    kinds known when none matches."""
    scored = sorted(((k.match(shapes), k) for k in encoder_kinds().values()), key=lambda s: -s[0])
    best = scored[0][0] if scored else 0
    if best <= 0:
        names = ", ".join(k.display_name for k in encoder_kinds().values())
        raise ModelLoadError(f"'{path}' is none of the text encoders known ({names}; first tensors: "
                             f"{', '.join(sorted(shapes)[:3])}); Flux.1 needs clip_l.safetensors and "
                             f"t5xxl_fp16.safetensors, Flux.2 its Mistral (dev) or Qwen3 (klein) file")
    tied = [k for s, k in scored if s == best]
    if len(tied) > 1:
        raise RuntimeError(f"'{path}' matches the text-encoder kinds {', '.join(k.kind for k in tied)} equally; "
                           f"one of them must match it more specifically")
    return tied[0]


def spiece_layout(encoder: str) -> SpieceLayout | None:
    """The SentencePiece layout of the encoder named ``encoder`` (a file kind or a spec's architecture), if a kind
    declares one."""
    return next((k.spiece_layouts[encoder] for k in encoder_kinds().values() if encoder in k.spiece_layouts),
                None)


def embedding_file(encoder: str) -> str:
    """ComfyUI's file that embeds the tokenizer of ``encoder``, or ""."""
    return next((k.embedding_files[encoder] for k in encoder_kinds().values() if encoder in k.embedding_files),
                "")


def bundled_tokenizer(fallback_key: str) -> bool:
    """Whether ComfyUI bundles the tokenizer ``tokenizer_dirs[fallback_key]`` names."""
    return fallback_key.endswith("_tokenizer") or any(
        k.comfyui_bundles_tokenizer and k.file_kind == fallback_key for k in encoder_kinds().values())
