"""Caching from the single files ComfyUI users have, instead of a diffusers pipeline folder.

Flux.1 users keep ``models/text_encoders/clip_l.safetensors``, ``t5xxl_fp16.safetensors`` (or an
fp8 / scaled-fp8 file) and ``models/vae/ae.safetensors``. These carry weights only:

- architecture: the file's own companion folder (the file name without ``.safetensors``, beside
  it) may hold a ``config.json``; otherwise the shipped configs of the real models are used
  (``families/configs/text/clip_l.json``, ``t5xxl.json``, ``configs/vae/flux1/``: the configs of
  the FLUX.1-dev pipeline's text_encoder, text_encoder_2 and vae);
- tokenizer (``tokenizer_origin``): the companion folder's tokenizer files, else the tokenizer the file
  embeds (ComfyUI's umT5-XXL and Gemma-2 files carry a ``spiece_model`` tensor, its Mistral file a
  ``tekken_model``: converted in ``embedded_tokenizer``), else a tokenizer folder the caller passes (inside
  ComfyUI the node passes ComfyUI's bundled ``sd1_tokenizer`` / ``t5_tokenizer`` / ``qwen25_tokenizer``),
  else an error naming the file, the tensors looked for and the places. Nothing is downloaded;
- the VAE (BFL/LDM key names) goes through diffusers' ``AutoencoderKL.from_single_file`` with the
  local config.

Which file is which is told from its tensor names by the text-encoder kinds (``encoders/``), so the
text-encoder inputs may be given in any order. An all-in-one checkpoint (LTX-2.3's) bundles pieces beside the
transformer: the VAE (``VaeSpec.checkpoint_prefix``: taken from the model's checkpoint when no VAE file is given, only
its tensors read) and text connectors (``SingleFileSources.checkpoint``, which the encoder kind reads). Flux.2's single-file text encoders and VAE are not supported yet (their errors
say to use the pipeline folder).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from .. import families
from ..checkpoint import SafetensorsFile, TensorStore, open_files
from ..errors import ModelLoadError
from .embedded_tokenizer import EMBEDDED_TENSORS, embedded_tensor, tokenizer_from_tensor
from .encoders import bundled_tokenizer, embedding_file, encoder_kind, kind_of_file, spiece_layout

_PREFIXES = ("text_encoders.clip_l.transformer.", "text_encoders.t5xxl.transformer.", "clip_l.transformer.",
             "t5xxl.transformer.", "cond_stage_model.transformer.")
_DROP = ("scaled_fp8", *EMBEDDED_TENSORS, "logit_scale", "text_projection.weight", "transformer.text_projection.weight")
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "spiece.model", "tokenizer_config.json")


@dataclass
class SingleFileSources:
    """Where each piece comes from when there is no pipeline folder."""

    text_encoders: dict[str, Path]  # spec subfolder ("text_encoder", "text_encoder_2") -> file
    vae: Path | None = None
    tokenizer_dirs: dict[str, Path] = field(default_factory=dict)  # kind -> fallback tokenizer folder
    image_encoder: Path | None = None  # an image-to-video model's image encoder (clip_vision_h.safetensors)
    #: The model's own single-file checkpoint (or the one its slab was built from), for what an all-in-one
    #: checkpoint bundles beside the transformer: LTX-2.3's VAE (``VaeSpec.checkpoint_prefix``) and text connectors.
    checkpoint: Path | None = None


def _store(path: Path, prefixes: tuple[str, ...] = ()) -> TensorStore:
    """The file's tensors through the one checkpoint reader (decoding fp8 / scaled fp8 / comfy_quant)."""
    return TensorStore(open_files([path], "a text encoder or VAE"), prefixes)


def text_encoder_kind(path: Path) -> str:
    """The file kind (``clip_l``, ``t5xxl``, ``umt5xxl``, ``decoder_lm``, ...) of a single text-encoder file, told by
    the text-encoder kinds from its tensor names (``encoders/``); a file of none is an error naming the fix."""
    return kind_of_file(path, _store(path).shapes()).file_kind


#: A tensor every CLIP vision tower file has (ComfyUI's ``clip_vision_h.safetensors``): what tells one apart from
#: the text encoders given beside it (image_encoder.py loads it).
_VISION_KEY = "vision_model.encoder.layers.0.self_attn.q_proj.weight"


def is_image_encoder_file(path: Path) -> bool:
    """Whether a single file is a CLIP vision tower (ComfyUI's ``clip_vision_h.safetensors``), by its names."""
    return _VISION_KEY in SafetensorsFile(path).entries


def sources_for(family, variant: str, files: list[Path], vae: Path | None,
                tokenizer_dirs: dict[str, Path] | None = None, checkpoint: Path | None = None) -> SingleFileSources:
    """Which file fills which of the family's text encoders (told by the files' tensor names, so they may
    come in any order), and the VAE file: the one given, else the model's ``checkpoint`` where it bundles the
    family's VAE (``VaeSpec.checkpoint_prefix``)."""
    specs = family.text_encoder_specs(variant)
    condition = family.first_frame(variant)
    image_encoder = None
    if condition is not None and condition.image_encoder is not None:  # given among the text encoders
        found = [f for f in files if is_image_encoder_file(f)]
        image_encoder = found[0] if found else None
        files = [f for f in files if f not in found]
    kinds = [(f, kind_of_file(f, _store(f).shapes())) for f in files]
    needed = ", ".join(encoder_kind(s.kind).display_name for s in specs)
    by_spec: dict[str, Path] = {}
    for spec in specs:
        wanted = encoder_kind(spec.kind)
        matches = [f for f, k in kinds if k is wanted]
        if len(matches) > 1:
            raise ModelLoadError(f"'{matches[0]}' and '{matches[1]}' are the same kind of text encoder; "
                                 f"{family.display_name} needs one file of each kind: {needed}")
        if not matches:
            got = ", ".join(f"{f.name} ({k.display_name})" for f, k in kinds) or "none"
            raise ModelLoadError(f"{family.display_name} needs these text-encoder files: {needed}; missing a "
                                 f"{wanted.display_name} file (got {got}; text encoders go in models/text_encoders)")
        by_spec[spec.subfolder] = matches[0]
    extra = [f"{f.name} ({k.display_name})" for f, k in kinds if f not in by_spec.values()]
    if extra:
        raise ModelLoadError(f"{', '.join(extra)}: not a text encoder {family.display_name} uses; it needs {needed}")
    prefix = family.vae_for(variant).checkpoint_prefix
    if vae is None and checkpoint is not None and prefix and any(
            k.startswith(prefix) for k in SafetensorsFile(checkpoint).entries):
        vae = checkpoint
    if vae is None:
        raise ModelLoadError(f"caching from single files also needs {family.display_name}'s VAE file (models/vae)"
                             + (f", or the model's all-in-one checkpoint, which bundles it under '{prefix}'"
                                if prefix else ""))
    return SingleFileSources(by_spec, vae, dict(tokenizer_dirs or {}), image_encoder, checkpoint)


def decoder_lm_source(path: Path, family=None, spec=None,
                      tokenizer_dirs: dict[str, Path] | None = None) -> tuple[list[Path], object, Path]:
    """(weight files, text config, tokenizer folder) of a single-file decoder-LLM text encoder. The config is
    the companion folder's ``config.json``, else the shipped config of the architecture the family's spec
    names (``spec.architecture``: the family folder's ``configs/text/`` first, then the shared one), checked
    against the file's width. The tokenizer: ``tokenizer_origin`` (the companion folder, the one the file embeds
    (ComfyUI's Mistral and Gemma-2 files), ComfyUI's bundled folder the spec names (``spec.comfyui_tokenizer``,
    found in ``tokenizer_dirs`` when running inside ComfyUI)); a folder is returned as its path."""
    from transformers import AutoConfig

    own = companion_dir(path)
    if (own / "config.json").exists():
        config = AutoConfig.from_pretrained(own, local_files_only=True)
        config = getattr(config, "text_config", None) or config
    else:
        shapes = _store(path).shapes()
        embed = next((k for k in shapes if k.endswith("embed_tokens.weight")), None)
        width = shapes[embed][1] if embed else None
        name = spec.architecture if spec is not None and spec.architecture else None
        if name is None:
            raise ModelLoadError(f"'{path}': no architecture is known for this text encoder; put its config.json in "
                                 f"'{own}/'")
        with resources.as_file(families.text_architecture_config(family, name)) as cfg:
            config = AutoConfig.from_pretrained(cfg, local_files_only=True)
        config = getattr(config, "text_config", None) or config
        if width != config.hidden_size:
            raise ModelLoadError(f"'{path}' is {width} wide, but {family.display_name}'s text encoder ({name}) is "
                                 f"{config.hidden_size} wide; is it the right text encoder for this model? (or put its "
                                 f"config.json in '{own}/')")
    key = spec.comfyui_tokenizer if spec is not None else ""
    encoder = spec.architecture if spec is not None else ""
    return [path], config, load_tokenizer_of(path, encoder, key, tokenizer_dirs)


def companion_dir(path: Path) -> Path:
    """``models/text_encoders/t5xxl_fp16/`` beside ``t5xxl_fp16.safetensors``: optional config and tokenizer."""
    return path.with_name(path.name[: -len(".safetensors")] if path.name.endswith(".safetensors") else path.stem)


def tokenizer_origin(path: Path, encoder: str, fallback_key: str = "",
                     tokenizer_dirs: dict[str, Path] | None = None) -> Path | str:
    """Where the tokenizer of the single-file text encoder ``path`` comes from: the companion folder's tokenizer
    files (a folder), else the tokenizer the file embeds (the tensor's name, ``embedded_tokenizer``), else the
    fallback folder ``tokenizer_dirs[fallback_key]`` (inside ComfyUI: its bundled folder). ``encoder``: the file's
    kind (``umt5xxl``, ...) or the spec's architecture (``gemma2-2b``, ...). Nothing found: an error naming the
    file, the tensors looked for and the fixes."""
    own = companion_dir(path)
    if own.is_dir() and any((own / n).exists() for n in _TOKENIZER_FILES):
        return own
    name = embedded_tensor(_store(path), spiece_layout(encoder))
    if name is not None:
        return name
    bundled = (tokenizer_dirs or {}).get(fallback_key) if fallback_key else None
    if bundled is not None and Path(bundled).is_dir():
        return Path(bundled)
    looked = " or ".join(f"'{t}'" for t in EMBEDDED_TENSORS)
    fixes = [f"put the text encoder's tokenizer files (tokenizer.json + tokenizer_config.json, or spiece.model) "
             f"in '{own}/'"]
    if embedding_file(encoder):
        fixes.insert(0, f"use ComfyUI's own file ({embedding_file(encoder)}), which embeds it")
    if not bundled and bundled_tokenizer(fallback_key):
        fixes.append("run inside ComfyUI, whose bundled tokenizers are used")
    raise ModelLoadError(f"no tokenizer for '{path.name}' ({path}): the file embeds none that fits this text encoder "
                         f"(looked for a {looked} tensor) and '{own}/' holds no tokenizer files. "
                         f"Fix: {'; or '.join(fixes)}")


def load_tokenizer_of(path: Path, encoder: str, fallback_key: str = "",
                      tokenizer_dirs: dict[str, Path] | None = None):
    """The tokenizer ``tokenizer_origin`` finds: a folder as its path (the caller loads it), an embedded one
    converted to a transformers tokenizer."""
    origin = tokenizer_origin(path, encoder, fallback_key, tokenizer_dirs)
    if isinstance(origin, Path):
        return origin
    raw = _store(path).get(origin).to(torch.uint8).contiguous().numpy().tobytes()
    return tokenizer_from_tensor(origin, raw, spiece_layout(encoder))


def text_encoder_state_dict(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors with known prefixes stripped, decoded by the checkpoint reader (fp8 times its scale,
    whichever convention the file uses); quantization side tensors and unused ones dropped."""
    store = _store(path, _PREFIXES)
    return store.state_dict(dtype, skip=_DROP)


def load_text_encoder_file(path: Path, dtype: torch.dtype, tokenizer_dirs: dict[str, Path]):
    """(tokenizer, model) of a single text-encoder file loaded whole (CLIP-L, T5-XXL, umT5-XXL, ...), by its kind
    (the tokenizer: ``tokenizer_origin``)."""
    return kind_of_file(path, _store(path).shapes()).load_file(path, dtype, tokenizer_dirs)


def tensors_under(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The file's tensors whose names start with ``prefix``, without it, decoded by the checkpoint reader (only
    those are read: an all-in-one checkpoint's VAE without its transformer)."""
    store = _store(path)
    return {k[len(prefix):]: store.get(k) for k in store.names() if k.startswith(prefix)}


def load_vae_file(path: Path, family, dtype: torch.dtype, variant: str | None = None):
    """The VAE of the family's ``variant`` from a single file (ComfyUI's models/vae/ae.safetensors; Flux.2's VAE
    file; Wan's; LTX-2.3's all-in-one checkpoint): ``family.vae_for(variant).load_file``, given this file's companion
    folder and the one checkpoint reader (``read(path, prefix="")``: ``tensors_under``)."""
    vae = family.vae_for(variant).load_file(path, dtype, read=tensors_under, companion=companion_dir(path))
    return vae.requires_grad_(False).eval()
