"""Caption -> text embeddings, with each encoder loaded from a local pipeline folder.

Encoders are loaded one at a time, used for every caption, then freed: they are
never resident together, and never beside the transformer. On a GPU they run
layer-major (see layer_major.py), so a 9.5 GB T5-XXL needs one layer of VRAM.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..errors import ModelLoadError, safetensors_only_message
from ..models.dtypes import release_device_memory
from ..families import TextEncoderSpec
from .encoders import encoder_kind
from .layer_major import layer_major


def load_text_encoder(pipeline: Path, spec: TextEncoderSpec, dtype: torch.dtype):
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    enc_dir, tok_dir = pipeline / spec.subfolder, pipeline / spec.tokenizer_subfolder
    for d, what in ((enc_dir, "text encoder"), (tok_dir, "tokenizer")):
        if not (d / "config.json").exists() and not (d / "tokenizer_config.json").exists():
            raise ModelLoadError(
                f"{what} folder '{d}' is missing; caching needs a diffusers pipeline folder with "
                f"{spec.subfolder}/ and {spec.tokenizer_subfolder}/ (single-file text encoders carry no tokenizer)"
            )
    tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    # The saved architecture (T5EncoderModel, CLIPTextModel, ...), not AutoModel, which
    # would build a full encoder-decoder T5 around an encoder-only checkpoint.
    config = AutoConfig.from_pretrained(enc_dir, local_files_only=True)
    arch = (config.architectures or [""])[0]
    cls = getattr(transformers, arch, None)
    if cls is None:
        raise ModelLoadError(f"text encoder in '{enc_dir}' has unknown architecture {arch!r}")
    try:  # use_safetensors: a pickle .bin beside (or instead of) the weights is never loaded
        model = cls.from_pretrained(enc_dir, dtype=dtype, local_files_only=True, use_safetensors=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(safetensors_only_message(enc_dir, "text encoder", exc)) from None
    model.requires_grad_(False).eval()
    return tokenizer, model


def _run_encoder(model, spec: TextEncoderSpec, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if spec.length == "zero_padded":  # the encoder sees the mask; the padding rows become zeros (Wan's umT5)
        out = model(input_ids=input_ids, attention_mask=mask, output_hidden_states=False).last_hidden_state
        return out.masked_fill(mask[..., None] == 0, 0.0)
    out = model(input_ids=input_ids, output_hidden_states=False)
    if encoder_kind(spec.kind).output == "pooled":
        return out.pooler_output  # (N, D)
    return out.last_hidden_state  # (N, L, D)


@torch.no_grad()
def encode_captions(
    pipeline: Path | None,
    spec: TextEncoderSpec,
    captions: list[str],
    device: torch.device,
    dtype: torch.dtype,
    max_length: int,
    group_size: int = 32,
    progress: Callable[[int, int], None] | None = None,
    loader: Callable[[], tuple] | None = None,
) -> list[torch.Tensor]:
    """One tensor per caption ((D,) pooled or (L, D) sequence), on the CPU. ``loader()`` gives the
    (tokenizer, model) when they do not come from ``pipeline`` (single files)."""
    tokenizer, model = loader() if loader is not None else load_text_encoder(pipeline, spec, dtype)
    results: list[torch.Tensor] = []
    try:
        for start in range(0, len(captions), group_size):
            group = captions[start:start + group_size]
            tokens = tokenizer(group, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
            ids, mask = tokens.input_ids, tokens.attention_mask
            if device.type == "cuda":
                with layer_major(model, device):
                    out = _run_encoder(model, spec, ids, mask)
            else:
                out = _run_encoder(model.to(device), spec, ids.to(device), mask.to(device))
            results += [row.detach().to("cpu").clone() for row in out]
            if progress:
                progress(len(results), len(captions))
    finally:
        del model
        release_device_memory(device)
    return results
