"""A reused finished run and its sample grid: changing only the sample prompts (or sampling settings) reuses the
LoRA (the same training) but never passes the earlier grid off as samples of the new prompts."""
import pytest

from lowvram_lora.engine.caching import build_dataset_cache
from lowvram_lora.engine.config import DataConfig, LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.models.inspect import inspect_transformer
from lowvram_lora.engine.sampling import SamplingConfig
from lowvram_lora.engine.testing import make_tiny_dataset
from lowvram_lora.engine.runs.result_reuse import train_or_reuse

from helpers import LogRecorder


@pytest.fixture(scope="module")
def setup(tiny_pipeline, tmp_path_factory):
    root = tmp_path_factory.mktemp("reuse_samples")
    data = make_tiny_dataset(root / "data", count=2, sizes=((64, 64),))
    cfg = ModelConfig(transformer_path=str(tiny_pipeline))

    def cache(prompts):
        return build_dataset_cache(cfg, DataConfig(path=str(data), resolution=64, bucket_step=32), root / "cache",
                                   sample_prompts=prompts)

    return inspect_transformer(cfg), cache, root


def _train(setup, prompts, **sampling):
    model, cache, root = setup
    cb = LogRecorder()
    sampling = SamplingConfig(**{"every": 2, "steps": 2, "resolution": 64, "seed": 1, **sampling})
    result = train_or_reuse(model, cache(prompts), LoraSettings(rank=4, alpha=4),
                            TrainConfig(steps=2, learning_rate=5e-3, seed=0), root / "out", cb,
                            sampling=sampling, sample_dir=root / "samples")
    return result, "\n".join(cb.logs)


def test_changed_sample_prompts_reuse_the_lora_but_not_the_stale_grid(setup):
    first, _ = _train(setup, ["a red square", "a blue circle"])
    assert first.sample_grids and first.settings["samples"]["prompts"] == ["a red square", "a blue circle"]

    same, log = _train(setup, ["a red square", "a blue circle"])
    assert "reusing the finished run" in log and same.sample_grids == first.sample_grids
    assert "no sample grid" not in log

    changed, log = _train(setup, ["a red square", "a blue circle", "a green triangle"])
    assert "reusing the finished run" in log  # the same training: not trained again
    assert changed.state_dict.keys() == first.state_dict.keys()
    assert changed.sample_grids == []  # neither the node's samples output nor Save LoRA gets the old grid
    assert "no sample grid for this run" in log and "2 other prompt(s)" in log and "not today's 3" in log
    assert first.sample_grids[-1] in log  # where the earlier grid still is

    reseeded, log = _train(setup, ["a red square", "a blue circle"], seed=9)
    assert reseeded.sample_grids == [] and "sample_seed 1 -> 9" in log
