"""Int8Linear: a frozen Linear stored as int8 rows + fp32 row scales, dequantized
to the compute dtype right before its matmul.

It subclasses ``nn.Linear``, so peft's default LoRA dispatch wraps it in its
standard ``lora.Linear`` (checked with peft 0.21) and the LoRA path is unchanged:
``base(x) + B(A(x)) * scale``.

State, all plain buffers (no Parameters), the parts a block streamer moves:

    weight_int8   int8     (out, in)
    weight_scale  float32  (out,)
    bias          compute dtype (out,), or None

Backward: ``Int8LinearFunction`` saves only ``weight_int8`` and ``weight_scale``
(no input, no bf16 weight) and dequantizes again to form ``grad_input``; the
frozen weight gets no gradient. Memory kept for backward per layer is therefore
the int8 bytes the module already holds, not a second bf16 copy.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import INT8_COMPUTE_MODES
from .dequant import dequantize
from .quantize import SCALE_DTYPE, quantize_rows
from .w8a8 import W8A8_BACKWARD_MODES, W8A8LinearFunction, fp8_mm_supported, int_mm_supported


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the matmul runs in: autocast's when it is on for x's device, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class Int8LinearFunction(torch.autograd.Function):
    """y = x @ dequant(W)^T + b, saving int8 W and its scales (not x) for backward."""

    @staticmethod
    def forward(ctx, x, weight_int8, weight_scale, bias):
        w = dequantize(weight_int8, weight_scale, x.dtype)  # (out, in), freed after the matmul
        ctx.save_for_backward(weight_int8, weight_scale)
        ctx.x_dtype = x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return F.linear(x, w, bias)

    @staticmethod
    def backward(ctx, grad_out):
        weight_int8, weight_scale = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            w = dequantize(weight_int8, weight_scale, ctx.x_dtype)
            grad_x = grad_out.to(ctx.x_dtype) @ w  # (..., out) @ (out, in) -> (..., in)
        if ctx.needs_input_grad[3]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, None, None, grad_bias


def int8_linear(x: torch.Tensor, weight_int8: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    dtype = compute_dtype(x)
    return Int8LinearFunction.apply(x.to(dtype), weight_int8, weight_scale, None if bias is None else bias.to(dtype))


class Int8Linear(nn.Linear):
    """A frozen ``nn.Linear`` whose weight is int8 with one fp32 scale per output row."""

    # What a block streamer moves, per module (bias may be None).
    STREAMED_TENSORS = ("weight_int8", "weight_scale", "bias")
    #: "dequant" (bf16 matmul on the dequantized weight), "w8a8" (int8 x int8) or "fp8" (e4m3 x e4m3),
    #: see w8a8.py; set per model with ``set_int8_compute``.
    compute: str = "dequant"
    #: How w8a8 forms grad_input: "int8" (tensor cores) or "bf16" (dequantized weight).
    w8a8_backward: str = "int8"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 bias_dtype: torch.dtype = torch.bfloat16) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: no float weight is ever allocated
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("weight_int8", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=SCALE_DTYPE, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=bias_dtype, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        """Quantize an existing Linear (tests; in-memory conversion)."""
        q, scale = quantize_rows(linear.weight.detach())
        has_bias = linear.bias is not None
        module = cls(linear.in_features, linear.out_features, has_bias, device="meta")
        module.weight_int8, module.weight_scale = q.to(linear.weight.device), scale.to(linear.weight.device)
        module.bias = linear.bias.detach().clone() if has_bias else None
        return module

    @property
    def weight(self) -> torch.Tensor:
        """The int8 storage (not a float weight): lets peft and others read the device.
        Use ``dequantized_weight()`` for values."""
        return self.weight_int8

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight_int8, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        quantized = (self.compute == "fp8" and fp8_mm_supported(rows, self.in_features, self.out_features)
                     or self.compute == "w8a8" and int_mm_supported(rows, self.in_features, self.out_features, x.device))
        if quantized:
            dtype = compute_dtype(x)
            return W8A8LinearFunction.apply(x.to(dtype), self.weight_int8, self.weight_scale,
                                            None if self.bias is None else self.bias.to(dtype), self.compute,
                                            self.w8a8_backward)
        return int8_linear(x, self.weight_int8, self.weight_scale, self.bias)

    def reset_parameters(self) -> None:  # nn.Linear API; weights come from a slab, never re-initialised
        pass

    def _apply(self, fn, recurse=True):
        """``.to(device)`` moves the scales; ``.to(dtype)`` / ``.half()`` must not cast them
        (bf16/fp16 scales lose precision): a dtype change is applied as a device move only."""
        scale = self._buffers.pop("weight_scale")
        try:
            result = super()._apply(fn, recurse)
        finally:
            if scale is not None:
                moved = fn(scale)
                if moved.dtype != scale.dtype:
                    moved = scale.to(moved.device)
                scale = moved
            self._buffers["weight_scale"] = scale
        return result

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight=int8 per-row")


def set_int8_compute(model: nn.Module, compute: str, backward: str | None = None) -> int:
    """Choose how every Int8Linear in ``model`` multiplies; returns how many it set.

    ``w8a8`` needs CUDA int8 tensor cores, ``fp8`` fp8 ones (the training loop checks the device;
    off CUDA ``fp8`` runs the same arithmetic in fp32, for tests). Layers whose shapes the matmul
    cannot take (fewer than 17 tokens, or widths not a multiple of 8 / 16) fall back to ``dequant``
    per call.
    ``backward`` (w8a8's grad_input path, "int8" or "bf16"): None leaves each layer's as it is.
    """
    from ..errors import ConfigError

    if compute not in INT8_COMPUTE_MODES:
        raise ConfigError(f"int8 compute {compute!r} is not one of {', '.join(INT8_COMPUTE_MODES)}")
    if backward is not None and backward not in W8A8_BACKWARD_MODES:
        raise ConfigError(f"w8a8 backward {backward!r} is not one of {', '.join(W8A8_BACKWARD_MODES)}")
    count = 0
    for module in model.modules():
        if isinstance(module, Int8Linear):
            module.compute = compute
            if backward is not None:
                module.w8a8_backward = backward
            count += 1
    return count
