"""The sources phase of a cache build: which family and variant, and where its text encoders, tokenizers and VAE
come from (a diffusers pipeline folder, or the single files ComfyUI users keep), on which device and dtype."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..checkpoint import identify, resolve_path
from ..config import ModelConfig
from ..errors import ModelLoadError
from ..families import ModelFamily, get_family
from ..models import resolve_device, resolve_dtype
from .single_files import SingleFileSources, load_vae_file, sources_for


@dataclass
class CacheModels:
    """The models a cache is built with. Exactly one of ``pipeline`` (a diffusers folder) and ``singles`` (single
    text-encoder and VAE files) is set."""

    family: ModelFamily
    variant: str
    pipeline: Optional[Path]
    singles: Optional[SingleFileSources]
    device: torch.device
    dtype: torch.dtype

    @property
    def specs(self) -> tuple:
        return tuple(self.family.text_encoder_specs(self.variant))

    def load_vae(self):
        """The VAE the latents are encoded with, on the CPU."""
        if self.singles is not None:
            return load_vae_file(self.singles.vae, self.family, self.dtype, self.variant)
        from .vae_encoding import load_vae

        return load_vae(self.pipeline, self.dtype, self.family.vae_for(self.variant).class_name)

    def image_encoder_files(self) -> Path:
        """Where an image-to-video variant's image encoder comes from: the single file, else the pipeline's
        folder (``FirstFrameCondition.image_encoder``)."""
        spec = self.family.first_frame(self.variant).image_encoder
        if self.singles is not None:
            if self.singles.image_encoder is None:
                raise ModelLoadError(f"{self.family.display_name} ({self.variant}) also needs its image encoder: give "
                                     f"{spec.file_help} with the text-encoder files")
            return self.singles.image_encoder
        return self.pipeline / spec.subfolder

    def load_image_encoder(self):
        """(model, processor) of an image-to-video variant's image encoder, on the CPU."""
        from .image_encoder import load_image_encoder

        spec = self.family.first_frame(self.variant).image_encoder
        if self.singles is not None:
            return load_image_encoder(spec, self.dtype, file=self.image_encoder_files())
        return load_image_encoder(spec, self.dtype, pipeline=self.pipeline)


def open_models(model_cfg: ModelConfig, device: str = "auto") -> CacheModels:
    """The family, variant and model files a cache is built from: the single files when any is given, else the
    pipeline folder (``resolve_pipeline_folder``)."""
    dev = resolve_device(device)
    dtype = resolve_dtype(model_cfg.dtype, dev)
    if model_cfg.text_encoder_files or model_cfg.vae_file:
        singles, family, variant = _single_file_sources(model_cfg)  # every encoder and the VAE come from singles
        return CacheModels(family, variant, None, singles, dev, dtype)
    pipeline = resolve_pipeline_folder(model_cfg)
    family, variant = _family_and_variant(model_cfg, pipeline)
    return CacheModels(family, variant, pipeline, None, dev, dtype)


def resolve_pipeline_folder(model_cfg: ModelConfig) -> Path:
    """The diffusers pipeline folder whose text encoders, tokenizers and VAE we use."""
    if model_cfg.pipeline_path:
        folder = Path(model_cfg.pipeline_path).expanduser()
        if not (folder / "model_index.json").exists():
            raise ModelLoadError(
                f"pipeline_path '{folder}' is not a diffusers pipeline folder (no model_index.json); "
                f"it must hold text_encoder*/, tokenizer*/ and vae/"
            )
        return folder
    _, _, pipeline = resolve_path(model_cfg.transformer_path)
    if pipeline is None:
        raise ModelLoadError(
            f"'{model_cfg.transformer_path}' is a single transformer file; caching also needs the text encoders, "
            f"tokenizers and VAE of a diffusers pipeline folder (text_encoder*/, tokenizer*/, vae/). In Cache Text "
            f"Embeds, set text_encoders to a folder under models/diffusers (e.g. diffusers/FLUX.1-dev); "
            f"from Python, set ModelConfig.pipeline_path"
        )
    return pipeline


def _single_file_sources(model_cfg: ModelConfig):
    """(SingleFileSources, family, variant) for caching from single files (no pipeline folder);
    the family and variant come from the transformer itself."""
    ident = identify(model_cfg.transformer_path, model_cfg.family)
    family, variant = ident.family, ident.variant
    files = [Path(p) for p in model_cfg.text_encoder_files]
    vae = Path(model_cfg.vae_file) if model_cfg.vae_file else None
    singles = sources_for(family, variant, files, vae, {k: Path(v) for k, v in (model_cfg.tokenizer_dirs or {}).items()},
                          _single_checkpoint(ident))
    return singles, family, variant


def _single_checkpoint(ident) -> Optional[Path]:
    """The model's one-file checkpoint, for what an all-in-one file bundles beside the transformer (LTX-2.3's VAE
    and text connectors): the file itself, or the file a slab was built from (its manifest's source, where it still
    is); None for a folder."""
    if ident.kind == "single_file":
        return ident.path
    if ident.kind == "slab":
        from ..slab.load import read_manifest

        source = Path(read_manifest(ident.path).get("source", {}).get("path") or "")
        return source if source.is_file() and source.suffix == ".safetensors" else None
    return None


def _family_and_variant(model_cfg: ModelConfig, pipeline: Path) -> tuple[ModelFamily, str]:
    if (pipeline / "transformer" / "config.json").exists():
        ident = identify(pipeline / "transformer", model_cfg.family)
        return ident.family, ident.variant
    if model_cfg.family == "auto":
        raise ModelLoadError(f"cannot tell the model family of '{pipeline}'; set family explicitly")
    return get_family(model_cfg.family), "custom"
