"""Int4Linear: a frozen Linear stored as 4-bit groups (quantize.py: 64 input columns per fp16 scale and min),
dequantized to the compute dtype right before its matmul, like ``Int8Linear``.

It subclasses ``nn.Linear``, so peft's default LoRA dispatch wraps it in its standard ``lora.Linear``.

State, all plain buffers (what a block streamer moves):

    weight_int4   uint8    (out, ceil(in / 2))   two columns per byte
    weight_scale  float16  (out, groups)
    weight_min    float16  (out, groups)
    bias          compute dtype (out,), or None

Backward saves only the packed weight, its scales and mins, and dequantizes again for ``grad_input``; the frozen
weight gets no gradient. Only the ``dequant`` compute exists for int4 (``int8_compute``'s w8a8/fp8 modes are
int8-only: ``set_int8_compute`` leaves these layers alone).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .dequant import dequantize_int4
from .int8_linear import compute_dtype
from .quantize import INT4_GROUP, INT4_SCALE_DTYPE, int4_groups, quantize_groups


class Int4LinearFunction(torch.autograd.Function):
    """y = x @ dequant(W)^T + b, saving the packed W, its scales and mins (not x) for backward."""

    @staticmethod
    def forward(ctx, x, packed, scale, low, bias):
        cols = x.shape[-1]
        w = dequantize_int4(packed, scale, low, cols, x.dtype)  # (out, in), freed after the matmul
        ctx.save_for_backward(packed, scale, low)
        ctx.x_dtype, ctx.cols = x.dtype, cols
        ctx.bias_dtype = None if bias is None else bias.dtype
        return F.linear(x, w, bias)

    @staticmethod
    def backward(ctx, grad_out):
        packed, scale, low = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            w = dequantize_int4(packed, scale, low, ctx.cols, ctx.x_dtype)
            grad_x = grad_out.to(ctx.x_dtype) @ w  # (..., out) @ (out, in) -> (..., in)
        if ctx.needs_input_grad[4]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, None, None, None, grad_bias


class Int4Linear(nn.Linear):
    """A frozen ``nn.Linear`` whose weight is 4-bit, one fp16 scale and min per 64 input columns of a row."""

    STREAMED_TENSORS = ("weight_int4", "weight_scale", "weight_min", "bias")

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 bias_dtype: torch.dtype = torch.bfloat16) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: no float weight is ever allocated
        self.in_features = in_features
        self.out_features = out_features
        groups = int4_groups(in_features, INT4_GROUP)
        self.register_buffer("weight_int4", torch.empty(out_features, -(-in_features // 2), dtype=torch.uint8,
                                                        device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, groups, dtype=INT4_SCALE_DTYPE, device=device))
        self.register_buffer("weight_min", torch.empty(out_features, groups, dtype=INT4_SCALE_DTYPE, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=bias_dtype, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int4Linear":
        """Quantize an existing Linear (tests, benches; the slab builder writes the same values)."""
        packed, scale, low = quantize_groups(linear.weight.detach())
        has_bias = linear.bias is not None
        module = cls(linear.in_features, linear.out_features, has_bias, device="meta")
        device = linear.weight.device
        module.weight_int4, module.weight_scale, module.weight_min = packed.to(device), scale.to(device), low.to(device)
        module.bias = linear.bias.detach().clone() if has_bias else None
        return module

    @property
    def weight(self) -> torch.Tensor:
        """The packed storage (not a float weight): lets peft and others read the device.
        Use ``dequantized_weight()`` for values."""
        return self.weight_int4

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int4(self.weight_int4, self.weight_scale, self.weight_min, self.in_features, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x)
        return Int4LinearFunction.apply(x.to(dtype), self.weight_int4, self.weight_scale, self.weight_min,
                                        None if self.bias is None else self.bias.to(dtype))

    def reset_parameters(self) -> None:  # nn.Linear API; weights come from a slab, never re-initialised
        pass

    def _apply(self, fn, recurse=True):
        """``.to(device)`` moves scales and mins; ``.to(dtype)`` must not cast them (they are stored fp16 and the
        codes were rounded against those values): a dtype change is applied to them as a device move only."""
        kept = {k: self._buffers.pop(k) for k in ("weight_scale", "weight_min")}
        try:
            result = super()._apply(fn, recurse)
        finally:
            for key, t in kept.items():
                if t is not None:
                    moved = fn(t)
                    t = moved if moved.dtype == t.dtype else t.to(moved.device)
                self._buffers[key] = t
        return result

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight=int4 groups of {INT4_GROUP}")
