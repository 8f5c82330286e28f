"""LoKr and DoRA with data parallel and the split, on the CPU (the CUDA twins are in test_adapter_types_gpu.py).

Data parallel: two gloo worker processes on ``cpu,cpu``; the reference is one process accumulating both ranks'
batches (the same mean gradient), as for LoRA in test_parallel.py; with EMA on, the average travels back from the
workers too. Split: the model cut across two CPU "devices" trains exactly as unsplit.
"""
import pytest
import torch

from lowvram_lora.engine.config import AdapterConfig, LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.lora_io.adapters import get_adapter
from lowvram_lora.engine.models import load_transformer
from lowvram_lora.engine.models.inspect import inspect_transformer
from lowvram_lora.engine.offload import OffloadConfig
from lowvram_lora.engine.parallel import ParallelConfig
from lowvram_lora.engine.runs.result_reuse import train_or_reuse
from lowvram_lora.engine.train import train_lora

KINDS = ("lokr", "dora")


def _lora(kind):
    return LoraSettings(rank=4, alpha=8, adapter=AdapterConfig(type=kind, ema_decay=0.6))


@pytest.mark.parametrize("kind", KINDS)
def test_data_parallel_equals_one_process_accumulating_both_batches(tiny_pipeline, tiny_cache, tmp_path, kind):
    model = inspect_transformer(ModelConfig(transformer_path=str(tiny_pipeline)))
    train = TrainConfig(steps=3, learning_rate=5e-3, seed=3, device="cpu")
    dp = train_or_reuse(model, tiny_cache, _lora(kind), train, tmp_path / "cache",
                        parallel=ParallelConfig(mode="data_parallel", devices=("cpu", "cpu")))
    assert dp.steps == 3 and not dp.interrupted and dp.adapter == kind
    info = dp.settings["data_parallel"]
    assert info["world_size"] == 2 and info["weight_checksums"][0] == info["weight_checksums"][1]
    assert dp.state_dict and all(get_adapter(kind).owns(k) for k in dp.state_dict)
    single = train_lora(model.config, tiny_cache, _lora(kind), TrainConfig(**{**vars(train), "gradient_accumulation": 2}))
    assert dp.state_dict.keys() == single.state_dict.keys() == dp.ema_state_dict.keys()
    for k, v in single.state_dict.items():
        torch.testing.assert_close(dp.state_dict[k], v, rtol=1e-4, atol=1e-6, msg=k)
        torch.testing.assert_close(dp.ema_state_dict[k], single.ema_state_dict[k], rtol=1e-4, atol=1e-6, msg=k)
    assert dp.loss_history == pytest.approx(single.loss_history, rel=1e-5)
    alone = train_lora(model.config, tiny_cache, _lora(kind), train)  # not what one batch per step makes
    assert any(not torch.allclose(alone.state_dict[k], v, atol=1e-6) for k, v in dp.state_dict.items())


@pytest.mark.parametrize("kind", KINDS)
def test_split_on_the_cpu_trains_exactly_as_unsplit(tiny_pipeline, tiny_cache, kind):
    cfg = ModelConfig(transformer_path=str(tiny_pipeline))
    train = TrainConfig(steps=3, learning_rate=5e-3, seed=2, device="cpu")
    base, family, _, variant = load_transformer(tiny_pipeline, dtype=torch.float32)
    split = train_lora(cfg, tiny_cache, _lora(kind), train, preloaded=(base, family, variant),
                       offload=OffloadConfig(mode="resident"),
                       split=ParallelConfig(mode="split", devices=("cpu", "cpu"), cut=3))
    whole = train_lora(cfg, tiny_cache, _lora(kind), train, preloaded=(base, family, variant))
    assert split.settings["offload_plan"]["cut"] == 3 and split.adapter == kind
    for k, v in whole.state_dict.items():
        torch.testing.assert_close(split.state_dict[k], v, rtol=1e-5, atol=1e-7, msg=k)
        torch.testing.assert_close(split.ema_state_dict[k], whole.ema_state_dict[k], rtol=1e-5, atol=1e-7, msg=k)
