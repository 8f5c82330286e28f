"""Dequantize int8 rows (and int4 groups, ``dequantize_int4`` below) on the compute device, as fast as the
device allows.

``dequantize(q, scale, dtype)`` gives the same values, bit for bit, as the
reference ``quantize.dequantize_rows`` (int8 -> fp32, times the fp32 row scale,
one rounding to ``dtype``):

- on CUDA, outside ``torch.compile``: one Triton kernel that reads int8 + scales
  and writes ``dtype`` (3 bytes of traffic per weight instead of ~11 for the
  torch-ops chain; measured on H100 for a 12288x3072 weight: 0.32 ms -> ~0.08 ms,
  which is most of Int8Linear's overhead over a bf16 Linear);
- elsewhere, and while ``torch.compile`` traces (inductor fuses the torch ops
  itself): the torch ops of ``dequantize_rows``.
"""
from __future__ import annotations

import functools

import torch

from .quantize import INT4_GROUP, dequantize_groups, dequantize_rows


@functools.lru_cache(maxsize=1)
def _triton_kernel():
    """The Triton kernel, or None where Triton is missing (CPU builds of torch)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def dequant_rows_kernel(q_ptr, scale_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        offs = row.to(tl.int64) * n_cols + cols
        q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
        s = tl.load(scale_ptr + row)
        tl.store(out_ptr + offs, (q * s).to(out_ptr.dtype.element_ty), mask=mask)

    return dequant_rows_kernel


_BLOCK = 1024


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(out, in) int8 and (out,) fp32 scales -> (out, in) ``dtype`` on q's device."""
    if q.is_cuda and q.is_contiguous() and not torch.compiler.is_compiling():
        kernel = _triton_kernel()
        if kernel is not None:
            rows, cols = q.shape
            out = torch.empty((rows, cols), dtype=dtype, device=q.device)
            if out.numel():
                with torch.cuda.device(q.device):  # Triton launches on the current device
                    kernel[(rows, triton_cdiv(cols, _BLOCK))](q, scale.float().contiguous(), out, cols, BLOCK=_BLOCK)
            return out
    return dequantize_rows(q, scale, dtype)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --- int4 -------------------------------------------------------------------------------------------------------
#
# Why our own kernel and not torchao's int4 (``Int4WeightOnlyConfig``: tinygemm's ``_weight_int4pack_mm``, or its
# Marlin / preshuffled layouts): those keep the weight as a tensor subclass in a tile layout made for one GPU
# architecture by ``_convert_weight_to_int4pack`` on that GPU. Our blocks arrive per step as plain bytes from pinned
# host memory (the streamer moves plain tensors only), so a tile layout would have to be built on the GPU for every
# block of every step, and it could not be stored in a slab that must open on any machine. Their matmuls are also
# forward-only and tuned for a few rows (decoding): training multiplies 4096+ tokens and needs grad_input through
# the transposed weight. So, as for int8: a row-major nibble-packed weight that streams as it is, dequantized by
# one Triton kernel (reads 0.5 byte + its group's 4 bytes of scale and min per 64 weights, writes dtype), then
# cuBLAS's bf16 matmul; under torch.compile the torch ops of ``dequantize_groups``, which inductor fuses.


@functools.lru_cache(maxsize=1)
def _triton_int4_kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def dequant_int4_kernel(p_ptr, scale_ptr, min_ptr, out_ptr, n_cols, n_bytes, n_groups,
                            GROUP: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        byte = tl.load(p_ptr + row.to(tl.int64) * n_bytes + cols // 2, mask=mask, other=0).to(tl.int32)
        q = ((byte >> ((cols % 2) * 4)) & 15).to(tl.float32)
        g = row.to(tl.int64) * n_groups + cols // GROUP
        s = tl.load(scale_ptr + g, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(min_ptr + g, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row.to(tl.int64) * n_cols + cols, (q * s + m).to(out_ptr.dtype.element_ty), mask=mask)

    return dequant_int4_kernel


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, cols: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """(out, ceil(in/2)) packed uint8 and (out, groups) fp16 scale and min -> (out, in) ``dtype`` on packed's device.
    On CUDA the Triton kernel (q * s + m may be one fused multiply-add there: within one rounding of ``dtype`` of
    the reference), elsewhere and while compiling ``quantize.dequantize_groups``."""
    if packed.is_cuda and packed.is_contiguous() and not torch.compiler.is_compiling():
        kernel = _triton_int4_kernel()
        if kernel is not None:
            rows = packed.shape[0]
            out = torch.empty((rows, cols), dtype=dtype, device=packed.device)
            if out.numel():
                with torch.cuda.device(packed.device):
                    kernel[(rows, triton_cdiv(cols, _BLOCK))](
                        packed, scale.contiguous(), low.contiguous(), out, cols, packed.shape[1], scale.shape[1],
                        GROUP=INT4_GROUP, BLOCK=_BLOCK)
            return out
    return dequantize_groups(packed, scale, low, cols, dtype)
