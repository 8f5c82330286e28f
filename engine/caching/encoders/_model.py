"""The kinds whose encoder is one transformers model run whole (CLIP, T5, umT5): a pipeline folder's encoder
(``text_encoding.load_text_encoder``) or a single file's weights in the model class the kind names, its config
from the file's companion folder or the shipped one (``families/configs/text/<file_kind>.json``)."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

from ... import families
from ...errors import ModelLoadError
from ...hashing import path_identity
from ..single_files import companion_dir, load_tokenizer_of, text_encoder_state_dict, tokenizer_origin
from ..text_encoding import encode_captions
from . import TextEncoderKind


class EncoderModelKind(TextEncoderKind):
    #: The transformers class a single file's weights are loaded into ("T5EncoderModel").
    model_class: str

    def tokenizer_identity(self, path, spec, singles) -> str:
        origin = tokenizer_origin(path, self.file_kind, self.file_kind, singles.tokenizer_dirs)
        # An embedded tokenizer is part of the file, whose identity the text identity has already.
        return path_identity(origin) if isinstance(origin, Path) else f"embedded:{origin}"

    def load_config(self, path: Path):
        """The file's companion ``config.json``, else the shipped config of the real encoder."""
        from transformers import AutoConfig

        own = companion_dir(path)
        if (own / "config.json").exists():
            return AutoConfig.from_pretrained(own, local_files_only=True)
        with resources.as_file(resources.files(families).joinpath("configs", "text", f"{self.file_kind}.json")) as cfg:
            return AutoConfig.from_pretrained(cfg, local_files_only=True)

    def load_tokenizer(self, path: Path, tokenizer_dirs: dict[str, Path] | None):
        """``tokenizer_origin``'s tokenizer: the companion folder's, the embedded one, or ComfyUI's bundled one."""
        from transformers import AutoTokenizer

        tokenizer = load_tokenizer_of(path, self.file_kind, self.file_kind, tokenizer_dirs)
        return AutoTokenizer.from_pretrained(tokenizer, local_files_only=True) if isinstance(tokenizer, Path) \
            else tokenizer

    def load_file(self, path: Path, dtype: torch.dtype, tokenizer_dirs: dict[str, Path] | None):
        """(tokenizer, model) of a single file of this kind."""
        import transformers

        config = self.load_config(path)
        tokenizer = self.load_tokenizer(path, tokenizer_dirs)
        cls = getattr(transformers, self.model_class)
        try:
            # No file is opened here: the weights are the safetensors state dict read through the checkpoint reader.
            model = cls.from_pretrained(None, config=config, state_dict=text_encoder_state_dict(path, dtype),
                                        dtype=dtype)
        except (RuntimeError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"'{path}' does not fit the {self.file_kind} architecture ({exc}); is it a "
                                 f"{self.file_kind} file?") from exc
        _check_vocabulary(path, self.file_kind, tokenizer, model, tokenizer_dirs)
        return tokenizer, model.requires_grad_(False).eval()

    def encode(self, pipeline, singles, family, spec, captions, device, dtype, length, progress=None):
        loader = None
        if singles is not None:
            f = singles.text_encoders[spec.subfolder]
            loader = lambda: self.load_file(f, dtype, singles.tokenizer_dirs)  # noqa: E731
        return encode_captions(pipeline, spec, captions, device, dtype, length, progress=progress, loader=loader)


def _check_vocabulary(path: Path, file_kind: str, tokenizer, model, tokenizer_dirs) -> None:
    """A tokenizer with more tokens than the file's embedding table has rows is another model's (ComfyUI's bundled
    T5 tokenizer, 32100 tokens, beside a T5 file of a smaller vocabulary): its ids would index past the table
    mid-encode. Refused here, naming where the tokenizer came from and the fix. (Real files have at least as
    many rows as their tokenizer has tokens: T5-XXL 32128 for 32100, CLIP-L 49408 for 49408.)"""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) <= rows:
        return
    origin = tokenizer_origin(path, file_kind, file_kind, tokenizer_dirs)
    where = f"'{origin}'" if isinstance(origin, Path) else f"the tensor '{origin}' in the file"
    raise ModelLoadError(f"'{path.name}' ({path}): its tokenizer from {where} has {len(tokenizer)} tokens but the "
                         f"file's embedding table has {rows} rows, so that tokenizer is another model's. Put this "
                         f"text encoder's own tokenizer files (tokenizer.json + tokenizer_config.json, or "
                         f"spiece.model) in '{companion_dir(path)}/'")
