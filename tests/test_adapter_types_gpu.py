"""LoHa, LoKr and DoRA on a real GPU, everywhere LoRA trains: blocks streamed (bf16 and int8 slab Linears, with
activation offload), the dual-GPU split (both parts on one GPU here; across two where there are two), data parallel
over NCCL (two GPUs) and inductor-compiled blocks. Each against the same type trained resident / in one process /
eager, with the tolerances of the LoRA tests (test_offload_gpu.py, test_parallel_gpu.py, test_compile.py). On the
GPU machine::

    source bench/gpu_env.sh && python3 -m pytest -m gpu -s tests/test_adapter_types_gpu.py
"""
import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lowvram_lora.engine.config import AdapterConfig, LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.offload import OffloadConfig
from lowvram_lora.engine.parallel import ParallelConfig
from lowvram_lora.engine.slab import Int8Linear
from lowvram_lora.engine.train import train_lora

from test_offload_gpu import FAMILY, _flat, build, rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TWO = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
NEW = ("loha", "lokr", "dora")


def _settings(kind):
    return LoraSettings(rank=16, alpha=16, adapter=AdapterConfig(type=kind))


def _to_int8(model):
    """A copy whose block Linears are Int8Linear (the slab's quantization, in memory)."""
    model = copy.deepcopy(model)
    for blocks in (model.transformer_blocks, model.single_transformer_blocks):
        for name, module in list(blocks.named_modules()):
            if type(module) is nn.Linear:
                parent, _, child = name.rpartition(".")
                setattr(blocks.get_submodule(parent) if parent else blocks, child, Int8Linear.from_linear(module))
    return model


@pytest.fixture(scope="module")
def mid(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from train_bench import write_synthetic_cache

    model, cfg = build("mid")
    dataset = write_synthetic_cache(tmp_path_factory.mktemp("mid"), FAMILY, "flux1-dev", cfg, 512, 2, 0)
    return {"bf16": model, "int8": _to_int8(model)}, dataset


def _train(model, dataset, kind, offload=None, steps=4, **kw):
    torch.cuda.empty_cache()
    return train_lora(ModelConfig(dtype="bf16", family="flux1"), dataset, _settings(kind),
                      TrainConfig(steps=steps, learning_rate=1e-3, device="cuda:0"),
                      preloaded=(model, FAMILY, "flux1-dev"), offload=offload, **kw)


def _err(r, ref):
    keys = sorted(ref.state_dict)  # all adapter weights as one vector
    return rel(_flat({k: r.state_dict[k] for k in keys}), _flat({k: ref.state_dict[k] for k in keys}))


@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize("kind", NEW)
def test_streamed_trains_like_resident(mid, kind, precision):
    models, dataset = mid
    model = models[precision]
    ref, ref2 = _train(model, dataset, kind), _train(model, dataset, kind)
    noise = _err(ref2, ref)
    r = _train(model, dataset, kind, OffloadConfig(mode="stream", prefetch_depth=1, activation_offload=True))
    err = _err(r, ref)
    print(f"\n[{kind} {precision} stream-k1-act] rel err {err:.2e} (resident twice {noise:.2e}); losses "
          f"{[round(x, 5) for x in r.loss_history]} vs {[round(x, 5) for x in ref.loss_history]}; peak "
          f"{r.peak_vram_gb:.3f} GB (resident {ref.peak_vram_gb:.3f})")
    assert r.adapter == kind and r.settings["offload_plan"]["mode"] == "stream"
    assert r.loss_history == pytest.approx(ref.loss_history, rel=2e-2)
    assert err <= max(2e-2, 3 * noise)
    assert r.peak_vram_gb < ref.peak_vram_gb


@pytest.mark.parametrize("devices", [("cuda:0", "cuda:0"), pytest.param(("cuda:0", "cuda:1"), marks=TWO)])
@pytest.mark.parametrize("kind", NEW)
def test_split_trains_like_one_device(mid, kind, devices):
    models, dataset = mid
    ref, ref2 = _train(models["int8"], dataset, kind), _train(models["int8"], dataset, kind)
    noise = _err(ref2, ref)
    r = _train(models["int8"], dataset, kind, OffloadConfig(mode="stream", prefetch_depth=1, activation_offload=True),
               split=ParallelConfig(mode="split", devices=devices))
    err = _err(r, ref)
    print(f"[{kind} split {devices}] rel err {err:.2e} (resident twice {noise:.2e})")
    assert err < max(2e-2, 20 * noise)
    assert r.loss_history == pytest.approx(ref.loss_history, rel=2e-2)


@TWO
@pytest.mark.parametrize("kind", NEW)
def test_data_parallel_over_nccl_matches_one_process_accumulating(tmp_path, kind):
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.config import DataConfig
    from lowvram_lora.engine.models.inspect import inspect_transformer
    from lowvram_lora.engine.runs.result_reuse import train_or_reuse
    from lowvram_lora.engine.testing import build_tiny_flux1_pipeline, make_tiny_dataset

    pipe = build_tiny_flux1_pipeline(tmp_path / "pipe")
    cfg = ModelConfig(transformer_path=str(pipe), dtype="fp32")
    data = make_tiny_dataset(tmp_path / "data", count=6)
    cache = build_dataset_cache(cfg, DataConfig(path=str(data), resolution=128, bucket_step=32), tmp_path / "cache")
    lora = LoraSettings(rank=4, adapter=AdapterConfig(type=kind))
    train = TrainConfig(steps=4, learning_rate=2e-3, seed=3, device="cuda:0")
    dp = train_or_reuse(inspect_transformer(cfg), cache, lora, train, tmp_path / "c1",
                        parallel=ParallelConfig(mode="data_parallel", devices=("cuda:0", "cuda:1")))
    info = dp.settings["data_parallel"]
    assert dp.adapter == kind and info["world_size"] == 2
    assert info["weight_checksums"][0] == info["weight_checksums"][1]
    single = train_lora(cfg, cache, lora, TrainConfig(**{**vars(train), "gradient_accumulation": 2}))
    err = max(rel(dp.state_dict[k], v) for k, v in single.state_dict.items())
    print(f"[{kind} data parallel NCCL] max rel err vs one process accumulating 2: {err:.2e}")
    assert err < 1e-3


@pytest.mark.parametrize("kind", NEW)
def test_inductor_compiled_blocks_train_like_eager(tiny_pipeline, one_image_cache, kind):
    def run(**kw):
        return train_lora(ModelConfig(transformer_path=str(tiny_pipeline), dtype="fp32"), one_image_cache,
                          LoraSettings(rank=4, adapter=AdapterConfig(type=kind)),
                          TrainConfig(steps=4, device="cuda", learning_rate=1e-3),
                          offload=OffloadConfig(mode="resident", **kw))

    eager, compiled = run(), run(compile="blocks")
    assert compiled.settings["compile"]["graphs"] > 0
    assert compiled.loss_history == pytest.approx(eager.loss_history, rel=1e-3)
    assert _err(compiled, eager) < 1e-2
