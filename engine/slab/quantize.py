"""Int8 per-row symmetric and int4 group-wise asymmetric quantization: the one definition the builder, the
quantized Linears and the tests share (int4 below ``quantize_groups``).

    scale[r] = max_c |W[r, c]| / 127          (fp32, one per output row)
    q[r, c]  = clamp(round(W[r, c] / scale[r]), -127, 127)   (int8; -128 unused)
    W'[r, c] = q[r, c] * scale[r]

Why per row: a row is one output feature, so a large-magnitude row never costs
precision in the others, and row-wise splitting of a fused BFL Linear (qkv,
linear1) into diffusers' separate Linears is exact. Why fp32 scales: they add
4 bytes per row (0.13% of a 3072-wide row) and keep the stored value the exact
max/127; a bf16 scale would add a systematic error of up to 0.4% to every weight
of its row, on top of the ~0.9% rounding error of int8 itself.
"""
from __future__ import annotations

import torch

QMAX = 127
SCALE_DTYPE = torch.float32


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> (int8 (out, in), fp32 scale (out,)). All-zero rows get scale 0."""
    w = w.to(torch.float32)
    scale = w.abs().amax(dim=1) / QMAX  # (out,)
    if not torch.isfinite(scale).all():
        raise ValueError("weight has non-finite values (inf or nan); the checkpoint is damaged")
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / divisor[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 (out, in) and its scales -> (out, in) in ``dtype``; the product is formed in fp32
    (exact for |q| <= 127 times an fp32 scale, rounded once to ``dtype``)."""
    return (q.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)


class RowQuantizer:
    """``quantize_rows`` for a stream of row chunks, in preallocated buffers.

    Same arithmetic, bit for bit, as ``quantize_rows``, but no allocation per chunk:
    a build runs thousands of chunks, and fresh 64 MiB temporaries per op fragment
    the C heap until RSS is several times the working set. Working set: one fp32
    chunk of the source, one fp32 scratch chunk, one chunk of raw source bytes and
    two int8 chunks (one being written by a background writer while the next fills).
    """

    def __init__(self, max_elements: int):
        self.w = torch.empty(max_elements, dtype=torch.float32)
        self.tmp = torch.empty(max_elements, dtype=torch.float32)
        self.q = [torch.empty(max_elements, dtype=torch.int8) for _ in range(2)]
        self.busy = [None, None]  # per int8 buffer: a Future of the write still reading it
        self.raw = torch.empty(max_elements * 4, dtype=torch.uint8)  # source bytes, up to fp32
        self._turn = 0

    def __call__(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, float, int]:
        """(n, in) chunk in any float dtype -> (int8 (n, in), fp32 scale (n,), err_sq, src_sq, slot).
        The int8 tensor lives in buffer ``slot``; set ``busy[slot]`` to the Future of its write."""
        n, cols = src.shape
        slot, self._turn = self._turn, 1 - self._turn
        if self.busy[slot] is not None:
            self.busy[slot].result()  # the write of two chunks ago must be done before we overwrite
            self.busy[slot] = None
        w = self.w[: n * cols].view(n, cols)
        tmp = self.tmp[: n * cols].view(n, cols)
        q = self.q[slot][: n * cols].view(n, cols)
        w.copy_(src)
        lo, hi = torch.aminmax(w, dim=1)
        scale = torch.maximum(hi, lo.neg_()).div_(QMAX)  # == |w|.amax(1) / 127, exactly
        if not torch.isfinite(scale).all():
            raise ValueError("weight has non-finite values (inf or nan); the checkpoint is damaged")
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
        torch.div(w, divisor[:, None], out=tmp)
        tmp.round_().clamp_(-QMAX, QMAX)
        q.copy_(tmp)  # exact: tmp holds integers in [-127, 127]
        tmp.mul_(scale[:, None]).sub_(w)  # dequantized - source
        err_sq = float(torch.linalg.vector_norm(tmp)) ** 2
        src_sq = float(torch.linalg.vector_norm(w)) ** 2
        return q, scale, err_sq, src_sq, slot


# --- int4: group-wise asymmetric ------------------------------------------------------------------------------
#
#     groups of GROUP_SIZE consecutive input columns of one row (the last group of a row may be shorter)
#     scale[r, g] = (max - min) / 15,  min[r, g] = min over the group                      (fp16 each)
#     q[r, c]     = clamp(round((W[r, c] - min[r, g]) / scale[r, g]), 0, 15)              (4 bits)
#     W'[r, c]    = q[r, c] * scale[r, g] + min[r, g]                                     (in fp32, rounded once)
#
# Why asymmetric (min + scale, 16 levels): a group's values are rarely centred on zero, and a symmetric code spends
# one of only 16 levels on the sign (15 levels, -7..7); torchao's int4 weight-only (tinygemm: its float zero point
# is min + 8 * scale) and HQQ both store a zero point for the same reason. Why groups of 64 along the input: one
# outlier then costs precision to 63 neighbours, not to a whole 3072-wide row (per-row 4-bit codes lose ~3x more);
# bitsandbytes' NF4 and HQQ use blocks of 64, torchao and GPTQ/AWQ 128 (chosen for the tinygemm tile and for 4.25
# instead of 4.5 bits). We train on the base's outputs, so we take the finer groups: the rounding error of Gaussian
# weights is range / (15 sqrt 12), and the expected range of 64 values is 8% smaller than that of 128, for 6% more
# bytes (Flux.1-dev: 6.7 instead of 6.4 GB). Why fp16 scale and min: 10 mantissa bits put their rounding (2^-11
# relative) far below the 4-bit step; bf16's 7 bits would add up to 0.4% of the range to every weight of the group;
# fp32 would cost 4.75 bits per weight. q is rounded against the fp16 values actually stored.
#
# Packing: two columns per byte, column 2j in the low nibble, 2j + 1 in the high one; an odd last column leaves the
# high nibble 0. (out, in) weights are stored as (out, ceil(in / 2)) uint8: plain bytes that stream as they are.

INT4_GROUP = 64
INT4_LEVELS = 15
INT4_SCALE_DTYPE = torch.float16
_FP16_MAX = float(torch.finfo(torch.float16).max)


def int4_groups(cols: int, group: int = INT4_GROUP) -> int:
    """Groups per row of ``cols`` input columns."""
    return -(-cols // group)


def _grouped(w: torch.Tensor, group: int) -> torch.Tensor:
    """(n, cols) -> (n, groups, group), the ragged last group padded with copies of the row's last value (which
    changes neither its min nor its max)."""
    n, cols = w.shape
    pad = int4_groups(cols, group) * group - cols
    if pad:
        w = torch.cat([w, w[:, -1:].expand(n, pad)], dim=1)
    return w.view(n, -1, group)


def quantize_groups(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> (packed uint8 (out, ceil(in/2)), fp16 scale (out, groups), fp16 min (out, groups))."""
    w = w.to(torch.float32)
    n, cols = w.shape
    if n == 0 or cols == 0:
        groups = int4_groups(cols, group)
        return (torch.empty(n, -(-cols // 2), dtype=torch.uint8), torch.zeros(n, groups, dtype=INT4_SCALE_DTYPE),
                torch.zeros(n, groups, dtype=INT4_SCALE_DTYPE))
    g = _grouped(w, group)  # (n, groups, group)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        raise ValueError("weight has non-finite values (inf or nan); the checkpoint is damaged")
    scale32 = (hi - lo) / INT4_LEVELS
    if float(lo.abs().max()) > _FP16_MAX or float(scale32.max()) > _FP16_MAX:
        raise ValueError(f"weight values reach {float(g.abs().max()):.3g}, beyond fp16's range, where int4 keeps its "
                         f"group scales; build an int8 slab of this checkpoint instead (--bits 8)")
    scale, low = scale32.to(INT4_SCALE_DTYPE), lo.to(INT4_SCALE_DTYPE)
    s, m = scale.float(), low.float()
    divisor = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((g - m[..., None]) / divisor[..., None]).clamp_(0, INT4_LEVELS)
    q = q.view(n, -1)[:, :cols].to(torch.uint8)
    return pack_int4(q), scale, low


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(n, cols) uint8 values in [0, 15] -> (n, ceil(cols/2)) uint8, column 2j low nibble, 2j + 1 high."""
    if q.shape[1] % 2:
        q = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """The inverse of ``pack_int4``: (n, ceil(cols/2)) uint8 -> (n, cols) uint8 in [0, 15]."""
    both = torch.stack([packed & 15, packed >> 4], dim=-1)  # (n, bytes, 2)
    return both.view(packed.shape[0], -1)[:, :cols]


def dequantize_groups(packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, cols: int,
                      dtype: torch.dtype, group: int = INT4_GROUP) -> torch.Tensor:
    """The reference int4 dequantization: (out, ceil(in/2)) packed, (out, groups) fp16 scale and min -> (out, in)
    ``dtype``; q * scale + min formed in fp32 and rounded once to ``dtype``. torch ops only, so inductor fuses it
    into the matmul under ``torch.compile``."""
    n = packed.shape[0]
    q = unpack_int4(packed, cols).to(torch.float32)
    pad = int4_groups(cols, group) * group - cols
    if pad:
        q = torch.cat([q, q.new_zeros(n, pad)], dim=1)
    w = q.view(n, -1, group) * scale.to(torch.float32)[..., None] + low.to(torch.float32)[..., None]
    return w.view(n, -1)[:, :cols].to(dtype)


class GroupQuantizer:
    """``quantize_groups`` for a stream of row chunks (the builder's), with the relative error of each chunk.

    The packed output of each call is a fresh tensor (a quarter of the source chunk's fp32 bytes), so the
    background writer may hold it while the next chunk is quantized; the fp32 copy of the source is reused."""

    def __init__(self, max_elements: int, group: int = INT4_GROUP):
        self.w = torch.empty(max_elements, dtype=torch.float32)
        self.raw = torch.empty(max_elements * 4, dtype=torch.uint8)  # source bytes, up to fp32
        self.group = group

    def __call__(self, src: torch.Tensor):
        """(n, in) chunk in any float dtype -> (packed (n, ceil(in/2)), scale, min (n, groups), err_sq, src_sq)."""
        n, cols = src.shape
        w = self.w[: n * cols].view(n, cols)
        w.copy_(src)
        packed, scale, low = quantize_groups(w, self.group)
        deq = dequantize_groups(packed, scale, low, cols, torch.float32, self.group)
        err_sq = float(torch.linalg.vector_norm(deq.sub_(w))) ** 2
        src_sq = float(torch.linalg.vector_norm(w)) ** 2
        return packed, scale, low, err_sq, src_sq
