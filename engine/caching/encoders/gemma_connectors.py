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
run on the projections, as ``LTX2TextConnectors.forward`` does. The pass fits the small card LTX-2.3 trains on (issue
39): the connectors (3.2B parameters) are never on the device whole (their projections stay on the host, their
blocks in the file; a hidden state's projection slices or one block visit it at a time), the fold and the
connectors run per chunk of captions, and the group is bounded by its accumulators (``_Projection``;
``engine/families/ltx2/test_text_vram.py`` measures what the device holds).

Single files (LTX-2.3), as ComfyUI's ``LTXAVTextEncoderLoader(text_encoder, ckpt_name)`` pairs them: Gemma from
``gemma_3_12B_it.safetensors`` / ``_fp8_scaled`` (``model.`` names, decoded by the checkpoint reader, run layer-major
the same way; its config from the companion folder or the shipped Gemma 3 12B one; its tokenizer the file's embedded
``spiece_model``, framed as Gemma's tokenizer with BOS and left padding), and the connectors plus the text projection
from the model's all-in-one checkpoint (``SingleFileSources.checkpoint``). Which names are where:
``engine/families/ltx2/comfy_files.py``. LTX-2.5's files are refused by name."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ...errors import ModelLoadError
from ...families.ltx2.comfy_files import COMFY_TEXT, GEMMA_FILES, connector_names, connectors_config
from ...hashing import path_identity, stable_hash
from ..embedded_tokenizer import SpieceLayout
from . import TextEncoderKind

#: Device memory for one group's fp32 projection accumulators (captions x tokens x (video + audio width) x 4 bytes),
#: the one part of the pass's VRAM that grows with the group: 59 captions at 1024 tokens. With one Gemma layer and a
#: chunk's activations beside it the pass stays near 2.5 GB (a 6 GB card); a bigger group would read Gemma's 23.5 GB
#: fewer times for long caption lists, at 25 MB of VRAM a caption.
_GROUP_BYTES = 1.5e9
#: Captions per chunk of Gemma's layers, of the fold and of the connectors' blocks: the fp32 temporaries and the
#: connectors' activations are this many captions', not the group's.
_CHUNK = 4


class GemmaConnectors(TextEncoderKind):
    kind = "gemma_connectors"
    file_kind = "gemma_connectors"
    display_name = "Gemma + text connectors (LTX-2)"
    output = "sequence"
    host_loads_whole = False  # Gemma runs layer-major from its memory map
    #: ComfyUI's Gemma 3 file embeds its tokenizer; Gemma's tokenizer puts <bos> first, no EOS, and LTX2Pipeline pads
    #: on the left. Keyed by the shipped Gemma config's name (``ComfyText.gemma``).
    spiece_layouts = {"gemma3-12b": SpieceLayout(bos=True, eos=False, padding_side="left", name="Gemma-3")}
    embedding_files = {"gemma3-12b": GEMMA_FILES[0]}

    def match(self, shapes):
        """A Gemma 3 language model: per-head q / k norms (not Gemma-2's) with Gemma's sandwich norms (not Qwen3's).
        More specific than ``decoder_lm``'s any-attention match; no other family reads Gemma 3."""
        layer = [k for k in shapes if ".layers.0." in k]
        return 2 if any(k.endswith("self_attn.q_norm.weight") for k in layer) and any(
            "pre_feedforward_layernorm" in k for k in layer) else 0

    def companion_folders(self, spec):
        # Counted whole beside one Gemma layer (3.2B parameters at full size): the projections are held, the blocks
        # read from the file one at a time.
        return ("connectors",)

    def checkpoint_companions(self, spec, names):
        return list(connector_names(names))  # the same, read from the all-in-one checkpoint

    def caption_length(self, spec, max_length):
        return spec.max_length  # the transformer always sees the spec's rows (text.py)

    def cache_identity(self, spec):
        return [spec.architecture, spec.max_length, "connectors"]

    def tokenizer_identity(self, path, spec, singles):
        """With single files: the tokenizer's origin and the checkpoint the connectors are read from (both change the
        cached rows; the Gemma file's own identity is in the key already)."""
        from ..single_files import tokenizer_origin

        comfy = _comfy_text(spec, singles)
        origin = tokenizer_origin(path, comfy.gemma, "", singles.tokenizer_dirs)
        return stable_hash([path_identity(origin) if isinstance(origin, Path) else f"embedded:{origin}",
                            path_identity(_checkpoint(singles, spec))])

    @torch.no_grad()
    def encode(self, pipeline, singles, family, spec, captions, device, dtype, length, progress=None):
        from ..layer_major import layer_major
        from ..stacked_text import _LayerPrefetcher, load_truncated_decoder

        if singles is not None:
            tokenizer, enc_dir, files, config, (connectors, read) = _single_file_sources(singles, family, spec, dtype)
        else:
            tokenizer, enc_dir, files, config, (connectors, read) = _folder_sources(pipeline, spec, dtype)
        tokenizer.padding_side = "left"  # as LTX2Pipeline sets it
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        layers = config.num_hidden_layers
        # The connectors never go to the device whole (_Projection moves what each step needs); the projections are
        # regrouped before Gemma's embeddings load, so their transient second copy does not meet them.
        proj = _Projection(_checked(connectors), read, layers + 1, config.hidden_size, device)
        del connectors
        # hidden_states[k]: the embeddings (k = 0), layer k's raw output, the last one after the final norm.
        model, weights = load_truncated_decoder(enc_dir, layers, dtype, files, config, final_norm=True)
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
                with layer_major(model, device, chunk_size=_CHUNK, load_layer=prefetch, host=torch.device("cpu")) as m:
                    m.norm.to("cpu")
                    taps = [m.embed_tokens] + [m.layers[i] for i in range(layers - 1)] + [m.norm]
                    hooks = [t.register_forward_hook(lambda _m, _a, o, k=k: proj.fold(k, o)) for k, t in enumerate(taps)]
                    try:
                        m(input_ids=tok.input_ids, attention_mask=tok.attention_mask, use_cache=False)
                    finally:
                        for h in hooks:
                            h.remove()
                for rows in proj.finish(dtype):
                    out += [row.to("cpu", dtype) for row in rows]
                if progress:
                    progress(len(out), len(captions))
        finally:
            prefetch.close()
            del model
        return out


def _folder_sources(pipeline, spec, dtype):
    """(tokenizer, Gemma folder, None, its text config, (connectors, read)) of a diffusers pipeline folder."""
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    from ...checkpoint.tensors import TensorStore, open_files
    from ..stacked_text import _text_config, load_tokenizer

    if pipeline is None:
        raise ModelLoadError("LTX-2 captions need the diffusers pipeline folder (text_encoder/, tokenizer/, "
                             "connectors/) or ComfyUI's Gemma file with the model's all-in-one checkpoint")
    enc_dir, conn_dir = pipeline / spec.subfolder, pipeline / "connectors"
    for d, what in ((enc_dir, "the Gemma text encoder"), (conn_dir, "the text connectors")):
        if not (d / "config.json").exists():
            raise ModelLoadError(f"'{d}' is missing: caching captions needs {what} of the diffusers pipeline "
                                 f"folder '{pipeline}'")
    files = sorted(conn_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"'{conn_dir}' has no .safetensors weights (pickles are never loaded)")
    store = TensorStore(open_files(files, "the text connectors"))
    connectors = _connectors_from(store, {n: n for n in store.names()}, LTX2TextConnectors.load_config(conn_dir),
                                  dtype, f"'{conn_dir}': its weights do not fit its config.json ({{}})")
    return load_tokenizer(pipeline / spec.tokenizer_subfolder), enc_dir, None, _text_config(enc_dir), connectors


def _comfy_text(spec, singles):
    comfy = COMFY_TEXT.get(spec.architecture)
    if comfy is None:
        raise ModelLoadError(f"'{singles.text_encoders[spec.subfolder]}': LTX-2.5's single text-encoder file "
                             f"(gemma4-12b-with-proj-ltx-2.5-bf16.safetensors) is not read here yet; give Cache Text "
                             f"Embeds the LTX-2.5 diffusers pipeline folder (text_encoder/, tokenizer/, connectors/)")
    return comfy


def _checkpoint(singles, spec):
    if singles.checkpoint is None:
        raise ModelLoadError(f"'{singles.text_encoders[spec.subfolder].name}' is Gemma alone: LTX-2.3's text "
                             f"connectors and text projection live in the model's all-in-one checkpoint "
                             f"(ltx-2.3-22b-dev.safetensors or ltx-2.3-22b-dev-fp8.safetensors), as ComfyUI's "
                             f"LTXAVTextEncoderLoader reads them. Load that file (models/checkpoints) in Load Quantized "
                             f"Slab (a slab built from it works while the file stays where it was), or give Cache "
                             f"Text Embeds the diffusers pipeline folder")
    return singles.checkpoint


def _single_file_sources(singles, family, spec, dtype):
    """(tokenizer, Gemma file, [file], text config, (connectors, read)) of ComfyUI's Gemma file and the all-in-one
    checkpoint: the config from the file's companion folder or the shipped one (``decoder_lm_source``, checked against
    the file's width), the tokenizer its companion folder's or the one it embeds."""
    from dataclasses import replace

    from ..single_files import _store, decoder_lm_source
    from ..stacked_text import load_tokenizer

    comfy = _comfy_text(spec, singles)
    path, checkpoint = singles.text_encoders[spec.subfolder], _checkpoint(singles, spec)
    files, config, tokenizer = decoder_lm_source(path, family, replace(spec, architecture=comfy.gemma),
                                                 singles.tokenizer_dirs)
    if isinstance(tokenizer, Path):
        tokenizer = load_tokenizer(tokenizer)
    store = _store(checkpoint)
    names = connector_names(store.names())
    if not names:
        raise ModelLoadError(f"'{checkpoint}' holds no text connectors (no 'model.diffusion_model.video_embeddings_"
                             f"connector.' tensors): LTX-2.3's all-in-one checkpoint (ltx-2.3-22b-dev*.safetensors) "
                             f"does; a transformer-only file does not")
    connectors = _connectors_from(store, {new: raw for raw, new in names.items()}, connectors_config(comfy.connectors),
                                  dtype, f"'{checkpoint}': its text connectors do not fit LTX-2's '{comfy.connectors}' "
                                  f"connectors ({{}}); is it the checkpoint of this model?")
    return tokenizer, path, files, config, connectors


def _connectors_from(store, stored: dict[str, str], config: dict, dtype, misfit: str):
    """(``LTX2TextConnectors`` of ``config``, ``read``): the module with its projections and registers read from
    ``store`` (``stored``: parameter name -> the store's name), its blocks' weights left in the file (4 GB at full
    size), ``read(name)`` giving one of them on the host when its block runs. Every tensor's name and shape is checked
    now (``misfit``: the error, ``{}`` the mismatch)."""
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    connectors = _init_empty(LTX2TextConnectors, config)
    expected = {n: tuple(t.shape) for n, t in connectors.state_dict().items()}
    shapes = store.shapes()
    problems = [f"missing {n}" for n in expected if n not in stored] + [f"unexpected {n}" for n in stored
                                                                        if n not in expected]
    problems += [f"{n} is {tuple(shapes[stored[n]])}, not {expected[n]}" for n in expected
                 if n in stored and tuple(shapes[stored[n]]) != expected[n]]
    if problems:
        raise ModelLoadError(misfit.format("; ".join(problems[:4]) + (" ..." if len(problems) > 4 else "")))
    connectors.load_state_dict({n: store.get(stored[n], dtype) for n in expected if ".transformer_blocks." not in n},
                               strict=False, assign=True)
    return connectors.eval(), lambda name: store.get(stored[name], dtype)


def _init_empty(cls, config):
    from accelerate import init_empty_weights

    with init_empty_weights():
        return cls.from_config(config)


def _checked(connectors):
    if not connectors.config.per_modality_projections:
        raise ModelLoadError("these are LTX-2.0's connectors (one shared projection after a masked mean over each "
                             "caption); this encoder folds LTX-2.3 / 2.5's per-token norm only")
    return connectors.eval()


class _Projection:
    """The connectors' feature extractor as a sum over Gemma's hidden states: for state k,
    ``rms_norm(h_k) * mask * sqrt(dim / D) @ W[:, k::K].T`` (the stack is (D, K) per token, flattened D-major), added
    into fp32 accumulators; ``finish`` adds the biases and runs the connectors' 1-D transformers.

    What is on the device, so that it fits a small card: the group's accumulators (25 MB a caption at full size,
    bounded by ``_GROUP_BYTES``), state k's two weight slices while it is folded (95 MB bf16), one chunk of captions'
    temporaries, and in ``finish`` one connector block (400 MB) beside the group's projected rows. The connectors
    (3.2B parameters) are not moved there: the projections' weights stay on the host, regrouped by state once
    (``W[:, k::K]`` contiguous: a per-fold copy of a strided slice would read the whole matrix 49 times a group); the
    blocks' stay in their file, each read and copied to the device once a group. The chunking keeps each element's
    ops and their order (fp32 sums in k order); only the matmuls' batch is a chunk of captions, not the group (equal
    on the CPU; a GPU's matmul kernel may round the last bit differently for another batch)."""

    def __init__(self, connectors, read, count: int, hidden: int, device, chunk: int = _CHUNK):
        """``read(name)``: the connectors' tensor ``name`` on the host (``_connectors_from``; the blocks' are read
        when they run)."""
        self.c, self.read, self.count, self.device, self.chunk = connectors, read, count, device, chunk
        config = connectors.config
        self.heads = []  # (weights by state (K, out, D), bias, scale) per modality, on the host
        for name, dim in (("video_text_proj_in", config.video_hidden_dim),
                          ("audio_text_proj_in", config.audio_hidden_dim)):
            lin = getattr(connectors, name)
            w = lin.weight.detach()
            by_state = w.reshape(w.shape[0], hidden, count).permute(2, 0, 1).contiguous()
            self.heads.append((by_state, None if lin.bias is None else lin.bias.detach(), math.sqrt(dim / hidden)))
            setattr(connectors, name, None)  # our own copy of the connectors: the host keeps the weight once
        self.width = sum(w.shape[1] for w, _, _ in self.heads)

    def start(self, mask: torch.Tensor) -> None:
        self.mask = mask.to(self.device)
        b, length = mask.shape
        self.spans = [(s, min(s + self.chunk, b)) for s in range(0, b, self.chunk)]
        # One accumulator per chunk: finish frees each as it is projected, so the rows never coexist with them whole.
        self.acc = [[torch.zeros(e - s, length, w.shape[1], device=self.device) for w, _, _ in self.heads]
                    for s, e in self.spans]

    def fold(self, k: int, output) -> None:
        states = output[0] if isinstance(output, tuple) else output  # the whole group's, on the host
        weights = [(w[k].to(self.device).float().T, scale) for w, _, scale in self.heads]
        for (s, e), acc in zip(self.spans, self.acc):
            h = states[s:e].to(self.device).float()  # exact: bf16 -> fp32
            normed = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + 1e-6) * self.mask[s:e, :, None]
            del h
            for a, (wt, scale) in zip(acc, weights):
                a += (normed * scale) @ wt

    def finish(self, dtype):
        """Yields each chunk's rows (the video connector's output, then the audio one's) on the device, in order."""
        biases = [0 if b is None else b.to(self.device).float() for _, b, _ in self.heads]
        video, audio, masks = [], [], []
        for i, (s, e) in enumerate(self.spans):
            acc, self.acc[i] = self.acc[i], None
            video.append((acc[0] + biases[0]).to(dtype))
            audio.append((acc[1] + biases[1]).to(dtype))
            del acc
            # LTX2TextConnectors.forward after its projections (diffusers 0.42.1 connectors.py).
            m = self.mask[s:e]
            masks.append((m.to(torch.int64) - 1).to(dtype).reshape(e - s, 1, -1, m.shape[-1]) * torch.finfo(dtype).max)
        self.acc = None
        video_masks = _block_major(self.c, "video_connector", self.read, video, list(masks), self.device)
        _block_major(self.c, "audio_connector", self.read, audio, masks, self.device)
        for i, (v, vm) in enumerate(zip(video, video_masks)):
            v = v * (vm < 1e-6).to(torch.int64).reshape(v.shape[0], v.shape[1], 1)
            rows = torch.cat([v, audio[i]], dim=-1)
            video[i] = audio[i] = v = None
            yield rows


def _block_major(connectors, name: str, read, states: list[torch.Tensor], masks: list[torch.Tensor],
                 device) -> list[torch.Tensor]:
    """The ``name`` connector's ``LTX2ConnectorTransformer1d.forward`` on chunks of captions (``states[i]``,
    ``masks[i]`` its additive mask), replaced in place by its output; returns the chunks' masks as forward returns
    them. Block-major: each block's weights are read (``read``) and copied to the device once a group and run on
    every chunk, so the host holds one block for a moment and the device one block and per-chunk activations (the
    whole group's rope and feed-forward activations would be GBs). The registers' step is diffusers' own forward
    with no blocks and no final norm; the blocks are called as forward calls them."""
    from torch.func import functional_call

    def on_device(module):
        return {n: t.to(device) for n, t in (*module.named_parameters(), *module.named_buffers())}

    connector = connectors.get_submodule(name)
    blocks, norm = connector.transformer_blocks, connector.norm_out
    connector.transformer_blocks, connector.norm_out = torch.nn.ModuleList(), torch.nn.Identity()
    try:
        registers = on_device(connector)  # the learnable registers, with the blocks out of the module
        for i, x in enumerate(states):
            states[i], masks[i] = functional_call(connector, registers, (x, masks[i]))
    finally:
        connector.transformer_blocks, connector.norm_out = blocks, norm
    # As forward makes it, once per chunk shape (the chunks share one but the last): not per block and chunk.
    ropes = {x.shape[:2]: connector.rope(x.shape[0], x.shape[1], device=x.device) for x in states}
    for b, block in enumerate(blocks):
        params = {n: read(f"{name}.transformer_blocks.{b}.{n}").to(device) for n, _ in block.named_parameters()}
        params.update({n: t.to(device) for n, t in block.named_buffers()})
        for i, x in enumerate(states):
            states[i] = functional_call(block, params, (x,), {"attention_mask": masks[i], "rotary_emb": ropes[x.shape[:2]]})
        del params
    params = on_device(norm)
    for i, x in enumerate(states):
        states[i] = functional_call(norm, params, (x,))
    return masks


KIND = GemmaConnectors()
