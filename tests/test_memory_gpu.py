"""Finer recompute and host-held AdamW moments on a real GPU (the mid-size random Flux.1 of
test_offload_gpu.py): same LoRA as the plain streamed run, less memory. On the GPU machine::

    source bench/gpu_env.sh && python3 -m pytest -m gpu -s tests/test_memory_gpu.py
"""
import pytest
import torch

from lowvram_lora.engine.offload import OffloadConfig

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
