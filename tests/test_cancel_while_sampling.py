"""Cancel while a sample is being drawn (issue 28): the stop must save the state of the last finished step, so
the re-queue resumes from there, bit for bit; and the resumed run must show one story: the loss history before
the resume handed to the callback, and a final sample grid holding every checkpoint's column, those drawn
before the resume too. CPU, tiny Flux.1."""
import pytest
import torch

from lowvram_lora.engine.caching import build_dataset_cache
from lowvram_lora.engine.callbacks import TrainingCallback
from lowvram_lora.engine.config import DataConfig, LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.models.inspect import inspect_transformer
from lowvram_lora.engine.runs.result_reuse import train_or_reuse
from lowvram_lora.engine.sampling import SamplingConfig
from lowvram_lora.engine.testing import make_tiny_dataset

PROMPTS = ("a red square", "a blue circle")
CELL = 256  # engine/sampling.grid_image's cell


class Cancel(Exception):
    """Stands in for ComfyUI's InterruptProcessingException."""


class Watch(TrainingCallback):
    """Records what a node would show; raises ``Cancel`` while the sample of ``cancel_at`` is being drawn (where
    ComfyUI raises it: its progress-bar hook, which the preview update of ``on_sample`` calls)."""

    def __init__(self, cancel_at=None):
        self.cancel_at, self.lines, self.samples, self.resumed = cancel_at, [], [], None

    def log(self, message):
        self.lines.append(message)

    def on_sample(self, step, grid, path):
        self.samples.append((step, grid))
        if step == self.cancel_at:
            raise Cancel("cancelled while sampling")

    def on_resume(self, step, total, loss_history, lr_history):
        self.resumed = (step, total, list(loss_history), list(lr_history))


@pytest.fixture(scope="module")
def model(tiny_pipeline):
    return inspect_transformer(ModelConfig(transformer_path=str(tiny_pipeline)))


@pytest.fixture(scope="module")
def prompt_cache(tiny_pipeline, tmp_path_factory):
    root = tmp_path_factory.mktemp("sampled")
    data = make_tiny_dataset(root / "data", count=2, sizes=((64, 64),))
    return build_dataset_cache(ModelConfig(transformer_path=str(tiny_pipeline)),
                               DataConfig(path=str(data), resolution=64, bucket_step=32), root / "cache",
                               sample_prompts=PROMPTS)


def _run(model, cache, tmp, cb, out):
    train = TrainConfig(steps=8, learning_rate=5e-3, seed=3, save_every=100)  # no periodic save before the cancel
    return train_or_reuse(model, cache, LoraSettings(rank=2, alpha=2), train, tmp, cb,
                          sampling=SamplingConfig(every=3, steps=2, resolution=64, seed=1), sample_dir=out)


@pytest.fixture(scope="module")
def uninterrupted(model, prompt_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("plain")
    return _run(model, prompt_cache, root / "cache", Watch(), root / "samples")


def test_cancel_while_sampling_saves_and_the_requeue_resumes_from_that_step(model, prompt_cache, uninterrupted,
                                                                            tmp_path):
    cb = Watch(cancel_at=3)
    with pytest.raises(Cancel):
        _run(model, prompt_cache, tmp_path / "cache", cb, tmp_path / "first")
    assert any("state at step 3/8 saved" in line for line in cb.lines), cb.lines
    again = Watch()
    resumed = _run(model, prompt_cache, tmp_path / "cache", again, tmp_path / "second")
    assert any("resuming from step 3/8" in line for line in again.lines), again.lines
    assert resumed.steps == 8 and not resumed.interrupted
    assert resumed.loss_history == uninterrupted.loss_history
    for k, v in uninterrupted.state_dict.items():
        assert torch.equal(resumed.state_dict[k], v), k


def test_a_resumed_run_shows_the_loss_before_and_every_checkpoints_samples(model, prompt_cache, uninterrupted,
                                                                          tmp_path):
    with pytest.raises(Cancel):  # samples at 0 and 3 drawn, then cancelled during the one of step 6
        _run(model, prompt_cache, tmp_path / "cache", Watch(cancel_at=6), tmp_path / "first")
    again = Watch()
    resumed = _run(model, prompt_cache, tmp_path / "cache", again, tmp_path / "second")
    # The chart continues: the history of steps 1-6 is handed over before step 7 is reported.
    step, total, losses, lrs = again.resumed
    assert (step, total) == (6, 8) and losses == uninterrupted.loss_history[:6] and len(lrs) == 6
    # One grid: the columns of steps 0, 3 and 6 (before the resume) and 8, the same images as an uninterrupted run.
    assert [s for s, _ in again.samples] == [8]
    from PIL import Image

    final = Image.open(resumed.sample_grids[-1]).convert("RGB")
    plain = Image.open(uninterrupted.sample_grids[-1]).convert("RGB")
    from lowvram_lora.engine.sampling.grid import title_height

    assert final.size == plain.size == (4 * CELL, title_height(4 * CELL) + len(PROMPTS) * CELL)
    assert final.tobytes() == plain.tobytes()
    # Finished: the run's states and kept sample columns are gone with its resume folder.
    assert not list((tmp_path / "cache" / "resume").glob("*/*"))


class CancelMidSample(Watch):
    """ComfyUI's Cancel seen by the sampler's own poll, half-way through the samples of ``cancel_at``: the
    column is never finished, so the resumed run draws it again first."""

    def __init__(self, cancel_at):
        super().__init__()
        self.armed_at, self.armed = cancel_at, False

    def on_step(self, info):
        self.armed = info.step == self.armed_at

    def should_stop(self):
        if self.armed:  # the loop's own poll comes after the samples: this one is the sampler's
            raise Cancel("cancelled while sampling")
        return False


def test_cancel_mid_sample_stops_at_once_and_the_requeue_draws_that_checkpoint(model, prompt_cache, uninterrupted,
                                                                               tmp_path):
    cb = CancelMidSample(cancel_at=3)
    with pytest.raises(Cancel):
        _run(model, prompt_cache, tmp_path / "cache", cb, tmp_path / "first")
    assert [s for s, _ in cb.samples] == [0]  # the samples of step 3 were cut short, not finished first
    assert any("state at step 3/8 saved" in line for line in cb.lines), cb.lines
    again = Watch()
    resumed = _run(model, prompt_cache, tmp_path / "cache", again, tmp_path / "second")
    assert [s for s, _ in again.samples] == [3, 6, 8]
    assert resumed.loss_history == uninterrupted.loss_history
    from PIL import Image

    final = Image.open(resumed.sample_grids[-1]).convert("RGB")
    assert final.tobytes() == Image.open(uninterrupted.sample_grids[-1]).convert("RGB").tobytes()
