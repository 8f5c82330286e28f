"""engine/train/optimizers.py: the flat buffer behind adamw8bit (CPU: the mechanism, with torch's AdamW;
GPU: torchao's AdamW8bit on it against fp32 AdamW)."""
import pytest
import torch

from lowvram_lora.engine.config import TrainConfig
from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.train.optimizers import BLOCK, flatten_params, make_optimizer


def _params(device="cpu"):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, generator=g).to(device)) for s in [(16, 300), (300, 16), (7,), (4, 4)]]


def _loss(params, x):
    a, b, c, d = params
    return ((x @ a @ b).tanh().sum() + c.square().sum() + (d @ d).sum())


def test_flat_params_are_views_and_autograd_accumulates_into_the_flat_gradient():
    params = _params()
    before = [p.detach().clone() for p in params]
    flat = flatten_params(params, multiple=BLOCK)
    assert flat.numel() % BLOCK == 0 and flat.numel() >= sum(p.numel() for p in params)
    for p, b in zip(params, before):
        assert torch.equal(p, b) and p.data_ptr() >= flat.data_ptr()  # same values, now inside flat
    x = torch.randn(3, 16)
    _loss(params, x).backward()
    _loss(params, x).backward()  # accumulates, as gradient accumulation does
    ref = [p.detach().clone().requires_grad_(True) for p in before]
    (2 * _loss(ref, x)).backward()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad, r.grad)
        assert p.grad.data_ptr() >= flat.grad.data_ptr()  # still the view, not a new tensor
    used = torch.zeros_like(flat, dtype=torch.bool)
    for p in params:
        start = (p.data_ptr() - flat.data_ptr()) // flat.element_size()
        assert start % BLOCK == 0  # every tensor starts a quantization block
        used[start:start + p.numel()] = True
    assert not flat.grad[~used].any()  # padding: no gradient


def test_an_optimizer_on_the_flat_parameter_steps_like_one_on_the_tensors():
    params, ref = _params(), _params()
    flat = flatten_params(params)
    opt = torch.optim.AdamW([flat], lr=1e-2, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.01)
    x = torch.randn(3, 16)
    for _ in range(3):
        _loss(params, x).backward()
        opt.step()
        flat.grad.zero_()
        _loss(ref, x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r)


def test_flat_params_need_one_device_and_dtype():
    params = _params()
    params[0] = torch.nn.Parameter(params[0].detach().double())
    with pytest.raises(ConfigError, match="one device and dtype"):
        flatten_params(params)


def test_plain_adamw_is_fused_on_cuda_only():
    opt = make_optimizer(_params(), TrainConfig())
    assert not opt.defaults.get("fused")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flat_adamw8bit_steps_exactly_like_torchaos_per_tensor_adamw8bit():
    """LoRA tensors are whole quantization blocks (rank x 3072 = rank x 12 x 256), so one flat buffer
    gives torchao the same blocks it would make per tensor: the same update, in one call."""
    torchao = pytest.importorskip("torchao.optim")
    g = torch.Generator().manual_seed(0)
    shapes = [(16, 768), (768, 16), (4, 3072)]
    start = [torch.randn(*s, generator=g).cuda() for s in shapes]
    params = [torch.nn.Parameter(t.clone()) for t in start]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    opt = make_optimizer(params, TrainConfig(optimizer="adamw8bit", learning_rate=1e-2))
    ref_opt = torchao.AdamW8bit(ref, lr=1e-2, weight_decay=TrainConfig().weight_decay, block_size=BLOCK)
    assert len(opt.param_groups[0]["params"]) == 1  # one flat tensor: one torchao call per step
    x = torch.randn(3, 16, device="cuda")

    def loss(ps):
        a, b, c = ps
        return (x @ a @ b).tanh().sum() + (c @ c.t()).square().mean()

    for _ in range(5):
        loss(params).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert params[0].grad is not None and not params[0].grad.any()  # zeroed in place, views kept
        loss(ref).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for i, (p, r, s) in enumerate(zip(params, ref, start)):
        err = float((p - r).detach().norm() / (r - s).detach().norm())
        assert err < 1e-3, (i, err)
    fp32 = make_optimizer([torch.nn.Parameter(t.clone()) for t in start], TrainConfig())
    assert fp32.defaults.get("fused")
