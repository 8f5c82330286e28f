"""Validation loss on a held-out split at fixed noise, drawn and logged; the CSV and TensorBoard logs."""
import csv
import sys

import pytest
import torch

from lowvram_lora.engine.caching import build_dataset_cache, open_dataset_cache
from lowvram_lora.engine.callbacks import TrainingCallback
from lowvram_lora.engine.config import DataConfig, LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.data.options import DatasetOptions
from lowvram_lora.engine.errors import ConfigError, DatasetError
from lowvram_lora.engine.families import predict_velocity
from lowvram_lora.engine.models import load_transformer
from lowvram_lora.engine.testing import make_tiny_dataset
from lowvram_lora.engine.train import train_lora
from lowvram_lora.engine.train.loss_options import LossOptions

from helpers import merged


def _build(pipe, data, root, **options):
    return build_dataset_cache(ModelConfig(transformer_path=str(pipe)),
                               DataConfig(path=str(data), resolution=128, bucket_step=32), root / "cache",
                               options=DatasetOptions(**options))


@pytest.fixture(scope="module")
def split_cache(tiny_pipeline, tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    return _build(tiny_pipeline, make_tiny_dataset(root / "data", count=3), root, validation_fraction=0.3)


class Steps(TrainingCallback):
    def __init__(self):
        self.infos, self.said = [], []

    def on_step(self, info):
        self.infos.append(info)

    def log(self, message):
        self.said.append(message)


def test_the_split_is_fixed_by_file_names_and_kept_in_the_manifest(tiny_pipeline, split_cache, tmp_path):
    assert len(split_cache.items) == 2 and len(split_cache.validation_items) == 1
    held = split_cache.validation_items[0].image
    assert held not in {i.image for i in split_cache.items}
    reopened = open_dataset_cache(split_cache.manifest_path)
    assert [i.image for i in reopened.validation_items] == [held]
    # A folder of its own, scanned like the dataset; an empty one is a named error.
    folder = make_tiny_dataset(tmp_path / "val", count=1, seed=5)
    by_folder = _build(tiny_pipeline, split_cache.items[0].image.rsplit("/", 1)[0], tmp_path,
                       validation_folder=str(folder))
    assert len(by_folder.validation_items) == 1 and len(by_folder.items) == 3
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="validation_folder '.*empty': no images found"):
        _build(tiny_pipeline, folder, tmp_path, validation_folder=str(tmp_path / "empty"))
    with pytest.raises(DatasetError, match="validation_folder '.*nowhere': dataset folder .* does not exist"):
        _build(tiny_pipeline, folder, tmp_path, validation_folder=str(tmp_path / "nowhere"))
    with pytest.raises(DatasetError, match="validation_fraction=0.5 needs at least 2 images"):
        _build(tiny_pipeline, folder, tmp_path, validation_fraction=0.5)


def test_validation_loss_is_the_loss_at_the_fixed_noise_and_is_logged(tiny_pipeline, split_cache, tmp_path,
                                                                      monkeypatch):
    base, family, _, variant = load_transformer(tiny_pipeline, dtype=torch.float32)
    rec = Steps()
    result = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), split_cache, LoraSettings(rank=4),
                        TrainConfig(steps=3, learning_rate=1e-3, seed=11, device="cpu"), rec,
                        preloaded=(base, family, variant),
                        loss=LossOptions(validation_every=2, validation_timesteps=3), log_dir=tmp_path / "logs")
    vals = [(i.step, i.validation_loss) for i in rec.infos if i.validation_loss is not None]
    assert [s for s, _ in vals] == [2, 3]  # every 2 steps and after the last
    record = result.settings["validation"]
    assert record["steps"] == [2, 3] and record["sigmas"] == pytest.approx([1 / 6, 0.5, 5 / 6], abs=1e-6)
    # By hand, with the trained LoRA merged in: item i at level k noised with Generator(seed + i*K + k).
    model = merged(base, result.state_dict, result.scale)
    lat, emb = split_cache.load_item(split_cache.validation_items[0])
    lat, emb = lat[None], split_cache.collate_text([emb])
    losses = []
    with torch.no_grad():
        for k, sigma in enumerate([1 / 6, 0.5, 5 / 6]):
            noise = torch.randn(lat.shape, generator=torch.Generator().manual_seed(11 + k))
            s = torch.tensor([sigma])
            pred = predict_velocity(family, model, (1 - sigma) * lat + sigma * noise, emb, s, 1.0)
            losses.append(torch.nn.functional.mse_loss(pred, noise - lat).item())
    assert vals[-1][1] == pytest.approx(sum(losses) / 3, rel=1e-4)
    # The CSV beside the run: one row per step, validation where it ran.
    rows = list(csv.DictReader(open(tmp_path / "logs" / "training_log.csv")))
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert rows[0]["validation_loss"] == "" and float(rows[2]["validation_loss"]) == pytest.approx(vals[-1][1], 1e-4)
    assert float(rows[1]["loss"]) == pytest.approx(result.loss_history[1], rel=1e-5)
    assert {"lr", "seconds_per_step", "peak_vram_gb", "host_ram_gb"} <= set(rows[0])


def test_tensorboard_events_or_a_clear_message_without_it(tiny_pipeline, one_image_cache, tmp_path, monkeypatch):
    from lowvram_lora.engine.train.run_log import RunLog
    from lowvram_lora.engine.callbacks import StepInfo

    said = Steps()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    log = RunLog(said, tmp_path / "a")
    log.on_step(StepInfo(1, 2, 0.5, 1e-4, 1.0, 0.1, 0.0))
    log.close()
    assert log.writer is None and "optional 'tensorboard' package is not installed" in said.said[0]
    assert said.infos[0].loss == 0.5  # passed on
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard")
    pytest.importorskip("tensorboard")
    log = RunLog(said, tmp_path / "b")
    log.on_step(StepInfo(1, 2, 0.5, 1e-4, 1.0, 0.1, 0.0, validation_loss=0.25))
    log.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "b"))
    acc.Reload()
    assert acc.Scalars("loss/validation")[0].value == pytest.approx(0.25)
    assert acc.Scalars("loss/train")[0].value == pytest.approx(0.5)


def test_validation_without_a_split_is_refused(tiny_pipeline, one_image_cache):
    with pytest.raises(ConfigError, match="validation_every=5 but the dataset has no validation split"):
        train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), one_image_cache, LoraSettings(rank=4),
                   TrainConfig(steps=1, device="cpu"), loss=LossOptions(validation_every=5))


def test_the_option_nodes_build_the_configs_and_refuse_bad_values(tmp_path):
    from lowvram_lora.nodes import NODE_CLASS_MAPPINGS

    (opts,) = NODE_CLASS_MAPPINGS["LowVRAMDatasetOptions"].execute(
        mask_source="alpha", validation_folder=str(tmp_path)).result
    assert opts == DatasetOptions(mask_source="alpha", validation_folder=str(tmp_path))
    (loss,) = NODE_CLASS_MAPPINGS["LowVRAMLossOptions"].execute(unmasked_weight=0.1, validation_every=7).result
    assert loss == LossOptions(unmasked_weight=0.1, validation_every=7)
    (opts,) = NODE_CLASS_MAPPINGS["LowVRAMDatasetOptions"].execute(preservation_prompt=" a dog ",
                                                                  resolutions="512, 768").result
    assert (opts.preservation_prompt, opts.resolutions) == ("a dog", (512, 768))
    (loss,) = NODE_CLASS_MAPPINGS["LowVRAMLossOptions"].execute(preservation_weight=0.5).result
    assert loss.preservation_weight == 0.5 and loss.result_key_settings() == {"preservation_weight": 0.5}
    schema = NODE_CLASS_MAPPINGS["LowVRAMDatasetOptions"].define_schema()
    assert {i.id for i in schema.inputs if i.optional} == {"preservation_prompt", "resolutions"}
    with pytest.raises(ConfigError, match="validation_fraction or validation_folder, not both"):
        DatasetOptions(validation_fraction=0.1, validation_folder="x")
    with pytest.raises(ConfigError, match="unmasked_weight=1.5 must be a number in"):
        LossOptions(unmasked_weight=1.5)
    # Only what changes the weights is in the run's key; the defaults leave it as before.
    assert LossOptions(validation_every=3, tensorboard=False).result_key_settings() == {}
    assert LossOptions(unmasked_weight=0.1).result_key_settings() == {"unmasked_weight": 0.1}


def test_regularization_images_are_cached_apart_and_interleaved_by_ratio(tiny_pipeline, split_cache, tmp_path):
    assert [LossOptions(reg_ratio=0.5).is_reg(i) for i in range(4)] == [False, True, False, True]
    assert [LossOptions(reg_ratio=0.25).is_reg(i) for i in range(8)] == [False, False, False, True] * 2
    data = split_cache.items[0].image.rsplit("/", 1)[0]
    with pytest.raises(DatasetError, match="reg_folder '.*nowhere': dataset folder .* does not exist"):
        _build(tiny_pipeline, data, tmp_path, reg_folder=str(tmp_path / "nowhere"))
    reg = make_tiny_dataset(tmp_path / "reg", count=1, seed=9)
    cache = _build(tiny_pipeline, data, tmp_path, reg_folder=str(reg), validation_fraction=0.3)
    assert len(cache.reg_items) == 1 and cache.reg_items[0].image.startswith(str(reg))
    assert open_dataset_cache(cache.manifest_path).reg_items == cache.reg_items
    loaded = []
    load = cache.load_item
    cache.load_item = lambda item, *a: (loaded.append(item.image), load(item, *a))[1]
    base, family, _, variant = load_transformer(tiny_pipeline, dtype=torch.float32)
    result = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), cache, LoraSettings(rank=4),
                        TrainConfig(steps=2, learning_rate=1e-3, device="cpu"), preloaded=(base, family, variant),
                        loss=LossOptions(reg_ratio=0.5, prior_loss_weight=0.0, validation_every=-1),
                        step_window=0)  # each item loaded once (the modulation window loads a step's items twice)
    assert [p.startswith(str(reg)) for p in loaded] == [False, True]
    assert result.loss_history[1] == 0.0 and result.loss_history[0] > 0
