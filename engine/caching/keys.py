"""The keys phase of a cache build: what each entry depends on, hashed.

A caption's text key hashes the encoders' files (content identity), their tokenizers, the encoding settings and the
caption; a latent key hashes the VAE's files, the image's (or clip's) bytes, the bucket, the flip and a clip
window's frames. A rerun with the same inputs finds every entry again; a changed caption, image or model rebuilds
just that entry. These hashes are the addresses of caches on users' disks: change what goes in only with a
migration.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..families import default_max_sequence_length
from ..hashing import path_identity, stable_hash
from .encoders import encoder_kind
from .items import CachedItem, text_item
from .model_sources import CacheModels


@dataclass(frozen=True)
class CacheKeys:
    """The identities every key of one build starts from."""

    text: str  # the text encoders, their tokenizers and settings, the length, the dtype
    vae: str  # the VAE files, the dtype (and the VAE class when it is not AutoencoderKL)
    max_len: int  # the token length captions are encoded at

    def caption(self, caption: str) -> str:
        """The text key of a caption or a sample prompt."""
        return stable_hash([self.text, caption])

    def latent(self, content: str, bucket, flip: bool, frames: list[int] | None = None) -> str:
        """The latent key of an image (``frames`` None: image keys as before, so their caches stay valid) or of a
        clip window (its source frame indices)."""
        return stable_hash([self.vae, content, list(bucket), flip] + ([frames] if frames is not None else []))

    def mask(self, content: str, bucket, flip: bool, source: str, frames: list[int] | None = None) -> str:
        """The key of an image's loss mask: its file's content (the image's, for an alpha mask), the bucket, the
        flip and where it came from; a clip window's mask also its frames (``frames`` None: image keys as before). No
        model is in it: a mask is kept at the bucket's pixel size."""
        return stable_hash(["mask", content, list(bucket), flip, source] + ([frames] if frames is not None else []))

    def negative_prompt(self, text: str, specs) -> str:
        """The key of a sample prompt's own negative (``--n``), encoded as the empty prompt is (its templates)."""
        return stable_hash([self.text, text, [repr(s.negative_template) for s in specs], "negative"])

    def empty_prompt(self, specs) -> CachedItem:
        """The empty prompt classifier-free guidance samples against, tokenized as the family's pipeline does it
        (``negative_template``): its key names the templates."""
        return text_item("", stable_hash([self.text, "", [repr(s.negative_template) for s in specs]]))


def cache_keys(models: CacheModels, max_sequence_length: int = 0) -> CacheKeys:
    max_len = max_sequence_length or default_max_sequence_length(models.family, models.variant)
    specs = models.specs
    text = stable_hash([_encoder_ident(models, s) + encoder_kind(s.kind).cache_identity(s) for s in specs]
                       + [max_len, str(models.dtype)])
    vae_spec = models.family.vae_for(models.variant)
    vae_files = models.singles.vae if models.singles is not None else models.pipeline / "vae"
    vae = stable_hash([path_identity(vae_files), str(models.dtype)]
                      + ([vae_spec.class_name] if vae_spec.class_name != "AutoencoderKL" else []))
    condition = models.family.first_frame(models.variant)
    if condition is not None:  # an image-to-video entry also holds the first frame's conditioning
        vae = stable_hash([vae, list(condition.ident)] + ([path_identity(models.image_encoder_files())]
                                                          if condition.image_encoder is not None else []))
    return CacheKeys(text, vae, max_len)


def _encoder_ident(models: CacheModels, s) -> list:
    singles, pipeline, kind = models.singles, models.pipeline, encoder_kind(s.kind)
    if singles is not None:  # the file (content identity) and its tokenizer
        f = singles.text_encoders[s.subfolder]
        return [s.subfolder, path_identity(f), kind.tokenizer_identity(f, s, singles), kind.output]
    return [s.subfolder, path_identity(pipeline / s.subfolder), path_identity(pipeline / s.tokenizer_subfolder),
            kind.output]
