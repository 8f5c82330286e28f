"""EMA of the adapter weights (engine/train/ema.py) and loadable snapshots (engine/train/snapshots.py).

EMA's reference is computed by hand from the weights of runs stopped after 1, 2, 3 steps (training is a pure function
of the seed, so they are the EMA run's weights at those steps); the run's plain weights are those of a run without
EMA, bit for bit, and Save LoRA writes both, each as its own file. Previews draw with the EMA when ema_previews says so
(and leave training untouched). A resumed EMA run equals an uninterrupted one bit for bit, for every adapter type.
Snapshots load back as the weights (and the EMA) of a run of that many steps, only the latest K are kept, and
where/how often they are written is not part of the run's identity."""
import json

import pytest
import torch
from safetensors import safe_open

from lowvram_lora.engine.callbacks import TrainingCallback
from lowvram_lora.engine.config import ADAPTER_TYPES, AdapterConfig, LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.lora_io import load_lora
from lowvram_lora.engine.lora_io.adapters import get_adapter
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
        plain = _train(tiny_pipeline, one_image_cache, k)
        weights = plain.state_dict
        ema = {n: decay * ema[n] + (1 - decay) * weights[n] for n in ema}
    got = _train(tiny_pipeline, one_image_cache, 3, ema_decay=decay)
    assert got.settings["lora"]["adapter"]["ema_decay"] == decay
    assert got.ema_state_dict.keys() == got.state_dict.keys() == ema.keys()
    for n, v in ema.items():
        torch.testing.assert_close(got.ema_state_dict[n], v, rtol=1e-5, atol=1e-7, msg=n)
        assert torch.equal(got.state_dict[n], weights[n]), n  # the plain weights: the run's without EMA, exactly
    assert not torch.equal(got.ema_state_dict[n], weights[n])  # the average, not the last weights
    assert plain.ema_state_dict == {}  # EMA off: none


def test_bad_ema_and_snapshot_settings_are_named():
    with pytest.raises(ConfigError, match=r"ema_decay=1.0 must be in \[0, 1\)"):
        AdapterConfig(ema_decay=1.0)
    with pytest.raises(ConfigError, match="snapshot_every=-1"):
        AdapterConfig(snapshot_every=-1)


@pytest.mark.parametrize("kind", ADAPTER_TYPES)
def test_resume_with_each_type_and_ema_is_bit_exact(tiny_pipeline, one_image_cache, tmp_path, kind):
    """Stopped at step 2 and resumed: the weights and their EMA equal an uninterrupted run's bit for bit."""
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
    lora = _lora(type=kind, ema_decay=0.7)
    whole = train_or_reuse(model, one_image_cache, lora, train, tmp_path / "a", StopAt())
    first = train_or_reuse(model, one_image_cache, lora, train, tmp_path / "b", StopAt(2))
    assert first.interrupted and first.steps == 2
    resumed = train_or_reuse(model, one_image_cache, lora, train, tmp_path / "b", StopAt())
    assert resumed.steps == 4 and resumed.loss_history == whole.loss_history
    assert resumed.state_dict.keys() == whole.state_dict.keys() == whole.ema_state_dict.keys()
    assert all(get_adapter(kind).owns(k) for k in whole.state_dict)
    for k, v in whole.state_dict.items():
        assert torch.equal(resumed.state_dict[k], v), k
        assert torch.equal(resumed.ema_state_dict[k], whole.ema_state_dict[k]), k
    assert any(not torch.equal(whole.ema_state_dict[k], v) for k, v in whole.state_dict.items())


def test_snapshots_are_loadable_files_of_their_step_and_only_the_latest_are_kept(tiny_pipeline, one_image_cache,
                                                                                   tmp_path):
    run = _train(tiny_pipeline, one_image_cache, 5, ema_decay=0.5, snapshot_every=2, snapshot_keep=1,
                 snapshot_dir=str(tmp_path))
    assert [p.rsplit("/", 1)[-1] for p in run.snapshots] == ["step_0000004.safetensors",
                                                             "step_0000004_ema.safetensors"]
    folder = tmp_path / next(p.name for p in tmp_path.iterdir())
    assert sorted(p.name for p in folder.iterdir()) == ["step_0000004.safetensors",
                                                        "step_0000004_ema.safetensors"]  # step 2's removed, no temps
    for path, weights in zip(run.snapshots, ("last", "ema")):
        with safe_open(path, "pt") as f:
            meta = f.metadata()
        assert meta["lowvram_lora.steps"] == "4" and meta["lowvram_lora.dataset_hash"] == run.dataset_hash
        assert meta["lowvram_lora.weights"] == weights
        assert json.loads(meta["lowvram_lora.settings"])["lora"]["adapter"]["snapshot_every"] == 2
    four = _train(tiny_pipeline, one_image_cache, 4, ema_decay=0.5)
    for path, state in zip(run.snapshots, (four.state_dict, four.ema_state_dict)):
        loaded = load_lora(path).state_dict
        for k, v in fold_scale(state, four.scale).items():
            torch.testing.assert_close(loaded[k], v, rtol=1e-2, atol=1e-4)  # bf16 file


def test_save_lora_writes_the_ema_as_its_own_file_and_names_both(tiny_pipeline, one_image_cache, tmp_path):
    from lowvram_lora.nodes.paths import configure_standalone_dirs
    from lowvram_lora.nodes.save_lora import LowVRAMSaveLoRA

    run = _train(tiny_pipeline, one_image_cache, 3, ema_decay=0.5)
    configure_standalone_dirs(str(tmp_path / "models"), str(tmp_path / "out"))
    ui = LowVRAMSaveLoRA.execute(run, "loras/emarun", dtype="fp32").ui
    plain, ema = tmp_path / "out" / "loras" / "emarun_00001_.safetensors", \
        tmp_path / "out" / "loras" / "emarun_00001__ema.safetensors"
    assert ui["text"] == [str(plain)] and ui["ema"] == [str(ema)]
    assert {"filename": ema.name, "subfolder": "loras", "type": "output"} in ui["files"]
    for path, state, weights in ((plain, run.state_dict, "last"), (ema, run.ema_state_dict, "ema")):
        loaded = load_lora(path)
        assert loaded.metadata["lowvram_lora.weights"] == weights
        for k, v in fold_scale(state, run.scale).items():
            torch.testing.assert_close(loaded.state_dict[k], v, rtol=1e-6, atol=1e-8)
    # a second save takes the next number for both: nothing is replaced
    again = LowVRAMSaveLoRA.execute(run, "loras/emarun").ui
    assert again["ema"] == [str(ema.with_name("emarun_00002__ema.safetensors"))]
    without = LowVRAMSaveLoRA.execute(_train(tiny_pipeline, one_image_cache, 1), "loras/plain").ui
    assert "ema" not in without and not list((tmp_path / "out" / "loras").glob("plain*_ema.safetensors"))


@pytest.mark.parametrize("ema_previews", [True, False])
def test_previews_draw_with_the_ema_when_asked_and_training_is_unchanged(tiny_pipeline, tmp_path, monkeypatch,
                                                                         ema_previews):
    """The adapter's weights the sampler sees at the last step's preview: the EMA (ema_previews) or the last weights;
    either way the run's weights equal a run's without previews, bit for bit."""
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.config import DataConfig
    from lowvram_lora.engine.sampling import SamplingConfig
    from lowvram_lora.engine.sampling.sampler import Sampler
    from lowvram_lora.engine.testing import make_tiny_dataset

    data = make_tiny_dataset(tmp_path / "data", count=1, sizes=((64, 64),))
    cache = build_dataset_cache(ModelConfig(transformer_path=str(tiny_pipeline)),
                                DataConfig(path=str(data), resolution=64, bucket_step=32), tmp_path / "cache",
                                sample_prompts=("a red square",))
    seen = {}
    run_sampler = Sampler.run

    def spy(self, step, autocast):
        seen[step] = lora_state_dict(self.model)
        return run_sampler(self, step, autocast)

    monkeypatch.setattr(Sampler, "run", spy)
    lora = _lora(ema_decay=0.5, ema_previews=ema_previews)
    train = TrainConfig(steps=3, learning_rate=1e-2, seed=0, device="cpu")
    got = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), cache, lora, train,
                     sampling=SamplingConfig(every=3, steps=1, resolution=64, seed=1),
                     sample_dir=tmp_path / "samples")
    assert 3 in seen and got.sample_grids
    want = got.ema_state_dict if ema_previews else got.state_dict
    for k, v in want.items():
        assert torch.equal(seen[3][k], v), k
    quiet = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), cache, lora, train)
    for k, v in quiet.state_dict.items():
        assert torch.equal(got.state_dict[k], v) and torch.equal(got.ema_state_dict[k], quiet.ema_state_dict[k]), k


def test_where_and_how_often_snapshots_go_is_not_the_runs_identity():
    train = TrainConfig(steps=10)
    plain = training_key("m", "d", _lora(), train)
    assert plain == training_key("m", "d", _lora(snapshot_every=3, snapshot_keep=1, snapshot_dir="/x"), train)
    assert plain != training_key("m", "d", _lora(ema_decay=0.9), train)


def test_a_stored_run_keeps_its_ema(tmp_path):
    """The finished-run cache and a data-parallel worker's result (write_trained / read_trained) keep both weights."""
    from lowvram_lora.engine.lora_io.trained import TrainedLora, read_trained, write_trained

    g = torch.Generator().manual_seed(0)
    state = {"a.lora_A.weight": torch.randn(2, 4, generator=g), "a.lora_B.weight": torch.randn(4, 2, generator=g)}
    ema = {k: torch.randn(v.shape, generator=g) for k, v in state.items()}
    run = TrainedLora(state_dict=state, ema_state_dict=ema, rank=2, alpha=2, family="flux1", variant="flux1-tiny",
                      steps=3, requested_steps=3)
    write_trained(tmp_path, "r", run, "a test")
    back = read_trained(tmp_path, "r")
    assert back.state_dict.keys() == back.ema_state_dict.keys() == state.keys() and back.weights == "last"
    assert all(torch.equal(back.state_dict[k], state[k]) and torch.equal(back.ema_state_dict[k], ema[k]) for k in state)
    assert back.as_ema().state_dict is back.ema_state_dict and back.as_ema().weights == "ema"
    assert back.ema_in_previews  # no settings recorded: ema_previews' default
