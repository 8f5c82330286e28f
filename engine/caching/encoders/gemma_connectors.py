"""A Gemma whose every hidden state feeds a pipeline's own text connectors (LTX-2.3 / 2.5): one (L, D) row per caption
from the connectors, as the family's pipeline computes it before its transformer (``LTX2Pipeline.encode_prompt`` +
``connectors``). What is cached, and why after the connectors: ``engine/families/ltx2/text.py``.

It reads a diffusers pipeline folder: ``text_encoder/`` (Gemma, with its vision tower, as the hub ships it),
``tokenizer/`` and ``connectors/``. The encoder is loaded whole and captions run a few at a time (the stacked states
of one caption are 1024 x 3840 x 49 values: 385 MB bf16), each group's stack going through the connectors at once.
Single files (ComfyUI's ``gemma_3_12B_it*.safetensors``, whose connectors sit in the model checkpoint) are refused by
name."""
from __future__ import annotations

import json

import torch

from ...errors import ModelLoadError
from . import TextEncoderKind

#: Captions per Gemma forward: their stacked states (385 MB each at full size) wait for the connectors.
GROUP = 4


class GemmaConnectors(TextEncoderKind):
    kind = "gemma_connectors"
    file_kind = "gemma_connectors"
    display_name = "Gemma + text connectors (LTX-2)"
    output = "sequence"
    host_loads_whole = True

    def match(self, shapes):
        return 0  # a single Gemma file is a decoder LLM; this kind reads pipeline folders only

    def caption_length(self, spec, max_length):
        return spec.max_length  # the transformer always sees the spec's rows (text.py)

    def cache_identity(self, spec):
        return [spec.architecture, spec.max_length, "connectors"]

    def tokenizer_identity(self, path, spec, singles):
        return ""

    @torch.no_grad()
    def encode(self, pipeline, singles, family, spec, captions, device, dtype, length, progress=None):
        if singles is not None or pipeline is None:
            raise ModelLoadError(f"{family.display_name} captions are encoded by Gemma and the model's text "
                                 f"connectors together, read from a diffusers pipeline folder (text_encoder/, "
                                 f"tokenizer/, connectors/); single text-encoder files are not supported: give "
                                 f"Cache Text Embeds the pipeline folder")
        tokenizer, encoder, connectors = _load(pipeline, spec, dtype, device)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        out: list[torch.Tensor] = []
        for start in range(0, len(captions), GROUP):
            group = [c.strip() for c in captions[start:start + GROUP]]
            tok = tokenizer(group, padding="max_length", max_length=length, truncation=True, add_special_tokens=True,
                            return_tensors="pt")
            ids, mask = tok.input_ids.to(device), tok.attention_mask.to(device)
            states = encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
            stacked = torch.stack(states, dim=-1).flatten(2, 3).to(dtype)  # (B, L, D * layers), as the pipeline
            del states
            video, audio, _ = connectors(stacked, mask, padding_side="left")
            out += [row.to("cpu", dtype) for row in torch.cat([video, audio], dim=-1)]
            if progress:
                progress(len(out), len(captions))
        return out


def _load(pipeline, spec, dtype, device):
    import transformers
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from transformers import AutoTokenizer

    enc_dir, tok_dir, conn_dir = pipeline / spec.subfolder, pipeline / spec.tokenizer_subfolder, pipeline / "connectors"
    for d, what in ((enc_dir, "the Gemma text encoder"), (tok_dir, "its tokenizer"), (conn_dir, "the text connectors")):
        if not (d / ("config.json" if d is not tok_dir else "tokenizer_config.json")).exists():
            raise ModelLoadError(f"'{d}' is missing: caching captions needs {what} of the diffusers pipeline folder "
                                 f"'{pipeline}'")
    arch = json.loads((enc_dir / "config.json").read_text()).get("architectures", ["Gemma3ForConditionalGeneration"])[0]
    cls = getattr(transformers, arch, None)
    if cls is None:
        raise ModelLoadError(f"'{enc_dir}': text encoder class {arch!r} is not in this transformers version")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    encoder = cls.from_pretrained(enc_dir, torch_dtype=dtype, use_safetensors=True, local_files_only=True)
    connectors = LTX2TextConnectors.from_pretrained(conn_dir, torch_dtype=dtype, use_safetensors=True,
                                                    local_files_only=True)
    return tokenizer, encoder.to(device).eval(), connectors.to(device).eval()


KIND = GemmaConnectors()
