"""Finer recompute, host-held AdamW moments and the adapter's EMA on the host with them, on a real GPU (the mid-size
random Flux.1 of test_offload_gpu.py): same LoRA (and EMA) as the plain streamed run, less memory. On the GPU machine::

    source bench/gpu_env.sh && python3 -m pytest -m gpu -s tests/test_memory_gpu.py
"""
import pytest
import torch

from lowvram_lora.engine.config import AdapterConfig, LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.offload import OffloadConfig
from lowvram_lora.engine.train import train_lora
from lowvram_lora.engine.train.ema import AdapterEma

from test_offload_gpu import FAMILY, _flat, rel
from test_parallel_gpu import _err, _train, mid  # noqa: F401  (fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_chunks_and_host_moments_train_like_the_plain_streamed_run(mid):  # noqa: F811 (the fixture)
    plain = OffloadConfig(mode="stream", prefetch_depth=1, activation_offload=True)
    ref, ref2 = _train(mid, plain), _train(mid, plain)
    noise = _err(ref2, ref)
    for chunks, host in ((8, False), (1, True), (8, True)):
        cfg = OffloadConfig(mode="stream", prefetch_depth=1, activation_offload=True, recompute_chunks=chunks,
                            optimizer_on_host=host)
        r = _train(mid, cfg)
        err = _err(r, ref)
        print(f"[chunks {chunks} host moments {host}] LoRA rel err {err:.2e} (plain twice {noise:.2e}); peak "
              f"{r.peak_vram_gb:.3f} GB vs {ref.peak_vram_gb:.3f}; losses {[round(x, 5) for x in r.loss_history]}")
        assert err < max(2e-2, 20 * noise)
        assert r.peak_vram_gb < ref.peak_vram_gb


def test_ema_on_the_host_equals_ema_on_the_gpu_step_by_step():
    """The averages in pinned host memory (copied in after each AdamW step, lerped on the GPU, copied out non_blocking)
    against the same kept on the GPU: equal bit for bit after every step, read out (``swapped``) and applied for a
    preview (``applied``) right after an update, with its copy out still in flight."""
    g = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g))
              for s in ((16, 3072), (3072, 16), (3072,), ())]
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    gpu, host = AdapterEma(named, 0.9), AdapterEma(named, 0.9, on_host=True)
    assert all(s.device.type == "cpu" and s.is_pinned() for s in host.shadow)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    for _ in range(5):
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", generator=g)
        optimizer.step()
        gpu.update()
        host.update()
        with host.swapped():
            got = [p.detach().clone() for p in params]
        assert all(p.device.type == "cuda" for p in params)  # swapped back
        assert all(torch.equal(a.cpu(), b) for a, b in zip(gpu.shadow, got))
    weights = [p.detach().clone() for p in params]
    with host.applied():
        assert all(torch.equal(p, s) for p, s in zip(params, gpu.shadow))
    assert all(torch.equal(p, w) for p, w in zip(params, weights))


def test_streamed_training_with_the_ema_on_the_host_gives_the_ema_on_the_gpu(mid):  # noqa: F811 (the fixture)
    """Streamed with activation offload, 4 steps: the EMA kept in pinned host RAM (the plan's optimizer_on_host) equals
    the EMA kept on the GPU within the noise of two GPU runs, the plan says where it lives, and the peak is lower."""
    model, dataset = mid

    def run(host):
        torch.cuda.empty_cache()
        return train_lora(ModelConfig(dtype="bf16", family="flux1"), dataset,
                          LoraSettings(rank=16, alpha=16, adapter=AdapterConfig(ema_decay=0.9)),
                          TrainConfig(steps=4, learning_rate=1e-3, device="cuda:0"),
                          preloaded=(model, FAMILY, "flux1-dev"),
                          offload=OffloadConfig(mode="stream", prefetch_depth=1, activation_offload=True,
                                                optimizer_on_host=host))

    ref, ref2, host = run(False), run(False), run(True)
    assert ref.settings["offload_plan"]["ema"] == "device" and host.settings["offload_plan"]["ema"] == "host"
    noise, err = rel(_flat(ref2.ema_state_dict), _flat(ref.ema_state_dict)), \
        rel(_flat(host.ema_state_dict), _flat(ref.ema_state_dict))
    moved = rel(_flat(ref.ema_state_dict), _flat(ref.state_dict))
    print(f"[EMA on the host] rel err {err:.2e} (on the GPU twice {noise:.2e}; EMA against the weights {moved:.2e}); "
          f"peak {host.peak_vram_gb:.3f} GB vs {ref.peak_vram_gb:.3f}")
    assert err < max(2e-2, 20 * noise) and moved > 0
    assert host.peak_vram_gb < ref.peak_vram_gb
