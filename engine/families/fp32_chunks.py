"""A block's fp32 token-wise arithmetic in token chunks: the modulated norm and the gated residual.

Why: Wan's blocks (diffusers' ``WanTransformerBlock``; the other families' blocks in diffusers keep these in bf16) run
their norms and residual sums in fp32 on the whole sequence: ``(norm(h.float()) * (1 + scale) + shift).type_as(h)`` and
``(h.float() + out * gate).type_as(h)``. At Wan 14B's 832x480x81 (32,760 tokens, width 5120) each fp32 copy is
671 MB, twice a bf16 hidden state. Autograd keeps the norm's fp32 input for the backward, and the backward of both
makes fp32 gradients of the same size (the cast, the sum, the product) before casting them back to bf16. These are
the step's largest tensors after attention's own, and with a streamed block's working set near 6 GB they decide
whether a plan fits an 8 GB card.

Here each is one autograd node that runs over token slices: the forward makes one slice's fp32 temporaries at a
time and saves only the bf16 input (the norm) or nothing of the sequence (the residual); the backward redoes the
norm one slice at a time. The values are diffusers' own, slice by slice: both are per token (a LayerNorm reduces
over the width only), so every output and gradient element is computed by the same operations in the same order.

No library does this: torch's checkpoint would save the slices' inputs too, and ``torch.compile`` fuses the
elementwise ops but (Wan, ``compiled_activation_scale``) keeps more of the block than eager does.
A gradient for the modulation vectors or the norm's own weights is not made here: where any of them is trained,
the plain expression runs (the ``fp32_*`` functions check). Inside compiled blocks both stay eager (a graph break each
side), so a compiled block keeps what an eager one keeps here and the planner needs one working set for both.
"""
from __future__ import annotations

import math

import torch
from torch import nn

#: The fp32 bytes of one slice: 128 MiB (a fifth of a Wan 14B hidden state at 832x480x81). Small enough that the
#: slices' temporaries are a small part of a streamed block's working set, large enough that a slice is thousands
#: of tokens (kernel launches stay a rounding error of the step).
SLICE_BYTES = 128 << 20


def _slices(x: torch.Tensor, slice_bytes: int) -> list[slice]:
    """Token slices of (B, S, D) ``x`` whose fp32 copy is at most ``slice_bytes`` each (at least one token)."""
    b, s, d = x.shape
    if s == 0:
        return []
    per = max(1, slice_bytes // max(1, b * d * 4))
    n = math.ceil(s / per)
    step = math.ceil(s / n)
    return [slice(i, min(s, i + step)) for i in range(0, s, step)]


def _sliced(like: torch.Tensor, slice_bytes: int, rows, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor shaped as (B, S, D) ``like`` whose token slices are ``rows(slice)``, made one slice at a time."""
    out = torch.empty(like.shape, dtype=dtype or like.dtype, device=like.device)
    for sl in _slices(like, slice_bytes):
        out[:, sl] = rows(sl)
    return out


def _tok(v: torch.Tensor | None, sl: slice) -> torch.Tensor | None:
    """A modulation vector's rows for a token slice: (B, 1, D) is shared by every token, (B, S, D) is per token."""
    if v is None or v.dim() != 3 or v.shape[1] == 1:
        return v
    return v[:, sl]


def _modulated(norm: nn.Module, h: torch.Tensor, scale, shift) -> torch.Tensor:
    y = norm(h.float())
    if scale is not None:
        y = y * (1 + scale) + shift
    return y


class _ModulatedNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, scale, shift, norm, slice_bytes):
        ctx.save_for_backward(h, scale, shift)
        ctx.norm, ctx.slice_bytes = norm, slice_bytes
        return _sliced(h, slice_bytes, lambda sl: _modulated(norm, h[:, sl], _tok(scale, sl), _tok(shift, sl)))

    @staticmethod
    def backward(ctx, grad):
        h, scale, shift = ctx.saved_tensors

        def grad_rows(sl):
            with torch.enable_grad():
                x = h[:, sl].detach().requires_grad_(True)
                y = _modulated(ctx.norm, x, _tok(scale, sl), _tok(shift, sl)).to(h.dtype)
                return torch.autograd.grad(y, x, grad[:, sl])[0]

        return _sliced(h, ctx.slice_bytes, grad_rows), None, None, None, None


class _GatedResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, out, gate, slice_bytes):
        ctx.save_for_backward(gate)
        ctx.out_dtype, ctx.slice_bytes = out.dtype, slice_bytes
        return _sliced(h, slice_bytes, lambda sl: h[:, sl].float() + out[:, sl].float() * _tok(gate, sl))

    @staticmethod
    def backward(ctx, grad):
        (gate,) = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return grad, None, None, None
        # d/dh: the bf16 -> fp32 casts around the sum pass the gradient through unchanged (exactly: bf16 is a subset
        # of fp32). d/dout: grad (fp32) x gate, cast to out's dtype, as autograd's mul and cast backward make it.
        return grad, _sliced(grad, ctx.slice_bytes, lambda sl: grad[:, sl].float() * _tok(gate, sl),
                             ctx.out_dtype), None, None


def _trained(*tensors) -> bool:
    return any(t is not None and t.requires_grad for t in tensors)


@torch.compiler.disable  # eager inside compiled blocks too: the same memory either way (the planner counts one)
def fp32_modulated_norm(norm: nn.Module, h: torch.Tensor, scale: torch.Tensor | None = None,
                        shift: torch.Tensor | None = None, slice_bytes: int | None = None) -> torch.Tensor:
    """``(norm(h.float()) * (1 + scale) + shift).type_as(h)`` (or ``norm(h.float()).type_as(h)`` without a scale),
    in token slices, saving only ``h`` for the backward. (B, S, D) ``h``; ``scale``/``shift`` (B, 1, D) or (B, S, D)
    fp32; ``norm`` a per-token fp32 norm (``FP32LayerNorm``)."""
    if h.dim() != 3 or _trained(scale, shift, *norm.parameters()):
        return _modulated(norm, h, scale, shift).type_as(h)
    return _ModulatedNorm.apply(h, scale, shift, norm, slice_bytes or SLICE_BYTES)


@torch.compiler.disable  # as fp32_modulated_norm
def fp32_gated_residual(h: torch.Tensor, out: torch.Tensor, gate: torch.Tensor,
                        slice_bytes: int | None = None) -> torch.Tensor:
    """``(h.float() + out.float() * gate).type_as(h)`` in token slices: no fp32 copy of the sequence is made or
    saved. (B, S, D) ``h`` and ``out``; ``gate`` (B, 1, D) or (B, S, D) fp32."""
    if h.dim() != 3 or out.shape != h.shape or _trained(gate) or gate.dtype != torch.float32:
        return (h.float() + out.float() * gate).type_as(h)
    return _GatedResidual.apply(h, out, gate, slice_bytes or SLICE_BYTES)
