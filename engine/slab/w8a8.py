"""W8A8: int8 activations x int8 weights -> int32, for slab layers on CUDA.

``Int8Linear`` keeps its weight as int8 rows with one fp32 scale per output row
(``quantize.quantize_rows``). The default ``dequant`` compute turns that weight
back into bf16 before a bf16 matmul. ``w8a8`` instead quantizes the activations
per token (absmax / 127, dynamic, computed on the fly) and multiplies int8 by
int8 on the tensor cores (``torch._int_mm``: cuBLASLt, int32 accumulate), then
applies both scales in one pass:

    y[m, n] = (sum_k xq[m, k] * wq[n, k]) * sx[m] * sw[n] + b[n]

Backward (the base weight is frozen; only ``grad_input`` is needed):

- ``grad_input = grad_out @ dequant(W)``. The row scale ``sw[n]`` sits on the
  reduction axis here, so it is folded into ``grad_out`` first
  (``g[m, n] * sw[n]``), which is then quantized per row, and the product is
  again int8 x int8 against the *same* int8 weight (no transpose copy:
  ``torch._int_mm(gq, wq)`` reads wq (N, K) row-major as the (K-major) second
  operand). ``backward="bf16"`` dequantizes instead (exact to bf16 rounding).
- Saved for backward: the int8 weight and its scales, which the module holds
  anyway: never the input, never a bf16 copy of the weight.

The LoRA branch (peft's ``lora.Linear`` around this module) is untouched: it
runs in bf16/fp32 and its gradients are exact.

Why our own kernels and not torchao's ``Int8DynamicActivationInt8WeightConfig``:
torchao's int8 dynamic-activation tensors have no backward to the input
(DESIGN.md §6), and they would re-quantize our already-quantized slab weights.
The two small Triton kernels fuse what would be 4-6 torch kernels each
(absmax, divide, round, clamp, cast; int32->fp32, two scale multiplies, bias,
cast) and keep the extra traffic to one read and one write.
"""
from __future__ import annotations

import functools

import torch

#: Compute paths for slab (Int8Linear) layers.
INT8_COMPUTE_MODES = ("dequant", "w8a8")
#: How ``grad_input`` is formed under w8a8.
W8A8_BACKWARD_MODES = ("int8", "bf16")


def int_mm_supported(m: int, k: int, n: int, device: torch.device) -> bool:
    """``torch._int_mm``'s shape rules (CUDA): more than 16 rows, K and N multiples of 8."""
    return device.type == "cuda" and m > 16 and k % 8 == 0 and n % 8 == 0


@functools.lru_cache(maxsize=1)
def _kernels():
    """(quantize_rows_kernel, scale_epilogue_kernel), or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def quant_rows(x_ptr, q_ptr, s_ptr, col_scale_ptr, n_cols, HAS_COL_SCALE: tl.constexpr,
                   BLOCK: tl.constexpr):
        # One program per row: absmax over the row (optionally of x * col_scale), then round.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_COL_SCALE:
            x = x * tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
        amax = tl.max(tl.abs(x), axis=0)
        scale = tl.maximum(amax, 1e-12) / 127.0
        q = x / scale
        q = tl.where(q >= 0, tl.floor(q + 0.5), tl.ceil(q - 0.5))  # round half away from zero
        tl.store(q_ptr + row * n_cols + cols, q.to(tl.int8), mask=mask)
        tl.store(s_ptr + row, scale)

    @triton.jit
    def scale_epilogue(acc_ptr, out_ptr, row_scale_ptr, col_scale_ptr, bias_ptr, n_cols,
                       HAS_COL_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        acc = tl.load(acc_ptr + row * n_cols + cols, mask=mask, other=0).to(tl.float32)
        y = acc * tl.load(row_scale_ptr + row)
        if HAS_COL_SCALE:
            y = y * tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    return quant_rows, scale_epilogue, triton.next_power_of_2


def quantize_per_row(x: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float -> (M, K) int8 and (M,) fp32 scales, absmax per row (of ``x * col_scale``
    when given). Same rounding on every path (half away from zero)."""
    kernels = _kernels() if x.is_cuda else None
    if kernels is not None and x.is_contiguous() and x.shape[1] <= 32768:
        quant_rows, _, next_pow2 = kernels
        m, k = x.shape
        q = torch.empty((m, k), dtype=torch.int8, device=x.device)
        s = torch.empty((m,), dtype=torch.float32, device=x.device)
        if m:
            cs = col_scale.float().contiguous() if col_scale is not None else s
            with torch.cuda.device(x.device):
                quant_rows[(m,)](x, q, s, cs, k, HAS_COL_SCALE=col_scale is not None, BLOCK=next_pow2(k))
        return q, s
    xf = x.float() if col_scale is None else x.float() * col_scale.float()
    s = xf.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    v = xf / s[:, None]
    q = torch.where(v >= 0, torch.floor(v + 0.5), torch.ceil(v - 0.5)).clamp(-127, 127).to(torch.int8)
    return q, s


def scaled_int32(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor | None,
                 bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``acc * row_scale[:, None] * col_scale[None, :] + bias`` as ``dtype``, in one pass on CUDA."""
    kernels = _kernels() if acc.is_cuda else None
    if kernels is not None and acc.is_contiguous():
        _, epilogue, _ = kernels
        m, n = acc.shape
        out = torch.empty((m, n), dtype=dtype, device=acc.device)
        if out.numel():
            block = 1024
            with torch.cuda.device(acc.device):
                epilogue[(m, -(-n // block))](
                    acc, out, row_scale, col_scale if col_scale is not None else row_scale,
                    bias if bias is not None else row_scale, n,
                    HAS_COL_SCALE=col_scale is not None, HAS_BIAS=bias is not None, BLOCK=block)
        return out
    y = acc.float() * row_scale[:, None]
    if col_scale is not None:
        y = y * col_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def int8_matmul(aq: torch.Tensor, bq_t: torch.Tensor) -> torch.Tensor:
    """int8 (M, K) @ int8 (K, N) -> int32 (M, N): ``torch._int_mm`` on CUDA, an exact int
    reference elsewhere (tests)."""
    if aq.is_cuda:
        return torch._int_mm(aq, bq_t)
    return (aq.to(torch.int32) @ bq_t.to(torch.int32))


class W8A8LinearFunction(torch.autograd.Function):
    """y = x @ dequant(W)^T + b with int8 x int8 tensor-core matmuls; saves only W's int8 and scales."""

    @staticmethod
    def forward(ctx, x, weight_int8, weight_scale, bias, backward_mode: str):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        xq, sx = quantize_per_row(x2)
        acc = int8_matmul(xq, weight_int8.t())  # wq (N, K) row-major = (K, N) column-major: cuBLASLt's TN
        del xq
        y = scaled_int32(acc, sx, weight_scale, bias, x.dtype)
        ctx.save_for_backward(weight_int8, weight_scale)
        ctx.x_dtype, ctx.backward_mode = x.dtype, backward_mode
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.reshape(*shape[:-1], weight_int8.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        weight_int8, weight_scale = ctx.saved_tensors
        grad_x = grad_bias = None
        g2 = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        if ctx.needs_input_grad[0]:
            n, k = weight_int8.shape
            if ctx.backward_mode == "int8" and int_mm_supported(g2.shape[0], n, k, g2.device):
                gq, sg = quantize_per_row(g2, col_scale=weight_scale)  # fold sw[n] into the reduction axis
                acc = int8_matmul(gq, weight_int8)  # (M, N) @ (N, K)
                del gq
                grad_x = scaled_int32(acc, sg, None, None, ctx.x_dtype)
            else:
                from .dequant import dequantize

                grad_x = g2.to(ctx.x_dtype) @ dequantize(weight_int8, weight_scale, ctx.x_dtype)
            grad_x = grad_x.reshape(*grad_out.shape[:-1], weight_int8.shape[1])
        if ctx.needs_input_grad[3]:
            grad_bias = g2.sum(0).to(ctx.bias_dtype)
        return grad_x, None, None, grad_bias, None
