"""Split and data parallel on real GPUs (the mid-size random Flux.1 of test_offload_gpu.py).

One GPU: the split with both parts on cuda:0 (smoke test of the hooks, streaming and activation
offload in each part). Two GPUs: the split across cuda:0 / cuda:1 and data parallel over NCCL
(worker processes, as the node starts them) against one-process runs. On the GPU machine::

    source bench/gpu_env.sh && python3 -m pytest -m gpu -s tests/test_parallel_gpu.py
"""
import sys
from pathlib import Path

import pytest
import torch

from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.offload import OffloadConfig
from lowvram_lora.engine.parallel import ParallelConfig
from lowvram_lora.engine.train import train_lora

from test_offload_gpu import FAMILY, _flat, build, rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TWO = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


@pytest.fixture(scope="module")
def mid(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from train_bench import write_synthetic_cache

    model, cfg = build("mid")
    dataset = write_synthetic_cache(tmp_path_factory.mktemp("mid"), FAMILY, "flux1-dev", cfg, 512, 4, 0)
    return model, dataset


def _train(mid, offload=None, steps=4, batch_size=1, **kw):
    model, dataset = mid
    logs = []

    class CB:
        def on_progress(self, *a): pass
        def on_step(self, info): pass
        def log(self, m): logs.append(m)
        def should_stop(self): return False

    torch.cuda.empty_cache()
    r = train_lora(ModelConfig(dtype="bf16", family="flux1"), dataset, LoraSettings(rank=16, alpha=16),
                   TrainConfig(steps=steps, learning_rate=1e-3, device="cuda:0", batch_size=batch_size), CB(),
                   preloaded=(model, FAMILY, "flux1-dev"), offload=offload, **kw)
    print("\n".join(logs))
    return r


def _err(r, ref):
    keys = sorted(ref.state_dict)
    return rel(_flat({k: r.state_dict[k] for k in keys}), _flat({k: ref.state_dict[k] for k in keys}))


@pytest.mark.parametrize("devices", [("cuda:0", "cuda:0"), pytest.param(("cuda:0", "cuda:1"), marks=TWO)])
def test_split_trains_like_one_device(mid, devices):
    ref, ref2 = _train(mid), _train(mid)
    noise = _err(ref2, ref)
    for offload in (OffloadConfig(mode="resident"),
                    OffloadConfig(mode="stream", prefetch_depth=1, activation_offload=True)):
        r = _train(mid, offload, split=ParallelConfig(mode="split", devices=devices))
        err = _err(r, ref)
        print(f"[split {devices} {offload.mode}] LoRA rel err {err:.2e} (resident twice {noise:.2e}); losses "
              f"{[round(x, 5) for x in r.loss_history]} vs {[round(x, 5) for x in ref.loss_history]}; per-GPU peak "
              f"{r.settings['split_peak_vram_gb']} GB; cut {r.settings['offload_plan']['cut']}")
        assert err < max(2e-2, 20 * noise)
        assert r.loss_history == pytest.approx(ref.loss_history, rel=2e-2)
        assert r.settings["step_window"]["held_bytes"] > 0  # each part's modulation from the window, on its GPU
        if devices[0] != devices[1]:
            assert all(p > 0 for p in r.settings["split_peak_vram_gb"])  # both GPUs held a part


@pytest.mark.parametrize("devices, virtual_stages", [
    (("cuda:0", "cuda:0"), 1), pytest.param(("cuda:0", "cuda:1"), 1, marks=TWO),
    pytest.param(("cuda:0", "cuda:1"), 2, marks=TWO)])
def test_pipelined_split_trains_like_one_device(mid, devices, virtual_stages):
    """Issue 42: batches of 4 in 4 micro-batches through the two parts (1F1B, peer copies on their own streams, the
    first part's thread throttled), resident and streamed with activation offload on the second part, against the
    one-GPU run of the same batches; and interleaved (virtual_stages 2: four chunks, two per GPU, the interleaved
    1F1B order)."""
    ref, ref2 = _train(mid, batch_size=4), _train(mid, batch_size=4)
    noise = _err(ref2, ref)
    for offload in (OffloadConfig(mode="resident"),
                    OffloadConfig(mode="stream", prefetch_depth=1, activation_offload=True)):
        r = _train(mid, offload, batch_size=4, split=ParallelConfig(mode="split", devices=devices, micro_batches=4,
                                                                    virtual_stages=virtual_stages))
        err = _err(r, ref)
        stats = r.settings["offload_stats"]
        print(f"[pipelined split {devices} v{virtual_stages} {offload.mode}] LoRA rel err {err:.2e} (one GPU twice {noise:.2e}); losses "
              f"{[round(x, 5) for x in r.loss_history]} vs {[round(x, 5) for x in ref.loss_history]}; per-GPU peak "
              f"{r.settings['split_peak_vram_gb']} GB; cut {r.settings['offload_plan']['cut']}; "
              f"{stats['peer_bytes_copied'] / 1e6:.1f} MB peer copies")
        assert r.settings["offload_plan"]["micro_batches"] == 4 and stats["pipelined_micro_batches"] == 4 * 4
        assert r.settings["offload_plan"]["virtual_stages"] == virtual_stages
        assert r.settings["step_window"]["held_bytes"] > 0  # each micro-batch's modulation from the window
        assert err < max(2e-2, 20 * noise)
        assert r.loss_history == pytest.approx(ref.loss_history, rel=2e-2)
        if devices[0] != devices[1]:
            assert stats["peer_bytes_copied"] > 0 and all(p > 0 for p in r.settings["split_peak_vram_gb"])


@pytest.mark.parametrize("devices", [("cuda:0", "cuda:0"), pytest.param(("cuda:0", "cuda:1"), marks=TWO)])
def test_compiled_interleaved_split_trains_like_the_eager_one_device_run(mid, devices):
    """compile='blocks' on the pipelined split (explicit: auto keeps the split eager until it is timed on two GPUs):
    Inductor's blocks, compiled and run from the micro-batch threads, interleaved (v = 2, 4 micro-batches), resident
    and streamed with activation offload, against the eager one-GPU run of the same batches. One GPU: both parts on
    cuda:0 (the threads, lanes and compiled forwards on CUDA, not the speed)."""
    ref, ref2 = _train(mid, batch_size=4), _train(mid, batch_size=4)
    noise = _err(ref2, ref)
    for offload in (OffloadConfig(mode="resident", compile="blocks"),
                    OffloadConfig(mode="stream", prefetch_depth=1, activation_offload=True, compile="blocks")):
        torch._dynamo.reset()  # else the second run reuses the first's graphs and compiles (and counts) none
        r = _train(mid, offload, batch_size=4, split=ParallelConfig(mode="split", devices=devices, micro_batches=4,
                                                                    virtual_stages=2))
        err = _err(r, ref)
        print(f"[compiled interleaved split {devices} {offload.mode}] LoRA rel err {err:.2e} (eager one GPU twice "
              f"{noise:.2e}); losses {[round(x, 5) for x in r.loss_history]} vs "
              f"{[round(x, 5) for x in ref.loss_history]}; graphs {r.settings['compile']}")
        assert r.settings["compile"]["graphs"] > 0  # the compiled forwards ran
        assert "step_window" not in r.settings  # the window is off for a compiled split (placement.py)
        assert r.settings["offload_plan"]["virtual_stages"] == 2
        assert r.settings["offload_stats"]["pipelined_micro_batches"] == 4 * 4
        assert err < max(2e-2, 20 * noise)
        assert r.loss_history == pytest.approx(ref.loss_history, rel=2e-2)


@TWO
def test_data_parallel_over_nccl_matches_one_process_accumulating(tmp_path):
    from lowvram_lora.engine.testing import build_tiny_flux1_pipeline, make_tiny_dataset
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.config import DataConfig
    from lowvram_lora.engine.models.inspect import inspect_transformer
    from lowvram_lora.engine.runs.result_reuse import train_or_reuse

    pipe = build_tiny_flux1_pipeline(tmp_path / "pipe")
    cfg = ModelConfig(transformer_path=str(pipe), dtype="fp32")
    data = make_tiny_dataset(tmp_path / "data", count=6)
    cache = build_dataset_cache(cfg, DataConfig(path=str(data), resolution=128, bucket_step=32), tmp_path / "cache")
    lora, train = LoraSettings(rank=4), TrainConfig(steps=4, learning_rate=2e-3, seed=3, device="cuda:0")
    dp = train_or_reuse(inspect_transformer(cfg), cache, lora, train, tmp_path / "c1",
                        parallel=ParallelConfig(mode="data_parallel", devices=("cuda:0", "cuda:1")))
    info = dp.settings["data_parallel"]
    assert info["world_size"] == 2 and info["weight_checksums"][0] == info["weight_checksums"][1]
    single = train_lora(cfg, cache, lora, TrainConfig(**{**vars(train), "gradient_accumulation": 2}))
    err = max(rel(dp.state_dict[k], v) for k, v in single.state_dict.items())
    print(f"[data parallel NCCL] max LoRA rel err vs one process accumulating 2: {err:.2e}; per-GPU peak "
          f"{info['peak_vram_gb']}")
    assert err < 1e-3
