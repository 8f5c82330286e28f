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

Which file is which is told from its tensor names, so the two text-encoder inputs may be given
in either order. Flux.2's single-file text encoders and VAE are not supported yet (their errors
say to use the pipeline folder).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from .. import families
from ..checkpoint import TensorStore, open_files
from ..errors import ModelLoadError
from .embedded_tokenizer import EMBEDDED_TENSORS, embedded_tensor, tokenizer_from_tensor

CLIP_L, T5XXL, UMT5, DECODER_LM = "clip_l", "t5xxl", "umt5xxl", "decoder_lm"  # decoder_lm: Mistral3 / Qwen3 / ...
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


def _store(path: Path, prefixes: tuple[str, ...] = ()) -> TensorStore:
    """The file's tensors through the one checkpoint reader (decoding fp8 / scaled fp8 / comfy_quant)."""
    return TensorStore(open_files([path], "a text encoder or VAE"), prefixes)


def _keys(path: Path) -> list[str]:
    return _store(path).names()


def text_encoder_kind(path: Path) -> str:
    """``clip_l``, ``t5xxl``, ``umt5xxl`` or ``decoder_lm`` from the tensor names; other encoders get an error naming
    the fix. umT5 and T5 share every name; umT5 has a relative-attention bias in every layer, T5 in the first only
    (ComfyUI itself cannot tell them apart: its CLIPLoader type, "wan", says which; the vocabularies, 256384 and
    32128 rows of ``shared``, differ too but not in tiny models)."""
    keys = _keys(path)
    if any("embeddings.token_embedding" in k for k in keys):
        return CLIP_L
    if any("encoder.block.0.layer.0.SelfAttention" in k for k in keys):
        return UMT5 if any("encoder.block.1.layer.0.SelfAttention.relative_attention_bias" in k for k in keys) else T5XXL
    if any(".self_attn.q_proj." in k for k in keys):
        return DECODER_LM
    raise ModelLoadError(f"'{path}' is neither a CLIP-L, a T5-XXL nor a decoder-LLM text encoder (first tensors: "
                         f"{', '.join(sorted(keys)[:3])}); Flux.1 needs clip_l.safetensors and t5xxl_fp16.safetensors, "
                         f"Flux.2 its Mistral (dev) or Qwen3 (klein) file")


#: What fills each kind of text encoder a family names (``TextEncoderSpec.kind``): the kind of file.
FILE_KIND_FOR_SPEC = {"clip_pooled": CLIP_L, "t5": T5XXL, "umt5": UMT5, "decoder_lm": DECODER_LM}
_FILE_KIND_NAMES = {CLIP_L: "CLIP-L", T5XXL: "T5-XXL", UMT5: "umT5-XXL",
                    DECODER_LM: "decoder LLM (Mistral3 / Qwen3 / Gemma-2)"}


def sources_for(family, variant: str, files: list[Path], vae: Path | None,
                tokenizer_dirs: dict[str, Path] | None = None) -> SingleFileSources:
    """Which file fills which of the family's text encoders (told by the files' tensor names, so they may
    come in any order), and the VAE file."""
    specs = family.text_encoder_specs(variant)
    kinds = [(f, text_encoder_kind(f)) for f in files]
    needed = ", ".join(_FILE_KIND_NAMES[FILE_KIND_FOR_SPEC[s.kind]] for s in specs)
    by_spec: dict[str, Path] = {}
    for spec in specs:
        matches = [f for f, k in kinds if k == FILE_KIND_FOR_SPEC[spec.kind]]
        if len(matches) > 1:
            raise ModelLoadError(f"'{matches[0]}' and '{matches[1]}' are the same kind of text encoder; "
                                 f"{family.display_name} needs one file of each kind: {needed}")
        if not matches:
            got = ", ".join(f"{f.name} ({_FILE_KIND_NAMES[k]})" for f, k in kinds) or "none"
            raise ModelLoadError(f"{family.display_name} needs these text-encoder files: {needed}; missing a "
                                 f"{_FILE_KIND_NAMES[FILE_KIND_FOR_SPEC[spec.kind]]} file (got {got}; text encoders "
                                 f"go in models/text_encoders)")
        by_spec[spec.subfolder] = matches[0]
    extra = [f"{f.name} ({_FILE_KIND_NAMES[k]})" for f, k in kinds if f not in by_spec.values()]
    if extra:
        raise ModelLoadError(f"{', '.join(extra)}: not a text encoder {family.display_name} uses; it needs {needed}")
    if vae is None:
        raise ModelLoadError(f"caching from single files also needs {family.display_name}'s VAE file (models/vae)")
    return SingleFileSources(by_spec, vae, dict(tokenizer_dirs or {}))


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


#: The ComfyUI file that embeds each encoder's tokenizer (for messages).
_EMBEDDING_FILES = {UMT5: "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "gemma2-2b": "gemma_2_2b_fp16.safetensors",
                    "mistral3-small-24b": "mistral_3_small_flux2_bf16.safetensors"}


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
    name = embedded_tensor(_store(path), encoder)
    if name is not None:
        return name
    bundled = (tokenizer_dirs or {}).get(fallback_key) if fallback_key else None
    if bundled is not None and Path(bundled).is_dir():
        return Path(bundled)
    looked = " or ".join(f"'{t}'" for t in EMBEDDED_TENSORS)
    fixes = [f"put the text encoder's tokenizer files (tokenizer.json + tokenizer_config.json, or spiece.model) "
             f"in '{own}/'"]
    if encoder in _EMBEDDING_FILES:
        fixes.insert(0, f"use ComfyUI's own file ({_EMBEDDING_FILES[encoder]}), which embeds it")
    if not bundled and (fallback_key in (CLIP_L, T5XXL) or fallback_key.endswith("_tokenizer")):
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
    return tokenizer_from_tensor(origin, raw, encoder)


def _state_dict(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors with known prefixes stripped, decoded by the checkpoint reader (fp8 times its scale,
    whichever convention the file uses); quantization side tensors and unused ones dropped."""
    store = _store(path, _PREFIXES)
    return store.state_dict(dtype, skip=_DROP)


def load_text_encoder_file(path: Path, dtype: torch.dtype, tokenizer_dirs: dict[str, Path]):
    """(tokenizer, model) for a CLIP-L, T5-XXL or umT5-XXL single file (the tokenizer: ``tokenizer_origin``)."""
    from transformers import AutoConfig, AutoTokenizer, CLIPTextModel, T5EncoderModel, UMT5EncoderModel

    kind = text_encoder_kind(path)
    own = companion_dir(path)
    if (own / "config.json").exists():
        config = AutoConfig.from_pretrained(own, local_files_only=True)
    else:
        with resources.as_file(resources.files(families).joinpath("configs", "text", f"{kind}.json")) as cfg:
            config = AutoConfig.from_pretrained(cfg, local_files_only=True)
    tokenizer = load_tokenizer_of(path, kind, kind, tokenizer_dirs)
    if isinstance(tokenizer, Path):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    cls = {CLIP_L: CLIPTextModel, T5XXL: T5EncoderModel, UMT5: UMT5EncoderModel}[kind]
    try:
        # No file is opened here: the weights are the safetensors state dict read above.
        model = cls.from_pretrained(None, config=config, state_dict=_state_dict(path, dtype), dtype=dtype)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"'{path}' does not fit the {kind} architecture ({exc}); is it a {kind} file?") from exc
    return tokenizer, model.requires_grad_(False).eval()


def load_vae_file(path: Path, family, dtype: torch.dtype, variant: str | None = None):
    """The VAE of the family's ``variant`` from a single file (ComfyUI's models/vae/ae.safetensors; Flux.2's VAE
    file; Wan's): ``family.vae_for(variant).load_file``, given this file's companion folder and the one checkpoint
    reader."""
    vae = family.vae_for(variant).load_file(path, dtype, read=lambda p: _store(p).state_dict(), companion=companion_dir(path))
    return vae.requires_grad_(False).eval()
