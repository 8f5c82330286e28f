"""int4 slabs on a real GPU: the Triton dequantization against the CPU reference, and an int4 slab's training
streamed from pinned RAM and from the slab file equal to the same slab resident. On the GPU machine::

    source bench/gpu_env.sh && python3 -m pytest -m gpu -s tests/test_slab_int4_gpu.py
"""
import pytest
import torch

from lowvram_lora.engine.attention import training_attention
from lowvram_lora.engine.config import LoraSettings
from lowvram_lora.engine.families import get_family
from lowvram_lora.engine.offload import OffloadConfig, Workload, build_plan
from lowvram_lora.engine.offload.footprint import measure_footprint
from lowvram_lora.engine.offload.plan import with_disk_blocks
from lowvram_lora.engine.offload.streamer import apply_offload
from lowvram_lora.engine.slab import Int4Linear, build_slab, load_slab_transformer
from lowvram_lora.engine.slab.dequant import dequantize_int4
from lowvram_lora.engine.slab.quantize import dequantize_groups, quantize_groups
from lowvram_lora.engine.slab.testing import write_random_checkpoint
from lowvram_lora.engine.train.lora_attach import attach_lora

from helpers import flow_steps

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = torch.device("cuda")
FAMILY = get_family("flux1")


@pytest.mark.parametrize("shape", [(3072, 3072), (18432, 3072), (5, 77), (64, 200)])
def test_gpu_int4_dequantize_matches_the_cpu_reference(shape):
    """Triton (one kernel) against ``dequantize_groups`` on the CPU, same packed bytes. The kernel may form
    q * s + m as one fused multiply-add, the reference rounds twice in fp32: at most one rounding of the output
    dtype apart (rtol = its epsilon), plus fp32 cancellation near zero (atol 1e-6 of the largest weight)."""
    w = torch.randn(shape, device=DEV) * 0.02
    packed, scale, low = quantize_groups(w)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        got = dequantize_int4(packed, scale, low, shape[1], dtype).cpu()
        ref = dequantize_groups(packed.cpu(), scale.cpu(), low.cpu(), shape[1], dtype)
        assert got.dtype == dtype and got.shape == shape
        torch.testing.assert_close(got.float(), ref.float(), rtol=torch.finfo(dtype).eps,
                                   atol=1e-6 * float(ref.float().abs().max()))
        assert (got == ref).float().mean() > 0.99


def test_gpu_int4_linear_matches_reference_under_autocast():
    torch.manual_seed(0)
    module = Int4Linear.from_linear(torch.nn.Linear(192, 256)).to(DEV)
    assert module.weight_int4.is_cuda and module.weight_scale.dtype == torch.float16
    x = torch.randn(2, 9, 192, device=DEV, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    w = dequantize_groups(module.weight_int4.cpu(), module.weight_scale.cpu(), module.weight_min.cpu(), 192,
                          torch.bfloat16).to(DEV)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = module(x)
        y_ref = torch.nn.functional.linear(x_ref, w, module.bias.to(torch.bfloat16))
    torch.testing.assert_close(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad)


@pytest.fixture(scope="module")
def slab(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4_gpu")
    cfg = dict(FAMILY.load_config("flux1-tiny"), num_layers=3, num_single_layers=6)
    ckpt = write_random_checkpoint(root / "ckpt", "flux1", config=cfg, layout="diffusers")
    return build_slab(ckpt, root / "tiny-int4.slab.safetensors", progress=False, bits=4)


def _train(slab, mode: str, disk: int = 0, steps: int = 3):
    model = load_slab_transformer(slab, torch.bfloat16, verify="quick")[0]
    model.enable_gradient_checkpointing()
    params = attach_lora(model, FAMILY, LoraSettings(rank=4, alpha=4), seed=0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    handle, stats = None, {}
    if mode == "resident":
        model.to(DEV)
    else:
        plan = build_plan(measure_footprint(model, FAMILY), Workload(1, 64, 9), (), 1, False)
        with_disk_blocks(plan, plan.streamed[len(plan.streamed) - disk:] if disk else [], staging_slots=3)
        handle = apply_offload(model, FAMILY, OffloadConfig(mode="stream"), DEV, plan=plan)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    model.train()
    losses = []
    try:
        with training_attention(DEV), torch.autocast("cuda", dtype=torch.bfloat16):
            for _ in range(steps):
                step_losses, grads = flow_steps(model, FAMILY, device=DEV)
                losses += step_losses
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if handle is not None:
                    handle.end_step()
        torch.cuda.synchronize()
        if handle is not None:
            stats = handle.stats()
        return losses, grads, stats
    finally:
        if handle is not None:
            handle.remove()


def test_int4_slab_streamed_from_ram_and_disk_trains_as_resident(slab):
    ref_losses, ref_grads, _ = _train(slab, "resident")
    for disk in (0, 4):
        losses, grads, stats = _train(slab, "stream", disk)
        print(f"\n[int4 stream, {disk} blocks on disk] losses {losses}\n  resident {ref_losses}")
        assert losses == pytest.approx(ref_losses, rel=1e-4)
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6)
        assert stats["sync_loads"] == 0
        if disk:
            assert stats["disk_reads"] > 0
