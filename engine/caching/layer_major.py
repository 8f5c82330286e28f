"""Run a text encoder layer-major so it never has to fit the GPU whole.

Per-caption streaming re-reads every layer for every caption. Here the whole
group of captions goes through layer 0 (moved to the GPU once), then layer 1,
and so on: each layer crosses PCIe once per group. Activations live on the host
between layers and visit the GPU in chunks, so VRAM holds one layer plus one
chunk of activations.

Why our own code: accelerate's offload hooks move a layer per forward call, so
they stream per caption (or need the whole batch's activations on the GPU).
Wrapping each layer of the encoder's main ModuleList keeps the model's own
forward (embeddings, masks, final norm run on the host) and works for any
transformers encoder whose layers take batch-first tensors (T5, CLIP, Mistral).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn


def main_layer_list(model: nn.Module) -> nn.ModuleList:
    """The ModuleList holding most of the parameters: the encoder's layer stack."""
    best, best_params = None, -1
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            n = sum(p.numel() for p in module.parameters())
            if n > best_params:
                best, best_params = module, n
    if best is None:
        raise ValueError(f"{type(model).__name__} has no layer list to run layer by layer")
    return best


class _ChunkedLayer(nn.Module):
    """Wraps one layer: moves it to ``device`` once, feeds the batch through in chunks."""

    def __init__(self, layer: nn.Module, device: torch.device, chunk_size: int, host: torch.device,
                 index: int = 0, load_layer: LoadLayer | None = None):
        super().__init__()
        self.layer = layer
        self.device = device
        self.chunk_size = chunk_size
        self.host = host
        self.index, self.load_layer = index, load_layer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        batch = _batch_size(args, kwargs)
        if self.load_layer is not None:
            self.load_layer(self.index, self.layer, self.device)  # from the file, straight to the device
        else:
            self.layer.to(self.device)
        try:
            outputs = []
            for start in range(0, batch, self.chunk_size):
                stop = min(start + self.chunk_size, batch)
                a = [_slice_to(x, batch, start, stop, self.device) for x in args]
                k = {n: _slice_to(v, batch, start, stop, self.device) for n, v in kwargs.items()}
                with torch.no_grad():
                    out = _to(self.layer(*a, **k), self.host)
                if torch.is_tensor(out) and out.dim() > 0 and out.shape[0] == stop - start and batch > 1:
                    # Written into one preallocated tensor as chunks arrive: no concatenated second copy.
                    if not outputs:
                        outputs.append(torch.empty((batch,) + tuple(out.shape[1:]), dtype=out.dtype, device=out.device))
                    outputs[0][start:stop] = out
                    continue
                outputs.append(out)
            if len(outputs) == 1 and torch.is_tensor(outputs[0]) and outputs[0].shape[0] == batch:
                return outputs[0]
        finally:
            # A layer loaded from the file goes back to meta: its weights are dropped, not kept on the host.
            self.layer.to("meta" if self.load_layer is not None else self.host)
        return _merge(outputs, batch)


def _batch_size(args, kwargs) -> int:
    for x in list(args) + list(kwargs.values()):
        if torch.is_tensor(x) and x.dim() > 0:
            return x.shape[0]
    raise ValueError("layer called without a batched tensor argument")


def _slice_to(x: Any, batch: int, start: int, stop: int, device: torch.device) -> Any:
    if torch.is_tensor(x):
        if x.dim() > 0 and x.shape[0] == batch and batch > 1:
            x = x[start:stop]
        return x.to(device, non_blocking=True)
    if isinstance(x, tuple):
        return tuple(_slice_to(v, batch, start, stop, device) for v in x)
    return x


def _to(x: Any, device: torch.device) -> Any:
    if torch.is_tensor(x):
        return x.to(device)
    if isinstance(x, tuple):
        return type(x)(_to(v, device) for v in x) if type(x) is tuple else type(x)(*(_to(v, device) for v in x))
    return x


def _merge(outputs: list[Any], batch: int) -> Any:
    first = outputs[0]
    if torch.is_tensor(first):
        if len(outputs) > 1 and first.dim() > 0 and sum(o.shape[0] for o in outputs) == batch:
            return torch.cat(outputs, dim=0)
        return first  # unbatched (e.g. a shared position bias): identical in every chunk
    if isinstance(first, tuple):
        return tuple(_merge([o[i] for o in outputs], batch) for i in range(len(first)))
    return first


#: ``load_layer(index, layer, device)`` puts layer ``index``'s weights on ``device`` (e.g. read from
#: a file's memory map); the layer is sent back to meta after it ran.
LoadLayer = Callable[[int, nn.Module, torch.device], None]


@contextmanager
def layer_major(model: nn.Module, device: torch.device, chunk_size: int = 8, load_layer: LoadLayer | None = None,
                host: torch.device | None = None) -> Iterator[nn.Module]:
    """Inside the block, ``model(...)`` on host tensors runs its layer stack on ``device``,
    one layer at a time for the whole batch. Layers are restored on exit. With ``load_layer``
    the layers may live on the meta device: each is loaded when it runs and dropped after."""
    layers = main_layer_list(model)
    host = host or next(layers.parameters()).device
    originals = list(layers)
    for i, layer in enumerate(originals):
        layers[i] = _ChunkedLayer(layer, device, chunk_size, host, i, load_layer)
    try:
        yield model
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer
