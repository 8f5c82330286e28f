"""A Gemma whose every hidden state feeds a pipeline's own text connectors (LTX-2.3 / 2.5): one (L, D) row per caption
from the connectors, as the family's pipeline computes it before its transformer (``LTX2Pipeline.encode_prompt`` +
``connectors``). What is cached, and why after the connectors: ``engine/families/ltx2/text.py``.

It reads a diffusers pipeline folder: ``text_encoder/`` (Gemma), ``tokenizer/`` and ``connectors/``. Gemma runs
layer-major from its memory map (``stacked_text.load_truncated_decoder`` and ``layer_major``: one layer in memory, each
read once per group of captions), and the stack of its 49 hidden states (385 MB a caption at full size) is never
built: the connectors' first step is a per-token RMS norm of each layer's state followed by one Linear over the
stacked features (``per_modality_projections``), which is a sum over layers, so each layer's state is normed, its
padding rows zeroed and folded into the video and audio projections as soon as the layer has run (fp32
accumulators, 25 MB a caption). Why our own loop: the pipeline's ``_get_gemma_prompt_embeds`` needs the whole
encoder in memory (24 GB bf16) and every caption's whole stack. After the last layer the connectors' 1-D transformers
run on the projections, as ``LTX2TextConnectors.forward`` does. Single files (ComfyUI's ``gemma_3_12B_it*``, whose
connectors sit in the model checkpoint) are refused by name."""
from __future__ import annotations

import math

import torch

from ...errors import ModelLoadError
from . import TextEncoderKind

#: Host memory for one group's fp32 projection accumulators (captions x tokens x (video + audio width) x 4 bytes).
_GROUP_BYTES = 2e9


class GemmaConnectors(TextEncoderKind):
    kind = "gemma_connectors"
    file_kind = "gemma_connectors"
    display_name = "Gemma + text connectors (LTX-2)"
    output = "sequence"
    host_loads_whole = False  # Gemma runs layer-major from its memory map

    def match(self, shapes):
        return 0  # a single Gemma file is a decoder LLM; this kind reads pipeline folders only

    def companion_folders(self, spec):
        return ("connectors",)  # held whole beside one Gemma layer (3.2B parameters at full size)

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
        from ..stacked_text import _LayerPrefetcher, load_tokenizer, load_truncated_decoder
        from ..layer_major import layer_major

        enc_dir, conn_dir = pipeline / spec.subfolder, pipeline / "connectors"
        for d, what in ((enc_dir, "the Gemma text encoder"), (conn_dir, "the text connectors")):
            if not (d / "config.json").exists():
                raise ModelLoadError(f"'{d}' is missing: caching captions needs {what} of the diffusers pipeline "
                                     f"folder '{pipeline}'")
        tokenizer = load_tokenizer(pipeline / spec.tokenizer_subfolder)
        tokenizer.padding_side = "left"  # as LTX2Pipeline sets it
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        connectors = _connectors(conn_dir, dtype, device)
        from ..stacked_text import _text_config

        layers = _text_config(enc_dir).num_hidden_layers
        # hidden_states[k]: the embeddings (k = 0), layer k's raw output, the last one after the final norm.
        model, weights = load_truncated_decoder(enc_dir, layers, dtype, final_norm=True)
        proj = _Projection(connectors, layers + 1, model.config.hidden_size, device)
        group = max(1, int(_GROUP_BYTES // (length * proj.width * 4)))
        out: list[torch.Tensor] = []
        prefetch = _LayerPrefetcher(weights, model.layers[0], layers, dtype, pin=device.type == "cuda")
        try:
            for start in range(0, len(captions), group):
                tok = tokenizer([c.strip() for c in captions[start:start + group]], padding="max_length",
                                max_length=length, truncation=True, add_special_tokens=True, return_tensors="pt")
                if start:
                    prefetch.pending.clear()
                proj.start(tok.attention_mask)
                with layer_major(model, device, chunk_size=4, load_layer=prefetch, host=torch.device("cpu")) as m:
                    m.norm.to("cpu")
                    taps = [m.embed_tokens] + [m.layers[i] for i in range(layers - 1)] + [m.norm]
                    hooks = [t.register_forward_hook(lambda _m, _a, o, k=k: proj.fold(k, o)) for k, t in enumerate(taps)]
                    try:
                        m(input_ids=tok.input_ids, attention_mask=tok.attention_mask, use_cache=False)
                    finally:
                        for h in hooks:
                            h.remove()
                out += [row.to("cpu", dtype) for row in proj.finish(dtype)]
                if progress:
                    progress(len(out), len(captions))
        finally:
            prefetch.close()
            del model
        return out


def _connectors(conn_dir, dtype, device):
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    connectors = LTX2TextConnectors.from_pretrained(conn_dir, torch_dtype=dtype, use_safetensors=True,
                                                    local_files_only=True).eval()
    if not connectors.config.per_modality_projections:
        raise ModelLoadError(f"'{conn_dir}' holds LTX-2.0's connectors (one shared projection after a masked mean "
                             f"over each caption); this encoder folds LTX-2.3 / 2.5's per-token norm only")
    return connectors.to(device)


class _Projection:
    """The connectors' feature extractor as a sum over Gemma's hidden states: for state k,
    ``rms_norm(h_k) * mask * sqrt(dim / D) @ W[:, k::K].T`` (the stack is (D, K) per token, flattened D-major), added
    into fp32 accumulators; ``finish`` adds the biases and runs the connectors' 1-D transformers."""

    def __init__(self, connectors, count: int, hidden: int, device):
        self.c, self.count, self.hidden, self.device = connectors, count, hidden, device
        self.heads = [(connectors.video_text_proj_in, math.sqrt(connectors.config.video_hidden_dim / hidden)),
                      (connectors.audio_text_proj_in, math.sqrt(connectors.config.audio_hidden_dim / hidden))]
        self.width = sum(lin.out_features for lin, _ in self.heads)

    def start(self, mask: torch.Tensor) -> None:
        self.mask = mask.to(self.device)
        b, length = mask.shape
        self.acc = [torch.zeros(b, length, lin.out_features, device=self.device) for lin, _ in self.heads]

    def fold(self, k: int, output) -> None:
        h = (output[0] if isinstance(output, tuple) else output).to(self.device, torch.float32)
        normed = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + 1e-6) * self.mask[..., None]
        for acc, (lin, scale) in zip(self.acc, self.heads):
            acc += (normed * scale) @ lin.weight[:, k::self.count].float().T

    def finish(self, dtype) -> torch.Tensor:
        (video_lin, _), (audio_lin, _) = self.heads
        video, audio = ((acc + (lin.bias.float() if lin.bias is not None else 0)).to(dtype)
                        for acc, (lin, _) in zip(self.acc, self.heads))
        # LTX2TextConnectors.forward after its projections (diffusers 0.42.1 connectors.py).
        add_mask = ((self.mask.to(torch.int64) - 1).to(dtype).reshape(self.mask.shape[0], 1, -1, self.mask.shape[-1])
                    * torch.finfo(dtype).max)
        video, video_mask = self.c.video_connector(video, add_mask)
        video = video * (video_mask < 1e-6).to(torch.int64).reshape(video.shape[0], video.shape[1], 1)
        audio, _ = self.c.audio_connector(audio, add_mask)
        self.acc = None
        return torch.cat([video, audio], dim=-1)


KIND = GemmaConnectors()
