"""The disk tier on a real GPU: training with blocks read from the slab file at every load (O_DIRECT readers,
pinned staging ring, CUDA events) equals training with the same blocks held in pinned RAM. A tiny Flux.1 slab
written by the project's builder; the same LoRA init, data and AdamW; several steps. On the GPU machine::

    source bench/gpu_env.sh && python3 -m pytest -m gpu -s tests/test_disk_tier_gpu.py
"""
import pytest
import torch

from lowvram_lora.engine.attention import training_attention
from lowvram_lora.engine.config import LoraSettings
from lowvram_lora.engine.families import get_family
from lowvram_lora.engine.offload import OffloadConfig, Workload, build_plan
from lowvram_lora.engine.offload.plan import with_disk_blocks
from lowvram_lora.engine.offload.footprint import measure_footprint
from lowvram_lora.engine.offload.streamer import apply_offload
from lowvram_lora.engine.slab import build_slab, load_slab_transformer
from lowvram_lora.engine.slab.testing import write_random_checkpoint
from lowvram_lora.engine.train.lora_attach import attach_lora

from helpers import flow_steps

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FAMILY = get_family("flux1")
DEV = torch.device("cuda")
STEPS = 4


@pytest.fixture(scope="module")
def slab(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk_gpu")
    cfg = dict(FAMILY.load_config("flux1-tiny"), num_layers=3, num_single_layers=6)
    ckpt = write_random_checkpoint(root / "ckpt", "flux1", config=cfg, layout="diffusers")
    return build_slab(ckpt, root / "tiny.slab.safetensors", progress=False)


def train(slab, disk: int, k: int, act: bool):
    """(losses per micro-step, LoRA gradients of the last step, streamer stats) after STEPS AdamW steps."""
    model = load_slab_transformer(slab, torch.bfloat16, verify="quick")[0]
    model.enable_gradient_checkpointing()
    params = attach_lora(model, FAMILY, LoraSettings(rank=4, alpha=4), seed=0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    plan = build_plan(measure_footprint(model, FAMILY), Workload(1, 64, 9), (), k, act)
    with_disk_blocks(plan, plan.streamed[len(plan.streamed) - disk:] if disk else [], staging_slots=3)
    handle = apply_offload(model, FAMILY, OffloadConfig(mode="stream"), DEV, plan=plan)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    model.train()
    losses = []
    try:
        with training_attention(DEV), torch.autocast("cuda", dtype=torch.bfloat16):
            for _ in range(STEPS):
                step_losses, grads = flow_steps(model, FAMILY, device=DEV)
                losses += step_losses
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                handle.end_step()
        torch.cuda.synchronize()
        return losses, grads, handle.stats()
    finally:
        handle.remove()


def _flat(grads):
    return torch.cat([v.flatten() for _, v in sorted(grads.items())])


@pytest.mark.parametrize("k, act", [(1, False), (2, True)], ids=["k1", "k2-actoffload-parts"])
def test_disk_streamed_training_equals_ram_streamed(slab, k, act):
    ram_losses, ram_grads, ram_stats = train(slab, 0, k, act)
    disk_losses, disk_grads, stats = train(slab, 7, k, act)
    rel = ((_flat(disk_grads) - _flat(ram_grads)).norm() / _flat(ram_grads).norm()).item()
    print(f"\n[k={k} act={act}] losses disk {disk_losses}\n  vs RAM {ram_losses}\n  LoRA grads rel diff {rel:.2e}; "
          f"disk stats { {k2: v for k2, v in stats.items() if k2.startswith(('disk', 'step_disk', 'staging'))} }")
    assert disk_losses == pytest.approx(ram_losses, rel=1e-4)
    assert rel <= 1e-4
    for name in ram_grads:
        torch.testing.assert_close(disk_grads[name], ram_grads[name], rtol=1e-4, atol=1e-6)
    assert stats["disk_reads"] > 0 and all(b > 0 for b in stats["step_disk_bytes"][1:])
    assert stats["sync_loads"] == 0 and stats["disk_resyncs"] == 0
