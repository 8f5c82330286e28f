"""Int8Linear: gradients, what backward keeps alive, peft LoRA on top, and LoRA training
on an int8 base versus the full-precision base."""
import pytest
import torch
from torch import nn

from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.models import load_transformer
from lowvram_lora.engine.slab import Int8Linear, build_slab, dequantize_rows, load_slab_transformer
from lowvram_lora.engine.train import train_lora
from lowvram_lora.engine.train.lora_attach import attach_lora, detach_lora

from helpers import model_inputs


def _linear(out_f=48, in_f=32, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_f, out_f, bias=bias)


@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_grad_input_match_a_dequantized_fp32_reference(bias):
    module = Int8Linear.from_linear(_linear(bias=bias))
    w = dequantize_rows(module.weight_int8, module.weight_scale, torch.float32)
    x = torch.randn(3, 5, 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    g = torch.randn(3, 5, 48)
    y = module(x)
    y_ref = nn.functional.linear(x_ref, w, module.bias)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-6)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-6)
    assert module.weight_int8.grad is None


def test_bf16_autocast_path_matches_a_bf16_reference():
    module = Int8Linear.from_linear(_linear())
    module.bias = module.bias.to(torch.bfloat16)
    x = torch.randn(4, 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    w = dequantize_rows(module.weight_int8, module.weight_scale, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = module(x)
        y_ref = nn.functional.linear(x_ref.to(torch.bfloat16), w, module.bias)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref)
    g = torch.randn(4, 48, dtype=torch.bfloat16)
    y.backward(g)
    y_ref.backward(g)
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_backward_keeps_int8_not_a_float_weight_copy():
    """What autograd saves for backward: int8 weight + fp32 scales, no float (out, in) weight,
    no input. A plain frozen nn.Linear saves its float weight, for contrast."""
    def saved_by(module, x):
        saved = []

        def pack(t):
            saved.append((t.dtype, tuple(t.shape)))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x).sum().backward()
        return saved

    linear = _linear(out_f=64, in_f=96).requires_grad_(False)
    x = torch.randn(7, 96, requires_grad=True)
    plain = saved_by(linear, x)
    assert any(dt == torch.float32 and sorted(shape) == [64, 96] for dt, shape in plain), plain
    saved = saved_by(Int8Linear.from_linear(linear), x)
    assert (torch.int8, (64, 96)) in saved and (torch.float32, (64,)) in saved
    assert all(dt == torch.int8 or shape == (64,) for dt, shape in saved), saved


def test_to_dtype_keeps_int8_and_fp32_scales():
    module = Int8Linear.from_linear(_linear())
    scale = module.weight_scale.clone()
    module.to(torch.bfloat16)
    assert module.weight_int8.dtype == torch.int8 and module.bias.dtype == torch.bfloat16
    assert module.weight_scale.dtype == torch.float32 and torch.equal(module.weight_scale, scale)
    assert list(dict(module.named_parameters())) == []  # state is buffers only: what a streamer moves
    assert {n for n, _ in module.named_buffers()} == set(Int8Linear.STREAMED_TENSORS)


@pytest.fixture(scope="module")
def int8_model(tiny_pipeline, tmp_path_factory):
    slab = build_slab(tiny_pipeline, tmp_path_factory.mktemp("int8slab"), progress=False)
    return load_slab_transformer(slab, torch.float32)


def _dequantized_copy(model):
    """The reference: the same model with every Int8Linear replaced by a plain fp32 nn.Linear holding its
    dequantized weight (int8 x row scale) and its bias."""
    import copy

    ref = copy.deepcopy(model)
    for name, module in list(ref.named_modules()):
        if isinstance(module, Int8Linear):
            out_f, in_f = module.weight_int8.shape
            plain = nn.Linear(in_f, out_f, bias=module.bias is not None)
            with torch.no_grad():
                plain.weight.copy_(dequantize_rows(module.weight_int8, module.weight_scale, torch.float32))
                if module.bias is not None:
                    plain.bias.copy_(module.bias.float())
            plain.requires_grad_(False)
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent) if parent else ref, child, plain)
    return ref


def _lora_forward_backward(model, family):
    """LoRA r4 with B random (seeded), one forward and backward; (output, {name: grad}); detaches again."""
    params = attach_lora(model, family, LoraSettings(rank=4, alpha=4), seed=0)
    try:
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        out = model(**model_inputs(model))[0]
        out.square().mean().backward()
        grads = {_name(model, p): p.grad.clone() for p in params}
        return out.detach(), grads
    finally:
        detach_lora(model)


def test_peft_wraps_int8_linears_with_its_standard_lora_linear(int8_model):
    from peft.tuners.lora import Linear as LoraLinear

    model, family, _ = int8_model
    with torch.no_grad():
        before = model(**model_inputs(model))[0]
    params = attach_lora(model, family, LoraSettings(rank=4, alpha=4), seed=0)
    try:
        wrapped = model.transformer_blocks[0].attn.to_q
        assert isinstance(wrapped, LoraLinear) and isinstance(wrapped.base_layer, Int8Linear)
        n_targets = sum(isinstance(m, LoraLinear) for m in model.modules())
        assert n_targets == 2 * 8 + 2 * 5 and len(params) == 2 * n_targets
        out = model(**model_inputs(model))[0]
        torch.testing.assert_close(out, before)  # B = 0 at init: LoRA adds nothing yet
        assert not any(b.requires_grad for b in model.buffers())
    finally:
        detach_lora(model)
    assert isinstance(model.transformer_blocks[0].attn.to_q, Int8Linear)
    # Values, not just presence: with B random, the LoRA's output and every LoRA gradient on the int8 base equal
    # those on the dequantized fp32 reference (the same weights in plain nn.Linear layers). fp32 both sides, so
    # the only difference is summation order: rtol 1e-4, atol 1e-6.
    ref = _dequantized_copy(model)
    out, grads = _lora_forward_backward(model, family)
    ref_out, ref_grads = _lora_forward_backward(ref, family)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * n_targets
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert isinstance(model.transformer_blocks[0].attn.to_q, Int8Linear)


def _name(model, param):
    return next(n for n, p in model.named_parameters() if p is param)


def test_lora_training_on_the_int8_base_lowers_the_loss_like_the_full_precision_base(
        tiny_pipeline, one_image_cache, int8_model):
    steps = 30
    lora, train = LoraSettings(rank=8, alpha=8), TrainConfig(steps=steps, learning_rate=1e-2, seed=0)
    cfg = ModelConfig(transformer_path=str(tiny_pipeline))
    base, family, _, variant = load_transformer(tiny_pipeline, dtype=torch.float32)
    full = train_lora(cfg, one_image_cache, lora, train, preloaded=(base, family, variant))
    model, family, variant = int8_model
    int8 = train_lora(cfg, one_image_cache, lora, train, preloaded=(model, family, variant))
    assert int8.steps == full.steps == steps
    f_first, i_first = (sum(h[:5]) / 5 for h in (full.loss_history, int8.loss_history))
    f_last, i_last = (sum(h[-5:]) / 5 for h in (full.loss_history, int8.loss_history))
    assert f_last < 0.8 * f_first and i_last < 0.8 * i_first, (full.loss_history, int8.loss_history)
    # same data, noise and schedule: the int8 run tracks the full-precision one step by step
    diffs = [abs(a - b) / b for a, b in zip(int8.loss_history, full.loss_history)]
    assert max(diffs) < 0.02, diffs
    # the trained LoRAs have the same keys and point the same way
    assert set(int8.state_dict) == set(full.state_dict)
    a = torch.cat([int8.state_dict[k].flatten() for k in sorted(int8.state_dict) if ".lora_B." in k])
    b = torch.cat([full.state_dict[k].flatten() for k in sorted(full.state_dict) if ".lora_B." in k])
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.95
    assert isinstance(model.transformer_blocks[0].attn.to_q, Int8Linear)  # base left as it was


# --- GPU (run on the GPU machine: pytest -m gpu) --------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("shape", [(3072, 3072), (18432, 3072), (5, 77)])
def test_gpu_fused_dequantize_is_bit_exact_with_the_torch_reference(shape):
    from lowvram_lora.engine.slab.dequant import dequantize
    from lowvram_lora.engine.slab.quantize import quantize_rows

    q, s = quantize_rows(torch.randn(shape, device="cuda") * 0.02)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.equal(dequantize(q, s, dtype), dequantize_rows(q, s, dtype))


@pytest.mark.gpu
@cuda
def test_gpu_resident_int8_linear_matches_reference_under_autocast():
    module = Int8Linear.from_linear(_linear(out_f=256, in_f=128)).to("cuda")
    assert module.weight_int8.is_cuda and module.weight_scale.dtype == torch.float32
    x = torch.randn(2, 9, 128, device="cuda", requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    w = dequantize_rows(module.weight_int8, module.weight_scale, torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = module(x)
        y_ref = nn.functional.linear(x_ref, w, module.bias.to(torch.bfloat16))
    torch.testing.assert_close(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad)
