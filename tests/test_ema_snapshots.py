"""EMA of the adapter weights (engine/train/ema.py) and loadable snapshots (engine/train/snapshots.py).

EMA's reference is computed by hand from the weights of runs stopped after 1, 2, 3 steps (training is a pure function
of the seed, so they are the EMA run's weights at those steps). A resumed EMA run equals an uninterrupted one bit for
bit. Snapshots load back as the weights of a run of that many steps, only the latest K are kept, and where/how often
they are written is not part of the run's identity."""
import json

import pytest
import torch
from safetensors import safe_open

from lowvram_lora.engine.callbacks import TrainingCallback
from lowvram_lora.engine.config import AdapterConfig, LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.lora_io import load_lora
from lowvram_lora.engine.lora_io.formats import fold_scale
from lowvram_lora.engine.models import load_transformer
from lowvram_lora.engine.runs.result_reuse import training_key
from lowvram_lora.engine.train import train_lora
from lowvram_lora.engine.train.lora_attach import attach_lora, lora_state_dict


def _lora(**adapter):
    return LoraSettings(rank=2, alpha=2, adapter=AdapterConfig(**adapter))


def _train(pipe, cache, steps, **adapter):
    return train_lora(ModelConfig(transformer_path=str(pipe)), cache, _lora(**adapter),
                      TrainConfig(steps=steps, learning_rate=1e-2, seed=0, device="cpu"))


def test_ema_is_the_average_of_the_steps_weights(tiny_pipeline, one_image_cache):
    decay = 0.5
    model, family, _, _ = load_transformer(tiny_pipeline, dtype=torch.float32)
    attach_lora(model, family, _lora(), seed=0)  # the run's initial weights (seeded by the run's seed)
    ema = lora_state_dict(model)
    for k in (1, 2, 3):
        weights = _train(tiny_pipeline, one_image_cache, k).state_dict
        ema = {n: decay * ema[n] + (1 - decay) * weights[n] for n in ema}
    got = _train(tiny_pipeline, one_image_cache, 3, ema_decay=decay)
    assert got.settings["lora"]["adapter"]["ema_decay"] == decay
    for n, v in ema.items():
        torch.testing.assert_close(got.state_dict[n], v, rtol=1e-5, atol=1e-7, msg=n)
    assert not torch.equal(got.state_dict[n], weights[n])  # the average, not the last weights


def test_bad_ema_and_snapshot_settings_are_named():
    with pytest.raises(ConfigError, match=r"ema_decay=1.0 must be in \[0, 1\)"):
        AdapterConfig(ema_decay=1.0)
    with pytest.raises(ConfigError, match="snapshot_every=-1"):
        AdapterConfig(snapshot_every=-1)


def test_resume_with_ema_is_bit_exact(tiny_pipeline, tiny_cache, tmp_path):
    from lowvram_lora.engine.models.inspect import inspect_transformer
    from lowvram_lora.engine.runs.result_reuse import train_or_reuse

    class StopAt(TrainingCallback):
        def __init__(self, at=None):
            self.at, self.step = at, 0

        def on_step(self, info):
            self.step = info.step

        def should_stop(self):
            return self.at is not None and self.step >= self.at

    model = inspect_transformer(ModelConfig(transformer_path=str(tiny_pipeline)))
    train = TrainConfig(steps=4, learning_rate=5e-3, seed=3, save_every=2)
    lora = _lora(type="dora", ema_decay=0.7)
    whole = train_or_reuse(model, tiny_cache, lora, train, tmp_path / "a", StopAt())
    assert train_or_reuse(model, tiny_cache, lora, train, tmp_path / "b", StopAt(2)).interrupted
    resumed = train_or_reuse(model, tiny_cache, lora, train, tmp_path / "b", StopAt())
    assert resumed.steps == 4 and resumed.loss_history == whole.loss_history
    for k, v in whole.state_dict.items():
        assert torch.equal(resumed.state_dict[k], v), k


def test_snapshots_are_loadable_files_of_their_step_and_only_the_latest_are_kept(tiny_pipeline, one_image_cache,
                                                                                   tmp_path):
    run = _train(tiny_pipeline, one_image_cache, 5, snapshot_every=2, snapshot_keep=1, snapshot_dir=str(tmp_path))
    assert len(run.snapshots) == 1 and run.snapshots[0].endswith("step_0000004.safetensors")
    folder = tmp_path / next(p.name for p in tmp_path.iterdir())
    assert [p.name for p in folder.iterdir()] == ["step_0000004.safetensors"]  # step 2's removed, no temp files
    with safe_open(run.snapshots[0], "pt") as f:
        meta = f.metadata()
    assert meta["lowvram_lora.steps"] == "4" and meta["lowvram_lora.dataset_hash"] == run.dataset_hash
    assert json.loads(meta["lowvram_lora.settings"])["lora"]["adapter"]["snapshot_every"] == 2
    four = _train(tiny_pipeline, one_image_cache, 4)
    loaded = load_lora(run.snapshots[0]).state_dict
    for k, v in fold_scale(four.state_dict, four.scale).items():
        torch.testing.assert_close(loaded[k], v, rtol=1e-2, atol=1e-4)  # bf16 file


def test_where_and_how_often_snapshots_go_is_not_the_runs_identity():
    train = TrainConfig(steps=10)
    plain = training_key("m", "d", _lora(), train)
    assert plain == training_key("m", "d", _lora(snapshot_every=3, snapshot_keep=1, snapshot_dir="/x"), train)
    assert plain != training_key("m", "d", _lora(ema_decay=0.9), train)
