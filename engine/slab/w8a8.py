"""W8A8 compute for slab layers on CUDA: int8 x int8 -> int32 (``w8a8``), or fp8 e4m3 x e4m3 (``fp8``).

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

``fp8`` is the same recipe on the fp8 tensor cores (sm 8.9+): activations are quantized per token to
e4m3 (absmax / 448), the slab's int8 weight is cast to e4m3 as it is (integers up to 127, 3 mantissa
bits: 127 -> 128), and ``torch._scaled_mm`` applies the row and column scales and the bias in its
epilogue (no int32 round trip). grad_input folds ``sw`` into ``grad_out`` as above and multiplies by an
e4m3 transposed copy of the weight (cuBLASLt wants the second operand column-major), made per call from
the int8 weight and freed after it. Measured on the H100 (bench/logs/probe_int8_h100.log, 4608 x 3072 x
12288): bf16 0.447 ms, ``torch._int_mm`` 0.575 ms (its int8 kernels reach 605 TOPS, below bf16's 780
TFLOP/s), fp8 rowwise ``_scaled_mm`` 0.276 ms (1259 TFLOP/s). So on Hopper only fp8's GEMM beats bf16's;
with the quantization passes around it, a training step is still slower than dequant (README, bench/RESULTS.md).

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

#: How ``grad_input`` is formed under w8a8.
W8A8_BACKWARD_MODES = ("int8", "bf16")


def int_mm_supported(m: int, k: int, n: int, device: torch.device) -> bool:
    """``torch._int_mm``'s shape rules (CUDA): more than 16 rows, K and N multiples of 8."""
    return device.type == "cuda" and m > 16 and k % 8 == 0 and n % 8 == 0


FP8 = torch.float8_e4m3fn
#: Largest magnitude per quantized dtype: rows are scaled so their absmax lands here.
QMAX = {torch.int8: 127.0, FP8: 448.0}


def fp8_mm_supported(m: int, k: int, n: int) -> bool:
    """``torch._scaled_mm``'s shape rules (rowwise scales): K and N multiples of 16; fewer than 17
    rows (modulation layers: one row per sample) go the dequant way, as for w8a8."""
    return m > 16 and k % 16 == 0 and n % 16 == 0


@functools.lru_cache(maxsize=None)
def fp8_support_error(device_index: int) -> str | None:
    """None when this CUDA device runs rowwise-scaled fp8 matmuls, else why not (tried once per device)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    name = torch.cuda.get_device_name(device_index)
    if (major, minor) < (8, 9):
        return f"{name} (compute capability {major}.{minor}) has no fp8 tensor cores (8.9+: RTX 40xx, L4, H100)"
    try:
        dev = torch.device("cuda", device_index)
        a = torch.ones(32, 32, device=dev).to(FP8)
        out = torch._scaled_mm(a, a.t(), scale_a=torch.ones(32, 1, device=dev), scale_b=torch.ones(1, 32, device=dev),
                               bias=torch.zeros(32, device=dev, dtype=torch.bfloat16), out_dtype=torch.bfloat16)
        if not torch.isfinite(out).all() or out[0, 0].item() != 32:
            return f"{name}: a test fp8 matmul gave a wrong result"
    except (RuntimeError, NotImplementedError) as exc:  # cuBLASLt without rowwise scaling on this GPU/torch
        return f"{name}: torch {torch.__version__} cannot run rowwise-scaled fp8 matmuls here ({str(exc)[:200]})"
    return None


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
                   TO_FP8: tl.constexpr, BLOCK: tl.constexpr):
        # One program per row: absmax over the row (optionally of x * col_scale), then round.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_COL_SCALE:
            x = x * tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
        amax = tl.max(tl.abs(x), axis=0)
        if TO_FP8:
            scale = tl.maximum(amax, 1e-12) / 448.0
            q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
            tl.store(q_ptr + row * n_cols + cols, q.to(tl.float8e4nv), mask=mask)  # round to nearest even
        else:
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


def quantize_per_row(x: torch.Tensor, col_scale: torch.Tensor | None = None,
                     dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float -> (M, K) ``dtype`` (int8 or fp8 e4m3) and (M,) fp32 scales, absmax per row (of
    ``x * col_scale`` when given) mapped to ``QMAX[dtype]``. Same rounding on every path: int8 half away
    from zero, fp8 to nearest even."""
    qmax = QMAX[dtype]
    kernels = _kernels() if x.is_cuda else None
    if kernels is not None and x.is_contiguous() and x.shape[1] <= 32768:
        quant_rows, _, next_pow2 = kernels
        m, k = x.shape
        q = torch.empty((m, k), dtype=dtype, device=x.device)
        s = torch.empty((m,), dtype=torch.float32, device=x.device)
        if m:
            cs = col_scale.float().contiguous() if col_scale is not None else s
            with torch.cuda.device(x.device):
                quant_rows[(m,)](x, q, s, cs, k, HAS_COL_SCALE=col_scale is not None, TO_FP8=dtype == FP8,
                                 BLOCK=next_pow2(k))
        return q, s
    xf = x.float() if col_scale is None else x.float() * col_scale.float()
    s = xf.abs().amax(dim=1).clamp_min(1e-12) / qmax
    v = xf / s[:, None]
    if dtype == FP8:
        return v.clamp(-qmax, qmax).to(FP8), s
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


def fp8_matmul(aq: torch.Tensor, bq_t: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
               bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 (M, K) @ e4m3 (K, N, column-major) * scale_a[:, None] * scale_b[None, :] + bias, as ``dtype``:
    ``torch._scaled_mm`` on CUDA, the same arithmetic in fp32 elsewhere (tests)."""
    if aq.is_cuda:
        return torch._scaled_mm(aq, bq_t, scale_a=scale_a[:, None], scale_b=scale_b[None, :],
                                bias=None if bias is None else bias.to(dtype), out_dtype=dtype)
    y = (aq.float() @ bq_t.float()) * scale_a[:, None] * scale_b[None, :]
    return (y if bias is None else y + bias.float()).to(dtype)


def _ones(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, dtype=torch.float32, device=device)


def _fp8_weight(weight_int8: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """The int8 weight as e4m3, column-major for cuBLASLt's second operand: (N, K) row-major read as
    (K, N) for forward, or a transposed copy (K, N) read as (N, K) for grad_input. Through bf16 (exact for
    int8): Triton, which inductor generates for compiled blocks, has no direct int8 -> fp8 cast."""
    if not transposed:
        return weight_int8.to(torch.bfloat16).to(FP8)
    n, k = weight_int8.shape
    wt = torch.empty((k, n), dtype=FP8, device=weight_int8.device)
    return wt.copy_(weight_int8.t().to(torch.bfloat16))


class W8A8LinearFunction(torch.autograd.Function):
    """y = x @ dequant(W)^T + b with activations quantized per token and multiplied on the int8
    (``compute="w8a8"``) or fp8 (``compute="fp8"``) tensor cores; saves only W's int8 and scales.
    ``backward_mode`` (w8a8 only): grad_input in int8 or with the dequantized bf16 weight."""

    @staticmethod
    def forward(ctx, x, weight_int8, weight_scale, bias, compute: str = "w8a8", backward_mode: str = "int8"):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        if compute == "fp8":
            xq, sx = quantize_per_row(x2, dtype=FP8)
            y = fp8_matmul(xq, _fp8_weight(weight_int8).t(), sx, weight_scale, bias, x.dtype)
        else:
            xq, sx = quantize_per_row(x2)
            acc = int8_matmul(xq, weight_int8.t())  # wq (N, K) row-major = (K, N) column-major: cuBLASLt's TN
            y = scaled_int32(acc, sx, weight_scale, bias, x.dtype)
        del xq
        ctx.save_for_backward(weight_int8, weight_scale)
        ctx.x_dtype, ctx.compute, ctx.backward_mode = x.dtype, compute, backward_mode
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.reshape(*shape[:-1], weight_int8.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        weight_int8, weight_scale = ctx.saved_tensors
        grad_x = grad_bias = None
        g2 = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        if ctx.needs_input_grad[0]:
            n, k = weight_int8.shape
            if ctx.compute == "fp8":
                gq, sg = quantize_per_row(g2, col_scale=weight_scale, dtype=FP8)  # fold sw[n] into the reduction
                grad_x = fp8_matmul(gq, _fp8_weight(weight_int8, transposed=True).t(), sg, _ones(k, g2.device),
                                    None, ctx.x_dtype)
            elif ctx.backward_mode == "int8" and int_mm_supported(g2.shape[0], n, k, g2.device):
                gq, sg = quantize_per_row(g2, col_scale=weight_scale)  # fold sw[n] into the reduction axis
                # (M, N) @ (N, K). cuBLASLt's int8 kernels want the second operand column-major: on the
                # H100, wq as it is (row-major) ran at 120 TOPS, a transposed copy at 600 (probe log).
                acc = int8_matmul(gq, weight_int8.t().contiguous().t())
                grad_x = scaled_int32(acc, sg, None, None, ctx.x_dtype)
            else:
                from .dequant import dequantize

                grad_x = g2.to(ctx.x_dtype) @ dequantize(weight_int8, weight_scale, ctx.x_dtype)
            grad_x = grad_x.reshape(*grad_out.shape[:-1], k)
        if ctx.needs_input_grad[3]:
            grad_bias = g2.sum(0).to(ctx.bias_dtype)
        return grad_x, None, None, grad_bias, None, None
