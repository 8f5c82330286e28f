"""The fp32 modulated norm and gated residual in token slices (``engine/families/fp32_chunks.py``), CPU: the same
values and gradients as the plain expressions diffusers' blocks write, bit for bit in bf16, and no fp32 copy of the
sequence kept for the backward or made at once (what they are for)."""
import pytest
import torch
from diffusers.models.normalization import FP32LayerNorm
from lowvram_lora.engine.families.fp32_chunks import fp32_gated_residual, fp32_modulated_norm
from lowvram_lora.engine.testing import LiveBytes

B, S, D = 2, 64, 48
SLICE = B * D * 4 * 10  # 10 tokens a slice: 7 slices


def _inputs(per_token: bool):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B, S, D, generator=g).to(torch.bfloat16)
    out = torch.randn(B, S, D, generator=g).to(torch.bfloat16)
    rows = S if per_token else 1
    scale, shift, gate = (torch.randn(B, rows, D, generator=g) for _ in range(3))
    return h, out, scale, shift, gate


def _norm_plain(norm, h, scale, shift):
    y = norm(h.float())
    return (y * (1 + scale) + shift if scale is not None else y).type_as(h)


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("per_token", [False, True])
def test_sliced_values_and_gradients_equal_the_plain_expressions_in_bf16(per_token, affine):
    h, out, scale, shift, gate = _inputs(per_token)
    norm = FP32LayerNorm(D, 1e-6, elementwise_affine=affine).requires_grad_(False)
    if affine:
        with torch.no_grad():
            norm.weight.normal_(1, 0.3), norm.bias.normal_(0, 0.3)
    cot = torch.randn(B, S, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    results = []
    for sliced in (False, True):
        x, o = h.clone().requires_grad_(True), out.clone().requires_grad_(True)
        mod = (scale, shift) if not affine else (None, None)
        if sliced:
            y = fp32_gated_residual(x, fp32_modulated_norm(norm, x, *mod, slice_bytes=SLICE) * o, gate,
                                    slice_bytes=SLICE)
        else:
            y = (x.float() + (_norm_plain(norm, x, *mod) * o).float() * gate).type_as(x)
        y.backward(cot)
        results.append((y.detach(), x.grad, o.grad))
    for want, got in zip(*results):
        assert torch.equal(got, want)


def test_no_fp32_copy_of_the_sequence_is_saved_or_made():
    """Plain: the norm's backward keeps h.float() (2x h's bytes), and forward and backward make fp32 (B, S, D)
    tensors. Sliced: only h (bf16) is kept, no new tensor is larger than a slice's fp32 rows or one bf16 (B, S, D)
    result, and the peak of forward + backward is lower."""
    h, _, scale, shift, gate = _inputs(False)
    norm = FP32LayerNorm(D, 1e-6, elementwise_affine=False)
    seq_fp32 = B * S * D * 4
    stats = {}
    for sliced in (False, True):
        x = h.clone().requires_grad_(True)
        saved = []

        def keep(t, into=saved):
            into.append(t)
            return t

        with LiveBytes() as peak, torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            if sliced:
                y = fp32_gated_residual(x, fp32_modulated_norm(norm, x, scale, shift, slice_bytes=SLICE), gate,
                                        slice_bytes=SLICE)
            else:
                y = (x.float() + _norm_plain(norm, x, scale, shift).float() * gate).type_as(x)
            y.backward(torch.ones_like(y))
        stats[sliced] = (max(t.untyped_storage().nbytes() for t in saved if t.dtype == torch.float32 and t.dim()),
                         peak.largest, peak.peak)
    assert stats[False][0] >= seq_fp32 and stats[True][0] < seq_fp32 / 4  # fp32 saved: h.float() vs the (1, D) rows
    assert stats[False][1] >= seq_fp32 and stats[True][1] <= B * S * D * 2  # largest new tensor
    assert stats[True][2] < stats[False][2]


def test_trained_modulation_or_norm_weights_take_the_plain_path_with_their_gradients():
    """A trained scale or gate: the values and every gradient equal the plain expressions' exactly (bf16)."""
    h, _, scale, shift, gate = _inputs(False)
    norm = FP32LayerNorm(D, 1e-6, elementwise_affine=False)
    for which in ("scale", "gate"):
        results = []
        for sliced in (False, True):
            x = h.clone().requires_grad_(True)
            s, g = scale.clone().requires_grad_(which == "scale"), gate.clone().requires_grad_(which == "gate")
            if sliced:
                y = fp32_gated_residual(x, fp32_modulated_norm(norm, x, s, shift, slice_bytes=SLICE), g,
                                        slice_bytes=SLICE)
            else:
                y = (x.float() + _norm_plain(norm, x, s, shift).float() * g).type_as(x)
            y.float().square().sum().backward()
            trained = s if which == "scale" else g
            results.append((y.detach(), x.grad, trained.grad))
        for want, got in zip(*results):
            assert torch.equal(got, want), which
