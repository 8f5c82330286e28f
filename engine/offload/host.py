"""A block's frozen tensors in one page-locked host buffer, laid out as in its GPU slot.

Every frozen tensor of a block (parameters that do not require grad, and
buffers; any dtype, so int8 weights and their scales stream as stored) gets an
aligned offset in one flat byte layout. The host buffer and the GPU slot share
that layout, so loading a block is ONE host-to-device copy, and pointing the
block at its slot is ``tensor.data = slot[offset:offset+n].view(dtype).view(shape)``:
no allocation per step.

Pinning: page-locked memory is what lets copies run at full PCIe speed (53.8 GB/s
pinned vs 6.6 GB/s pageable on the H100 here). We allocate ordinary host memory
and register it with ``cudaHostRegister`` instead of ``torch.empty(pin_memory=True)``:
torch's pinned allocator rounds every allocation up to a power of two (a 680 MB
block would pin 1 GiB). Pinning is slow on the GPU machines (2 GB/s in one thread; ``_register`` faults the
pages in from torch's threads first, 11 GB/s with 16), so it is
done once per model: the HostBlock is kept on the block module and reused by the
next ``apply_offload`` (only the bytes are refreshed, if the tensors moved).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from ..errors import ConfigError
# Host-RAM facts live in hostmem.py; these names stay importable from here for existing callers.
from .hostmem import host_rss_bytes, physical_ram_bytes  # noqa: F401

ALIGN = 256  # bytes; keeps every view aligned for vectorised kernels
_ATTR = "_lowvram_host_block"


@dataclass
class Entry:
    """One frozen tensor's place in the block layout."""

    module: nn.Module
    name: str
    is_param: bool
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple

    def tensor(self) -> torch.Tensor:
        return (self.module._parameters if self.is_param else self.module._buffers)[self.name]


#: Set on a module whose output the modulation window serves (engine/train/step_window.py): its weights are the
#: window's, so a block, an outer module or a footprint that contains it leaves them out.
STEP_CONSTANT = "_lowvram_step_constant"


def step_constant_tensors(model: nn.Module) -> set[int]:
    """ids of the tensors of the modules the modulation window holds (``STEP_CONSTANT``)."""
    return {id(t) for m in model.modules() if m.__dict__.get(STEP_CONSTANT)
            for t in list(m.parameters()) + list(m.buffers())}


def frozen_tensors(block: nn.Module) -> list[tuple[nn.Module, str, bool, torch.Tensor]]:
    """(owner, name, is_param, tensor) of every frozen parameter and buffer, each shared tensor once; those of a
    submodule the modulation window holds are not the block's (``STEP_CONSTANT``)."""
    out, seen = [], {id(t) for m in block.modules() if m is not block and m.__dict__.get(STEP_CONSTANT)
                     for t in list(m.parameters()) + list(m.buffers())}
    for module in block.modules():
        for name, p in module._parameters.items():
            if p is None or p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            out.append((module, name, True, p))
        for name, b in module._buffers.items():
            if b is None or id(b) in seen:
                continue
            seen.add(id(b))
            out.append((module, name, False, b))
    return out


def _check_plain(block_name: str, name: str, t: torch.Tensor) -> None:
    if type(t) not in (torch.Tensor, nn.Parameter) or t.is_quantized or t.is_sparse:
        raise ConfigError(
            f"{block_name}.{name} is a {type(t).__name__} ({t.layout}); the block streamer moves plain tensors "
            f"only (int8 weights and their scales as separate tensors). Train this model with mode='resident'"
        )


def layout(block: nn.Module, block_name: str = "block") -> tuple[list[Entry], int]:
    entries, offset = [], 0
    for module, name, is_param, t in frozen_tensors(block):
        _check_plain(block_name, name, t)
        nbytes = t.numel() * t.element_size()
        entries.append(Entry(module, name, is_param, offset, nbytes, t.dtype, tuple(t.shape)))
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset


def frozen_bytes(module: nn.Module) -> int:
    """Bytes of a module's frozen tensors as laid out in a slot (with alignment)."""
    return layout(module)[1]


def _register(t: torch.Tensor) -> bool:
    """Page-lock ``t``, a fresh buffer (its bytes may be zeroed), in place; False where CUDA is absent (CPU tests).

    The pages are faulted in first, from torch's CPU threads (``zero_`` runs in parallel): cudaHostRegister faults
    the untouched pages of a fresh buffer itself, one at a time in one thread (the kernel zeroes each), which is
    most of its time. torch's own pinned allocator does the same (``pinned_num_register_threads``); ours registers
    buffers it did not allocate, so it is done here. bench/bench_pin.py, 1x H200, 16 GB: 2.3 GB/s registered
    directly, 11.3 GB/s faulted in by 16 threads first (2026-11-29)."""
    if not torch.cuda.is_available() or t.numel() == 0:
        return False
    if torch.get_num_threads() > 1:  # in one thread the driver's own fault-in is as fast
        t.zero_()
    err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0))
    if err != 0:
        raise RuntimeError(
            f"cudaHostRegister of {t.numel() / 1e9:.2f} GB failed (cudaError {err}): the host cannot page-lock "
            f"more memory; keep more blocks resident or free host RAM"
        )
    return True


def _unregister(buffer: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
    except Exception:  # interpreter shutdown: the driver is going away anyway
        pass


class PinnedBuffer:
    """``numel`` elements of ``dtype`` in host memory, page-locked where CUDA is (``_register``), exactly that size:
    ``torch.empty(pin_memory=True)`` rounds each allocation up to a power of two (0.34 GB took 0.54 GB,
    bench/bench_pin.py). ``tensor`` is the buffer; it is unregistered when this object goes or at ``release()``
    (views of it stay valid, as pageable memory). The one home of every host buffer the engine page-locks: a block's
    host copy, activation offload's arenas, the disk tier's staging ring (``memory``: its own aligned bytes), AdamW's
    moments on the host, a resume save's staging."""

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool = True, memory: Optional[torch.Tensor] = None):
        raw = memory if memory is not None else torch.empty(numel * dtype.itemsize, dtype=torch.uint8)
        self.pinned = _register(raw) if pin else False
        # The finalizer holds the buffer, so it is unregistered before it can be freed.
        self._unpin = weakref.finalize(self, _unregister, raw) if self.pinned else None
        self.tensor = raw.view(dtype)[:numel]

    def release(self) -> None:
        """Unregister now, not when this object goes."""
        if self._unpin is not None:
            self._unpin()
            self._unpin, self.pinned = None, False


class HostBlock:
    """The host copy of one block; ``bind`` points the block's tensors into any flat byte buffer."""

    def __init__(self, block: nn.Module, block_name: str, pin: bool):
        self.name = block_name
        self.entries, self.nbytes = layout(block, block_name)
        self._host = PinnedBuffer(self.nbytes, torch.uint8, pin)  # kept with this block: never released early
        self.buffer, self.pinned = self._host.tensor, self._host.pinned  # (nbytes,); subclasses set pinned too
        self._signature = self._signature_of(block)

    @staticmethod
    def _signature_of(block: nn.Module) -> list:
        return [(id(t), t.dtype, tuple(t.shape)) for _, _, _, t in frozen_tensors(block)]

    # -- making and finding -----------------------------------------------------

    @classmethod
    def for_block(cls, block: nn.Module, block_name: str, pin: bool,
                  fill: Optional[Callable[["HostBlock"], None]] = None) -> tuple["HostBlock", bool]:
        """(HostBlock, reused). Reuses the block's earlier HostBlock when the frozen tensors are the same
        objects; its bytes are refreshed unless the tensors already point into it. ``fill`` replaces the
        copy from the current tensors (a model built on the meta device has no bytes to copy)."""
        hb = getattr(block, _ATTR, None)
        reused = hb is not None and hb._signature == cls._signature_of(block) and hb.pinned >= pin
        if not reused:
            hb = cls(block, block_name, pin)
            setattr(block, _ATTR, hb)
        if fill is not None:
            fill(hb)
        elif not hb.bound_to_host():
            hb.copy_from_tensors()
        hb.bind_host()
        return hb, reused

    # -- bytes ----------------------------------------------------------------

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of ``flat`` (a uint8 buffer of at least nbytes), one per entry."""
        return [flat[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in self.entries]

    def copy_from_tensors(self) -> None:
        for e, view in zip(self.entries, self.views(self.buffer)):
            t = e.tensor()
            if t.device.type == "meta":
                raise ConfigError(f"{self.name}.{e.name} is on the meta device; materialise the model first")
            view.copy_(t.detach())

    def bind(self, flat: torch.Tensor) -> None:
        """Point every frozen tensor of the block into ``flat`` (the host buffer or a GPU slot)."""
        replaced = False
        for e, view in zip(self.entries, self.views(flat)):
            t = e.tensor()
            if t.device.type == "meta" or not torch._has_compatible_shallow_copy_type(t, view):
                new = nn.Parameter(view, requires_grad=False) if e.is_param else view
                (e.module._parameters if e.is_param else e.module._buffers)[e.name] = new
                replaced = True
            else:
                t.data = view
        if replaced:  # new tensor objects: remember them, or the next apply would not reuse this buffer
            self._signature = [(id(e.tensor()), e.dtype, e.shape) for e in self.entries]

    def bind_host(self) -> None:
        self.bind(self.buffer)

    def copy_to(self, flat: torch.Tensor) -> None:
        """Its bytes into ``flat`` (a GPU buffer of ``nbytes``), asynchronously where pinned."""
        flat.copy_(self.buffer, non_blocking=self.pinned)

    def bound_to_host(self) -> bool:
        base = self.buffer.data_ptr()
        return all(e.tensor().device.type == "cpu" and e.tensor().data_ptr() == base + e.offset
                   for e in self.entries)



class MappedBlock:
    """A module's frozen tensors left where a slab file maps them (no host copy): ``copy_to`` reads them from the
    map into a GPU buffer (page cache, or the disk where the pages were given back), then gives the map's pages back
    (``release``: engine/slab/source.py), so they hold no RAM between copies. The modulation window uses it when host
    RAM is short (engine/train/step_window.py): it copies its weights once per window, so their RAM is better spent
    on blocks that stream every step. Same binding interface as ``HostBlock``."""

    pinned = False

    def __init__(self, module: nn.Module, name: str, release: Callable[[list[tuple[int, int]]], int]):
        self.name = name
        self.entries, self.nbytes = layout(module, name)
        self.mapped = [e.tensor().data for e in self.entries]  # the map's views, as loaded
        if any(t.device.type != "cpu" for t in self.mapped):
            raise ValueError(f"{name}: only tensors on the host can be left in the file's map")
        self.release = release

    def copy_to(self, flat: torch.Tensor) -> None:
        for e, src in zip(self.entries, self.mapped):
            flat[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape).copy_(src)
        # The copies above are synchronous (pageable memory): the pages can go back right away.
        self.release([(t.data_ptr(), t.numel() * t.element_size()) for t in self.mapped if t.numel()])

    def bind(self, flat: torch.Tensor) -> None:
        for e in self.entries:
            e.tensor().data = flat[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)

    def bind_host(self) -> None:
        for e, src in zip(self.entries, self.mapped):
            e.tensor().data = src
