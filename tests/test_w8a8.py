"""W8A8 slab compute (engine/slab/w8a8.py): the arithmetic on CPU (exact int32 reference for
torch._int_mm), the CUDA path in a GPU test."""
import pytest
import torch

from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.slab import Int8Linear
from lowvram_lora.engine.slab.int8_linear import set_int8_compute
from lowvram_lora.engine.slab.w8a8 import (
    FP8, W8A8LinearFunction, fp8_mm_supported, int_mm_supported, quantize_per_row,
)


def _layer(k=64, n=48, bias=True, device="cpu"):
    torch.manual_seed(0)
    return Int8Linear.from_linear(torch.nn.Linear(k, n, bias=bias)).to(device)


def _rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def test_per_row_quantization_round_trips_within_half_a_step():
    x = torch.randn(40, 64) * torch.linspace(0.01, 10, 40)[:, None]  # rows of very different size
    q, s = quantize_per_row(x)
    assert q.dtype == torch.int8 and s.shape == (40,)
    assert q.abs().max() == 127  # absmax maps to +-127 on every row
    assert torch.all((q.float() * s[:, None] - x).abs() <= s[:, None] / 2 + 1e-6)


@pytest.mark.parametrize("backward", ["int8", "bf16"])
def test_w8a8_forward_and_grad_input_match_the_dequant_path(backward):
    layer = _layer()
    x = torch.randn(3, 32, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y = W8A8LinearFunction.apply(x, layer.weight_int8, layer.weight_scale, layer.bias, "w8a8", backward)
    y_ref = layer(x_ref)  # dequant path (the module's default)
    assert y.shape == y_ref.shape == (3, 32, 48)
    assert _rel(y, y_ref) < 0.02
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert _rel(x.grad, x_ref.grad) < (0.02 if backward == "int8" else 1e-5)


def test_set_int8_compute_switches_every_slab_layer_and_rejects_unknown_modes():
    model = torch.nn.Sequential(_layer(), torch.nn.ReLU(), _layer(48, 16))
    assert set_int8_compute(model, "w8a8") == 2
    assert all(m.compute == "w8a8" for m in model if isinstance(m, Int8Linear))
    # on the CPU the module falls back to the dequant path per call (no int8 tensor cores)
    x = torch.randn(20, 64)
    set_int8_compute(model, "dequant")
    ref = model(x)
    set_int8_compute(model, "w8a8")
    assert torch.equal(model(x), ref)
    with pytest.raises(ConfigError, match="not one of dequant, w8a8, fp8"):
        set_int8_compute(model, "fp4")
    assert not int_mm_supported(16, 64, 64, torch.device("cuda"))  # torch._int_mm needs > 16 rows


def test_w8a8_on_cpu_is_refused_before_training(tiny_pipeline, one_image_cache):
    from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.offload import OffloadConfig
    from lowvram_lora.engine.train import train_lora

    with pytest.raises(ConfigError, match="w8a8.*CUDA.*dequant"):
        train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), one_image_cache, LoraSettings(rank=4),
                   TrainConfig(steps=1, device="cpu"), offload=OffloadConfig(mode="resident", int8_compute="w8a8"))


def test_fp8_per_row_quantization_maps_each_row_absmax_to_448_within_e4m3_rounding():
    x = torch.randn(40, 64) * torch.linspace(0.01, 10, 40)[:, None]
    q, s = quantize_per_row(x, dtype=FP8)
    assert q.dtype == FP8 and s.shape == (40,)
    assert torch.all(q.float().abs().amax(1) == 448)
    # e4m3: 3 mantissa bits -> relative rounding error <= 1/16 for normal values
    back = q.float() * s[:, None]
    normal = x.abs() >= s[:, None] * 2 ** -6
    assert torch.all(((back - x).abs() <= x.abs() / 16 + 1e-7)[normal])


def test_fp8_forward_and_grad_input_match_the_dequant_path():
    """The CPU path is _scaled_mm's arithmetic in fp32 (e4m3 operands, row/column scales, bias), so
    this checks the scales, the transposes and the sw folding of grad_input."""
    layer = _layer()
    x = torch.randn(3, 32, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y = W8A8LinearFunction.apply(x, layer.weight_int8, layer.weight_scale, layer.bias, "fp8")
    y_ref = layer(x_ref)
    assert y.shape == y_ref.shape == (3, 32, 48)
    assert 1e-4 < _rel(y, y_ref) < 0.06  # e4m3 is coarser than int8, but not wrong
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert 1e-4 < _rel(x.grad, x_ref.grad) < 0.06
    # the module dispatches to it when asked, and falls back to dequant for shapes fp8 cannot take
    set_int8_compute(layer, "fp8")
    assert torch.equal(layer(x.detach()), y.detach())
    assert torch.equal(layer(x.detach()[:1, :16]), _layer()(x.detach()[:1, :16]))  # 16 rows: dequant
    assert fp8_mm_supported(17, 64, 48) and not fp8_mm_supported(17, 64, 40)


def test_fp8_on_cpu_is_refused_before_training(tiny_pipeline, one_image_cache):
    from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.offload import OffloadConfig
    from lowvram_lora.engine.train import train_lora

    with pytest.raises(ConfigError, match="fp8.*CUDA.*dequant"):
        train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), one_image_cache, LoraSettings(rank=4),
                   TrainConfig(steps=1, device="cpu"), offload=OffloadConfig(mode="resident", int8_compute="fp8"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_cuda_matches_the_cpu_arithmetic_and_dequant():
    from lowvram_lora.engine.slab.w8a8 import fp8_support_error

    if fp8_support_error(0) is not None:
        pytest.skip(fp8_support_error(0))
    layer = _layer(3072, 3072, device="cuda")
    x = torch.randn(2, 1024, 3072, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        set_int8_compute(layer, "fp8")
        y = layer(x)
        set_int8_compute(layer, "dequant")
        y_ref = layer(x_ref)
    assert y.dtype == torch.bfloat16 and _rel(y, y_ref) < 0.05
    # the tensor cores give what the fp32 reference of the same operands gives
    cpu = W8A8LinearFunction.apply(x.detach().float().cpu()[:, :64].to(torch.bfloat16), layer.weight_int8.cpu(),
                                   layer.weight_scale.cpu(), layer.bias.cpu(), "fp8")
    assert _rel(y[:, :64].cpu(), cpu) < 0.01
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert _rel(x.grad, x_ref.grad) < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backward", ["int8", "bf16"])
def test_w8a8_cuda_matches_dequant_within_tolerance(backward):
    layer = _layer(3072, 3072, device="cuda")
    x = torch.randn(2, 1024, 3072, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        set_int8_compute(layer, "w8a8", backward)
        y = layer(x)
        set_int8_compute(layer, "dequant")
        y_ref = layer(x_ref)
    assert y.dtype == torch.bfloat16 and _rel(y, y_ref) < 0.02
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert _rel(x.grad, x_ref.grad) < (0.03 if backward == "int8" else 0.01)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["fp8", "w8a8"])
def test_slab_compute_inside_a_compiled_region_matches_eager(mode):
    """Compiled blocks trace through the slab layers: the compiled layer gives eager's values and grad."""
    from lowvram_lora.engine.slab.w8a8 import fp8_support_error

    if mode == "fp8" and fp8_support_error(0) is not None:
        pytest.skip(fp8_support_error(0))
    layer = _layer(3072, 3072, device="cuda")
    set_int8_compute(layer, mode)
    x = torch.randn(1024, 3072, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def f(t):
        return torch.nn.functional.gelu(layer(t * 2))

    ref = f(x)
    (gx_ref,) = torch.autograd.grad(ref.float().square().sum(), x)
    compiled = torch.compile(f)
    out = compiled(x)
    (gx,) = torch.autograd.grad(out.float().square().sum(), x)
    assert _rel(out, ref) < 1e-2 and _rel(gx, gx_ref) < 1e-2
