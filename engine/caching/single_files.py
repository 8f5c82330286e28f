"""Caching from the single files ComfyUI users have, instead of a diffusers pipeline folder.

Flux.1 users keep ``models/text_encoders/clip_l.safetensors``, ``t5xxl_fp16.safetensors`` (or an
fp8 / scaled-fp8 file) and ``models/vae/ae.safetensors``. These carry weights only:

- architecture: the file's own companion folder (the file name without ``.safetensors``, beside
  it) may hold a ``config.json``; otherwise the shipped configs of the real models are used
  (``families/configs/text/clip_l.json``, ``t5xxl.json``, ``configs/vae/flux1/``: the configs of
  the FLUX.1-dev pipeline's text_encoder, text_encoder_2 and vae);
- tokenizer: the companion folder's tokenizer files, else a tokenizer folder the caller passes
  (inside ComfyUI the node passes ComfyUI's bundled ``sd1_tokenizer`` / ``t5_tokenizer``), else
  an error naming both places. Nothing is downloaded;
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
from safetensors import safe_open

from .. import families
from ..errors import ModelLoadError

CLIP_L, T5XXL = "clip_l", "t5xxl"
#: Flux.1's text-encoder specs by subfolder (families/flux1.py) and the file kind that fills each.
FLUX1_SPEC_FOR_KIND = {CLIP_L: "text_encoder", T5XXL: "text_encoder_2"}
_PREFIXES = ("text_encoders.clip_l.transformer.", "text_encoders.t5xxl.transformer.", "clip_l.transformer.",
             "t5xxl.transformer.", "cond_stage_model.transformer.")
_DROP = ("scaled_fp8", "logit_scale", "text_projection.weight", "transformer.text_projection.weight")
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "spiece.model", "tokenizer_config.json")


@dataclass
class SingleFileSources:
    """Where each piece comes from when there is no pipeline folder."""

    text_encoders: dict[str, Path]  # spec subfolder ("text_encoder", "text_encoder_2") -> file
    vae: Path | None = None
    tokenizer_dirs: dict[str, Path] = field(default_factory=dict)  # kind -> fallback tokenizer folder


def _keys(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as exc:  # safetensors' own error types
        raise ModelLoadError(f"'{path}' is not a readable safetensors file ({exc}); re-download it") from exc


def text_encoder_kind(path: Path) -> str:
    """``clip_l`` or ``t5xxl`` from the tensor names; other encoders get an error naming the fix."""
    keys = _keys(path)
    if any("embeddings.token_embedding" in k for k in keys):
        return CLIP_L
    if any("encoder.block.0.layer.0.SelfAttention" in k for k in keys):
        return T5XXL
    if any(".self_attn.q_proj." in k for k in keys):
        raise ModelLoadError(
            f"'{path}' is a decoder LLM text encoder (Mistral/Qwen3, Flux.2); single-file Flux.2 text encoders are "
            f"not supported yet: pick the Flux.2 diffusers pipeline folder in text_encoders")
    raise ModelLoadError(f"'{path}' is neither a CLIP-L nor a T5-XXL text encoder (first tensors: "
                         f"{', '.join(sorted(keys)[:3])}); Flux.1 needs clip_l.safetensors and t5xxl_fp16.safetensors")


def sources_for_flux1(files: list[Path], vae: Path | None, tokenizer_dirs: dict[str, Path] | None = None
                      ) -> SingleFileSources:
    by_spec: dict[str, Path] = {}
    for f in files:
        spec = FLUX1_SPEC_FOR_KIND[text_encoder_kind(f)]
        if spec in by_spec:
            raise ModelLoadError(f"'{by_spec[spec]}' and '{f}' are the same kind of text encoder; Flux.1 needs one "
                                 f"CLIP-L and one T5-XXL file")
        by_spec[spec] = f
    missing = [k for k, s in FLUX1_SPEC_FOR_KIND.items() if s not in by_spec]
    if missing:
        raise ModelLoadError(f"Flux.1 needs both text encoders as files; missing: {', '.join(missing)} "
                             f"(clip_l.safetensors, t5xxl_fp16.safetensors in models/text_encoders)")
    if vae is None:
        raise ModelLoadError("caching from single files also needs the VAE file (ae.safetensors in models/vae)")
    return SingleFileSources(by_spec, vae, dict(tokenizer_dirs or {}))


def companion_dir(path: Path) -> Path:
    """``models/text_encoders/t5xxl_fp16/`` beside ``t5xxl_fp16.safetensors``: optional config and tokenizer."""
    return path.with_name(path.name[: -len(".safetensors")] if path.name.endswith(".safetensors") else path.stem)


def _tokenizer_dir(path: Path, kind: str, fallback: dict[str, Path]) -> Path:
    own = companion_dir(path)
    if own.is_dir() and any((own / n).exists() for n in _TOKENIZER_FILES):
        return own
    if kind in fallback and fallback[kind].is_dir():
        return fallback[kind]
    raise ModelLoadError(
        f"no tokenizer for '{path.name}': a single-file text encoder carries none. Put the {kind} tokenizer files "
        f"(tokenizer.json, or vocab.json + merges.txt) in '{own}/', or run inside ComfyUI, whose bundled "
        f"tokenizers are used")


def _state_dict(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors with known prefixes stripped; scaled-fp8 weights times their scale; markers dropped."""
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        for key in keys:
            name = next((key[len(p):] for p in _PREFIXES if key.startswith(p)), key)
            if name in _DROP or name.endswith((".scale_weight", ".scale_input")):
                continue
            t = f.get_tensor(key)
            scale = key[: -len(".weight")] + ".scale_weight" if key.endswith(".weight") else None
            if scale in keys:
                t = t.to(torch.float32) * f.get_tensor(scale).to(torch.float32)
            out[name] = t.to(dtype) if t.is_floating_point() else t
    return out


def load_text_encoder_file(path: Path, dtype: torch.dtype, tokenizer_dirs: dict[str, Path]):
    """(tokenizer, model) for a CLIP-L or T5-XXL single file."""
    from transformers import AutoConfig, AutoTokenizer, CLIPTextModel, T5EncoderModel

    kind = text_encoder_kind(path)
    own = companion_dir(path)
    if (own / "config.json").exists():
        config = AutoConfig.from_pretrained(own, local_files_only=True)
    else:
        with resources.as_file(resources.files(families).joinpath("configs", "text", f"{kind}.json")) as cfg:
            config = AutoConfig.from_pretrained(cfg, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(_tokenizer_dir(path, kind, tokenizer_dirs), local_files_only=True)
    cls = CLIPTextModel if kind == CLIP_L else T5EncoderModel
    try:
        model = cls.from_pretrained(None, config=config, state_dict=_state_dict(path, dtype), dtype=dtype)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"'{path}' does not fit the {kind} architecture ({exc}); is it a {kind} file?") from exc
    return tokenizer, model.requires_grad_(False).eval()


def load_vae_file(path: Path, family, dtype: torch.dtype):
    """The family's VAE from a BFL/LDM single file (ComfyUI's models/vae/ae.safetensors)."""
    from diffusers import AutoencoderKL

    if family.vae_class_name != "AutoencoderKL":
        raise ModelLoadError(f"'{path}': single-file {family.display_name} VAEs are not supported yet; pick the "
                             f"{family.display_name} diffusers pipeline folder in text_encoders (it holds vae/)")
    own = companion_dir(path)
    try:
        if (own / "config.json").exists():
            vae = AutoencoderKL.from_single_file(str(path), config=str(own), torch_dtype=dtype, local_files_only=True)
        else:
            with resources.as_file(resources.files(families).joinpath("configs", "vae", "flux1")) as cfg:
                vae = AutoencoderKL.from_single_file(str(path), config=str(cfg), torch_dtype=dtype,
                                                     local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"'{path}' is not a Flux.1 VAE file this loader reads ({exc}); it expects ae.safetensors "
                             f"with BFL/LDM names (encoder.down.0.block.0...)") from exc
    return vae.requires_grad_(False).eval()
