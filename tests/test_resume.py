"""Interrupts and resume: a stopped run saves its state, a rerun continues bit for bit."""
import json

import pytest
import torch

from lowvram_lora.engine.callbacks import TrainingCallback
from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.models.inspect import inspect_transformer
from lowvram_lora.engine.train.result_reuse import load_finished, train_or_reuse, training_key


class Log(TrainingCallback):
    """Records log lines; stops (returns True or raises) after ``stop_after`` steps."""

    def __init__(self, stop_after=None, raise_exc=None):
        self.lines, self.steps, self.stop_after, self.raise_exc = [], 0, stop_after, raise_exc

    def log(self, message):
        self.lines.append(message)

    def on_step(self, info):
        self.steps = info.step

    def should_stop(self):
        if self.stop_after is not None and self.steps >= self.stop_after:
            if self.raise_exc is not None:
                raise self.raise_exc
            return True
        return False


class ComfyInterrupt(Exception):
    """Stands in for ComfyUI's InterruptProcessingException (raised from should_stop)."""


def _run(model, cache, tmp, cb, **train):
    settings = dict(steps=10, learning_rate=5e-3, seed=3, gradient_accumulation=2, lr_scheduler="cosine",
                    warmup_steps=2, save_every=4)
    settings.update(train)
    return train_or_reuse(model, cache, LoraSettings(rank=2, alpha=2), TrainConfig(**settings), tmp, cb)


@pytest.fixture(scope="module")
def model(tiny_pipeline):
    return inspect_transformer(ModelConfig(transformer_path=str(tiny_pipeline)))


@pytest.fixture(scope="module")
def uninterrupted(model, tiny_cache, tmp_path_factory):
    return _run(model, tiny_cache, tmp_path_factory.mktemp("plain"), Log())


@pytest.mark.parametrize("stop", ["flag", "comfy_cancel", "ctrl_c"])
def test_interrupted_then_resumed_equals_uninterrupted_bit_for_bit(model, tiny_cache, uninterrupted, tmp_path, stop):
    exc = {"flag": None, "comfy_cancel": ComfyInterrupt("cancelled"), "ctrl_c": KeyboardInterrupt()}[stop]
    cb = Log(stop_after=6, raise_exc=exc)
    if exc is None:
        first = _run(model, tiny_cache, tmp_path, cb)
        assert first.interrupted and first.steps == 6
    else:
        with pytest.raises(type(exc)):
            _run(model, tiny_cache, tmp_path, cb)
    assert any("state at step 6/10 saved" in line for line in cb.lines)
    states = sorted((tmp_path / "resume").glob("*/state-*.json"))
    assert [p.name for p in states] == ["state-0000006.json"]  # step 4's periodic state was replaced
    info = json.loads(states[0].read_text())
    assert info["step"] == 6 and info["batches_drawn"] == 12 and "scheduler" in info
    # Never reused as finished.
    assert not list((tmp_path / "trained").glob("*.json")) if (tmp_path / "trained").exists() else True

    again = Log()
    resumed = _run(model, tiny_cache, tmp_path, again)
    assert any("resuming from step 6/10" in line for line in again.lines)
    assert resumed.steps == 10 and not resumed.interrupted
    assert resumed.loss_history == uninterrupted.loss_history
    assert resumed.lr_history == uninterrupted.lr_history
    for k, v in uninterrupted.state_dict.items():
        assert torch.equal(resumed.state_dict[k], v), k
    assert not list((tmp_path / "resume").glob("*/state-*"))  # finished: states dropped, the run stored
    assert list((tmp_path / "trained").glob("*.json"))


def test_kill_between_saves_resumes_from_the_latest_complete_state(model, tiny_cache, uninterrupted, tmp_path):
    with pytest.raises(ComfyInterrupt):  # saved at 4 (periodic) and 6 (stop)
        _run(model, tiny_cache, tmp_path, Log(stop_after=6, raise_exc=ComfyInterrupt()))
    folder = next((tmp_path / "resume").iterdir())
    # A save of step 8 killed after its tensors, before its JSON (the completion mark):
    (folder / "state-0000008.safetensors").write_bytes(b"half written")
    (folder / ".state-0000008.json.tmp-999999-0a0b0c0d").write_text("{")
    again = Log()
    resumed = _run(model, tiny_cache, tmp_path, again)
    assert any("resuming from step 6/10" in line for line in again.lines)
    assert all(torch.equal(resumed.state_dict[k], v) for k, v in uninterrupted.state_dict.items())


def test_changed_setting_says_so_and_starts_fresh(model, tiny_cache, tmp_path):
    _run(model, tiny_cache, tmp_path, Log(stop_after=5))
    cb = Log()
    result = _run(model, tiny_cache, tmp_path, cb, learning_rate=1e-3, steps=6, save_every=-1)
    text = "\n".join(cb.lines)
    assert "other settings" in text and "learning_rate: 0.005 -> 0.001" in text and "starts fresh" in text
    assert "resuming" not in text and result.steps == 6


def test_state_files_are_safetensors_and_json_only(model, tiny_cache, tmp_path):
    from safetensors import safe_open

    _run(model, tiny_cache, tmp_path, Log(stop_after=3))
    folder = next((tmp_path / "resume").iterdir())
    assert sorted(p.suffix for p in folder.iterdir()) == [".json", ".safetensors"]
    with safe_open(str(next(folder.glob("*.safetensors"))), framework="pt") as f:
        keys = list(f.keys())
    assert any(k.startswith("lora/") for k in keys) and any(k.startswith("optim/") for k in keys)
    assert "rng/cpu" in set(keys)


def test_interrupted_run_is_never_stored_as_finished(model, tiny_cache, tmp_path):
    lora, train = LoraSettings(rank=2, alpha=2), TrainConfig(steps=10, seed=3, save_every=4)
    result = train_or_reuse(model, tiny_cache, lora, train, tmp_path, Log(stop_after=2))
    assert result.interrupted
    assert load_finished(tmp_path, training_key(model.identity, tiny_cache.dataset_hash, lora, train)) is None


def test_ctrl_c_in_lowvram_lora_run_saves_state_and_the_rerun_resumes(tmp_path, capsys, monkeypatch):
    """A real SIGINT during training: the runner's handler asks the engine to stop, the
    engine writes its state, the command exits 130; the same command again resumes."""
    import argparse
    import os
    import signal

    from lowvram_lora.demo import ensure_demo_assets
    from lowvram_lora.engine.callbacks import ConsoleCallback
    from lowvram_lora.host.run_command import run_workflow_command
    from lowvram_lora.host.templates import WORKFLOWS_DIR
    from lowvram_lora.nodes import NODE_CLASS_MAPPINGS
    from lowvram_lora.nodes.paths import configure_standalone_dirs

    assets = ensure_demo_assets(tmp_path / "demo")
    args = argparse.Namespace(
        workflow=str(WORKFLOWS_DIR / "demo_tiny_lora.json"), models_dir=str(assets["models"]),
        output_dir=str(tmp_path / "out"), no_progress=True, traceback=False,
        overrides=[f"2.dataset_path={assets['dataset']}", "4.steps=8", "4.warmup_steps=0", "4.save_every=-1"])
    original = ConsoleCallback.on_step

    def press_ctrl_c_at_step_3(self, info):
        original(self, info)
        if info.step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(ConsoleCallback, "on_step", press_ctrl_c_at_step_3)
    assert run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs) == 130
    captured = capsys.readouterr()
    assert "state at step 3/8 saved" in captured.out and "run the same command again to resume" in captured.err
    assert not list((tmp_path / "out" / "loras").glob("*.safetensors"))  # no partial LoRA passed off as done
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored

    monkeypatch.setattr(ConsoleCallback, "on_step", original)
    assert run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs) == 0
    out = capsys.readouterr().out
    assert "resuming from step 3/8" in out
    assert len(list((tmp_path / "out" / "loras").glob("*.safetensors"))) == 1


def test_comfy_progress_hook_interrupt_in_on_step_also_saves(model, tiny_cache, uninterrupted, tmp_path):
    """ComfyUI's progress-bar hook raises its interrupt from ProgressBar.update: on_step, not should_stop."""
    class HookRaises(Log):
        def on_step(self, info):
            if info.step == 5:
                raise ComfyInterrupt("cancelled")

    with pytest.raises(ComfyInterrupt):
        _run(model, tiny_cache, tmp_path, HookRaises())
    again = Log()
    resumed = _run(model, tiny_cache, tmp_path, again)
    assert any("resuming from step 5/10" in line for line in again.lines)
    assert all(torch.equal(resumed.state_dict[k], v) for k, v in uninterrupted.state_dict.items())


def test_full_disk_during_a_periodic_save_warns_and_training_goes_on(model, tiny_cache, tmp_path, monkeypatch):
    import errno

    from lowvram_lora.engine.train import resume

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(resume, "save_file", full)
    cb = Log()
    result = _run(model, tiny_cache, tmp_path, cb)
    assert result.steps == 10 and any("periodic training state was not saved" in m and "disk is full" in m
                                      for m in cb.lines)
