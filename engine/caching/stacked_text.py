"""Decoder-LLM text embeddings (a ``decoder_lm`` TextEncoderSpec): hidden states, layer-major, read from the mmap.

Families name the hidden states they keep and how captions are templated (their ``TextEncoderSpec``).
Flux.2-dev conditions on Mistral-Small-3.x 24B (hidden states after 10, 20 and 30 decoder
layers, concatenated per token: (512, 15360)); klein on Qwen3 4B/8B (after 9, 18, 27). The
prompt is wrapped and padded exactly as diffusers' pipelines do
(``Flux2Pipeline._get_mistral_3_small_prompt_embeds``,
``Flux2KleinPipeline._get_qwen3_prompt_embeds``, diffusers 0.42.1); Z-Image on Qwen3-4B's
``hidden_states[-2]`` and Lumina 2 on Gemma-2-2B's, each caption at its own length.

How it runs, so a 48 GB encoder never has to fit anywhere:

- the decoder is built on the meta device with only ``max(hidden_layers)`` layers: layers
  past the last needed one (Mistral 31-39) are never read from disk;
- only the embedding table is loaded up front; each layer's weights are read from the
  safetensors memory map straight onto the compute device when that layer runs, and
  dropped afterwards (host RAM: the embeddings, one layer in flight, the activations);
- layer-major (``layer_major.py``): every caption of a group goes through layer i before
  layer i+1 starts, so each layer is read once per group, and the group is as large as a
  host-memory budget for activations allows (all captions of a typical dataset);
- the model's own forward runs on the host (masks, rotary embeddings as transformers makes
  them), so the result equals a full forward's ``hidden_states[k]``; the final norm is
  replaced by an identity, unless the spec keeps the normed last state (``final_norm``: Qwen-Image's
  ``hidden_states[-1]``), when its weight is read and it runs on the last layer's output.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..checkpoint import TensorStore, open_files
from ..errors import ModelLoadError
from ..families import TextEncoderSpec
from ..models.dtypes import release_device_memory
from .layer_major import layer_major

#: Where a decoder's layers live in the checkpoints we accept, tried in order: transformers 5
#: ``Mistral3ForConditionalGeneration`` (``model.language_model.``), its 4.x layout
#: (``language_model.model.``), ``Qwen3VLModel`` as transformers 5 saves it (``language_model.``: Krea2Pipeline's
#: text encoder), ``Qwen3ForCausalLM`` and ComfyUI's text-encoder files (``model.``).
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.", "")
#: Host memory for one group's activations (captions x tokens x width x 2 bytes, a few copies).
_GROUP_BYTES = 4e9
#: Hidden states of a whole group kept on the GPU between layers when at most this big (the layer
#: in flight, its input and output and one chunk's working set stay under ~3 GB for Mistral-24B).
_DEVICE_ACTIVATION_BYTES = 0.7e9


def _text_config(encoder_dir: Path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(encoder_dir, local_files_only=True)
    return getattr(config, "text_config", None) or config


class _ShardedWeights:
    """A decoder's tensors across a folder's shards or one file, through the one checkpoint reader (so fp8
    and ComfyUI's scaled files decode with their scales); reads one tensor at a time."""

    def __init__(self, files: list[Path]):
        opened = open_files(files, "the text encoder")
        keys = {k for f in opened for k in f.entries}
        self.prefix = next((p for p in _PREFIXES if f"{p}embed_tokens.weight" in keys), None)
        if self.prefix is None:
            raise ModelLoadError(
                f"{files[0].parent}: no decoder embedding table (embed_tokens.weight under any of "
                f"{', '.join(repr(p) for p in _PREFIXES[:-1])}); is this a decoder-LLM text encoder (Mistral3, Qwen3, Gemma-2)?"
            )
        self.store = TensorStore(opened, (self.prefix,))
        self.where = files[0].parent

    def read(self, name: str, device, dtype) -> torch.Tensor:
        if name not in self.store:
            raise ModelLoadError(f"{self.where}: tensor '{self.prefix + name}' is missing")
        return self.store.get(name, dtype, device)


def load_truncated_decoder(encoder_dir: Path, num_layers: int, dtype: torch.dtype,
                           files: list[Path] | None = None, config=None, final_norm: bool = False):
    """(decoder with ``num_layers`` layers on meta but its embeddings, weights) for layer-major use.
    ``files`` + ``config`` replace the folder's shards and config.json (single-file encoders). ``final_norm``:
    keep the decoder's final norm (its weight read) instead of an identity."""
    from transformers import AutoModel

    files = files or sorted(encoder_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"text encoder folder '{encoder_dir}' has no .safetensors weights (pickles are never loaded)")
    config = config if config is not None else _text_config(encoder_dir)
    if num_layers > config.num_hidden_layers:
        raise ModelLoadError(f"'{encoder_dir}' has {config.num_hidden_layers} layers; this model's text conditioning "
                             f"needs the output of layer {num_layers}; is it the right text encoder?")
    config.num_hidden_layers = num_layers
    weights = _ShardedWeights(files)
    with torch.device("meta"):
        model = AutoModel.from_config(config, dtype=dtype)
    if final_norm:
        if num_layers != config.num_hidden_layers:
            raise ModelLoadError(f"'{encoder_dir}': the final norm follows the last of {config.num_hidden_layers} "
                                 f"layers, not layer {num_layers}")
        for pname, _ in list(model.norm.named_parameters()):
            model.norm._parameters[pname] = torch.nn.Parameter(weights.read(f"norm.{pname}", "cpu", dtype),
                                                               requires_grad=False)
    else:
        model.norm = torch.nn.Identity()  # stacked states are pre-norm; the last layer's output must stay raw
    model.embed_tokens.weight = torch.nn.Parameter(weights.read("embed_tokens.weight", "cpu", dtype),
                                                   requires_grad=False)
    if hasattr(model, "rotary_emb"):  # buffers computed from the config, not stored
        model.rotary_emb = type(model.rotary_emb)(config=config)
    scale = getattr(model.embed_tokens, "embed_scale", None)
    if scale is not None and scale.is_meta:  # Gemma-2 scales embeddings by sqrt(width): a buffer, not stored
        model.embed_tokens.embed_scale = torch.tensor(model.embed_tokens.scalar_embed_scale, dtype=scale.dtype)
    model.requires_grad_(False).eval()
    return model, weights


class _LayerPrefetcher:
    """Reads layer i+1's tensors from the memory map into pinned host memory on a worker thread while
    layer i computes, so the weights' host->GPU copies run at pinned speed and overlap the compute.
    Why not accelerate's offload hooks: they move weights per forward call, not per layer-major pass."""

    def __init__(self, weights: _ShardedWeights, layer: torch.nn.Module, num_layers: int, dtype: torch.dtype,
                 pin: bool):
        from concurrent.futures import ThreadPoolExecutor

        self.weights, self.dtype, self.pin, self.num_layers = weights, dtype, pin, num_layers
        self.names = [n for n, _ in layer.named_parameters()]
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lowvram-te-prefetch")
        self.pending = {0: self.pool.submit(self._read, 0)}

    def _read(self, index: int) -> dict[str, torch.Tensor]:
        out = {}
        for name in self.names:
            t = self.weights.read(f"layers.{index}.{name}", "cpu", self.dtype)
            out[name] = t.pin_memory() if self.pin else t
        return out

    def __call__(self, index: int, layer: torch.nn.Module, device: torch.device) -> None:
        future = self.pending.pop(index, None) or self.pool.submit(self._read, index)
        if index + 1 < self.num_layers and index + 1 not in self.pending:
            self.pending[index + 1] = self.pool.submit(self._read, index + 1)
        for name, tensor in future.result().items():
            module_name, _, pname = name.rpartition(".")
            module = layer.get_submodule(module_name) if module_name else layer
            module._parameters[pname] = torch.nn.Parameter(tensor.to(device, non_blocking=True), requires_grad=False)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def load_tokenizer(tokenizer_dir: Path):
    from transformers import AutoProcessor, AutoTokenizer

    if not tokenizer_dir.is_dir():
        raise ModelLoadError(f"tokenizer folder '{tokenizer_dir}' is missing; the text encoder needs its "
                             f"tokenizer (a diffusers pipeline folder has it in tokenizer/)")
    if (tokenizer_dir / "processor_config.json").exists():  # Flux.2-dev ships Mistral's PixtralProcessor
        return AutoProcessor.from_pretrained(tokenizer_dir, local_files_only=True)
    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)


def tokenize(tokenizer, spec: TextEncoderSpec, prompts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) as the family's pipeline makes them (``spec.template``): padded to
    ``max_length`` for a ``padded`` encoder; for a ``variable`` one, right-padded to the group's longest
    caption (a causal LM's rows of a right-padded caption do not depend on the padding). ``spec.drop_tokens``
    more are allowed: the template tokens cut off after encoding."""
    if spec.length in ("variable", "windowed"):
        tokenizer.padding_side = "right"
    ids, mask = spec.template.tokenize(tokenizer, prompts, max_length + spec.drop_tokens,
                                       pad_to_max=spec.length == "padded")
    return windowed(tokenizer, spec, ids, mask, max_length) if spec.length == "windowed" else (ids, mask)


def windowed(tokenizer, spec: TextEncoderSpec, ids: torch.Tensor, mask: torch.Tensor,
             max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``windowed`` spec's group: right-padded (with the tokenizer's pad token) to its longest caption's window,
    ``ceil(tokens / pad_multiple) * pad_multiple`` capped at ``max_length`` (``Flux3TextEncoderStep``). A causal LM's
    rows of a caption, its padding rows included (each attends to the caption's tokens alone), do not depend on how
    far the group is padded; ``encode_stacked`` keeps each caption's own window."""
    windows = window_lengths(spec, mask, max_length)
    extra = max(windows) - ids.shape[1]
    if extra > 0:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        ids = torch.cat([ids, ids.new_full((ids.shape[0], extra), pad)], dim=1)
        mask = torch.cat([mask, mask.new_zeros((mask.shape[0], extra))], dim=1)
    return ids, mask


def window_lengths(spec: TextEncoderSpec, mask: torch.Tensor, max_length: int) -> list[int]:
    """Each caption's window: its token count rounded up to ``spec.pad_multiple``, at most ``max_length``."""
    m = spec.pad_multiple
    return [min(-(-int(n) // m) * m, max_length) for n in mask.sum(dim=1)]


@torch.no_grad()
def encode_stacked(
    pipeline: Path | None,
    spec: TextEncoderSpec,
    captions: list[str],
    device: torch.device,
    dtype: torch.dtype,
    max_length: int,
    progress: Callable[[int, int], None] | None = None,
    source: tuple | None = None,
) -> list[torch.Tensor]:
    """One (max_length, len(hidden_layers) * width) tensor per caption, on the CPU ((L_i, ...) at the caption's
    own length for a ``variable`` encoder). ``source`` =
    (weight files, text config, tokenizer folder) for a single-file encoder instead of the pipeline's."""
    files, config = None, None
    if source is not None:
        files, config, tokenizer_dir = source
        encoder_dir = files[0]
    else:
        encoder_dir, tokenizer_dir = pipeline / spec.subfolder, pipeline / spec.tokenizer_subfolder
    if source is None and not (encoder_dir / "config.json").exists():
        raise ModelLoadError(f"text encoder folder '{encoder_dir}' is missing; caching captions needs the "
                             f"pipeline's {spec.subfolder}/ (the model's {spec.architecture or 'decoder LLM'})")
    tokenizer = load_tokenizer(tokenizer_dir) if isinstance(tokenizer_dir, Path) else tokenizer_dir  # or an object
    last = max(spec.hidden_layers)
    if spec.drop_tokens and spec.length != "variable":
        raise ValueError("drop_tokens needs a variable-length text encoder spec")
    model, weights = load_truncated_decoder(encoder_dir, last, dtype, files, config, final_norm=spec.final_norm)
    width = model.config.hidden_size
    per_caption = max_length * width * 2  # one hidden state, bf16
    group = max(1, int(_GROUP_BYTES // (per_caption * 4)))
    # Between layers the group's hidden states stay on the GPU when they are small (every caption of a
    # typical dataset: 118 x 512 tokens x 5120 = 0.62 GB), else they wait in host memory.
    on_device = device.type == "cuda" and min(group, len(captions)) * per_caption <= _DEVICE_ACTIVATION_BYTES
    results: list[torch.Tensor] = []
    prefetch = _LayerPrefetcher(weights, model.layers[0], last, dtype, pin=device.type == "cuda")
    try:
        for start in range(0, len(captions), group):
            ids, mask = tokenize(tokenizer, spec, captions[start:start + group], max_length)
            captured: dict[int, torch.Tensor] = {}
            if start:  # the next group reads every layer again, from layer 0
                prefetch.pending.clear()
            host = device if on_device else torch.device("cpu")
            with layer_major(model, device, chunk_size=4, load_layer=prefetch, host=host) as m:
                # Kept hidden states leave the GPU at once: three of them would be 1.9 GB for 118 captions.
                def keep(k):
                    return lambda _mod, _args, out: captured.__setitem__(
                        k, (out[0] if isinstance(out, tuple) else out).to("cpu"))
                if spec.final_norm:  # the normed last state: the norm runs where the activations are
                    m.norm.to(host)
                hooks = [(m.norm if spec.final_norm and k == last else m.layers[k - 1]).register_forward_hook(keep(k))
                         for k in spec.hidden_layers]
                try:
                    # windowed: padding at position id 1, as Flux3TextEncoderStep passes it (transformers 4.57's)
                    extra = ({"position_ids": torch.arange(ids.shape[1])[None].masked_fill(mask == 0, 1)}
                             if spec.length == "windowed" else {})
                    m(input_ids=ids, attention_mask=mask, use_cache=False, **extra)
                finally:
                    for h in hooks:
                        h.remove()
            stacked = torch.stack([captured[k] for k in spec.hidden_layers], dim=1)  # (B, K, L, D)
            b, k, length, d = stacked.shape
            out = stacked.permute(0, 2, 1, 3).reshape(b, length, k * d)
            if spec.length == "variable":  # each caption at its own length: its real tokens only
                results += [row[m.bool()][spec.drop_tokens:].to("cpu", dtype) for row, m in zip(out, mask)]
            elif spec.length == "windowed":  # each caption's own window, its padding rows included
                results += [row[:n].to("cpu", dtype) for row, n in zip(out, window_lengths(spec, mask, max_length))]
            else:
                results += [row.to("cpu", dtype) for row in out]
            if progress:
                progress(len(results), len(captions))
    finally:
        prefetch.close()
        del model
        release_device_memory(device)
    return results

