"""Int8 per-row symmetric quantization: the one definition the builder, the int8
module and the tests share.

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
