"""Interrupts and resume: a stopped run saves its state, a rerun continues bit for bit; full disks, damaged
states, two runs of one key, 8-bit optimizer state."""
import json
import re

import pytest
import torch

from lowvram_lora.engine.callbacks import TrainingCallback
from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.models.inspect import inspect_transformer
from lowvram_lora.engine.runs.result_reuse import load_finished, model_key, train_or_reuse, training_key


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
    assert load_finished(tmp_path, training_key(model_key(model), tiny_cache.dataset_hash, lora, train)) is None


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

    assets = ensure_demo_assets(tmp_path / "demo", trained=False)
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
    # The handler before the run: default_int_handler in a foreground shell, SIG_IGN when a shell started pytest
    # in the background (`make test &`); the runner must put back whichever it found.
    before = signal.getsignal(signal.SIGINT)
    assert run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs) == 130
    captured = capsys.readouterr()
    assert "state at step 3/8 saved" in captured.out and "run the same command again to resume" in captured.err
    assert not list((tmp_path / "out" / "loras").glob("*.safetensors"))  # no partial LoRA passed off as done
    assert signal.getsignal(signal.SIGINT) is before  # handler restored

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


def _disk_fills_after(real_save_file, good_saves: int):
    """save_file that writes ``good_saves`` files, then fails as safetensors does on a full disk: some bytes
    written, then its own exception type around the OS error."""
    from safetensors import SafetensorError

    calls = []

    def save_file(tensors, path, *a, **k):
        calls.append(path)
        if len(calls) <= good_saves:
            return real_save_file(tensors, path, *a, **k)
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    return save_file


def _no_temp_files(root):
    return not [p for p in root.rglob(".*") if ".tmp-" in p.name]


def test_full_disk_during_a_periodic_save_warns_and_training_goes_on(model, tiny_cache, tmp_path, monkeypatch):
    from lowvram_lora.engine.train import resume

    monkeypatch.setattr(resume, "save_file", _disk_fills_after(resume.save_file, good_saves=1))  # step 4 saves
    kept = []

    class Watch(Log):
        def on_step(self, info):
            super().on_step(info)
            if info.step == 9:  # step 8's save failed: step 4's state is still there, nothing half-written
                kept.extend(sorted(p.name for p in (tmp_path / "resume").rglob("*") if p.is_file()))

    cb = Watch()
    result = _run(model, tiny_cache, tmp_path, cb)  # step 8's periodic save fails
    assert result.steps == 10 and not result.interrupted
    warned = [m for m in cb.lines if "periodic training state was not saved" in m]
    assert len(warned) == 1 and "training goes on" in warned[0] and "SafetensorError" not in warned[0]
    assert "disk is full" in warned[0] and "state-0000008.safetensors" in warned[0]
    assert re.search(r"it needs [\d.]+ MB and [\d.]+ [MG]B are free in '.*resume", warned[0])
    assert "the state of step 4 saved before is kept" in warned[0]
    assert kept == ["state-0000004.json", "state-0000004.safetensors"]
    assert _no_temp_files(tmp_path)


def test_full_disk_on_a_stop_names_the_folder_and_keeps_the_last_good_state(model, tiny_cache, uninterrupted,
                                                                           tmp_path, monkeypatch):
    from lowvram_lora.engine.errors import StorageError
    from lowvram_lora.engine.train import resume

    real = resume.save_file
    monkeypatch.setattr(resume, "save_file", _disk_fills_after(real, good_saves=1))
    with pytest.raises(StorageError) as failed:  # Ctrl-C / Cancel at step 6: its save fails
        _run(model, tiny_cache, tmp_path, Log(stop_after=6, raise_exc=KeyboardInterrupt()))
    message = str(failed.value)
    folder = next((tmp_path / "resume").iterdir())
    assert "SafetensorError" not in message and "disk is full" in message and str(folder) in message
    assert re.search(r"it needs [\d.]+ MB and [\d.]+ [MG]B are free", message)
    assert "the state of step 4 saved before is kept" in message
    assert _no_temp_files(tmp_path) and not (folder / "state-0000006.safetensors").exists()
    monkeypatch.setattr(resume, "save_file", real)
    again = Log()
    resumed = _run(model, tiny_cache, tmp_path, again)
    assert any("resuming from step 4/10" in line for line in again.lines)
    assert all(torch.equal(resumed.state_dict[k], v) for k, v in uninterrupted.state_dict.items())


def test_full_disk_while_caching_names_the_folder(tiny_pipeline, tiny_dataset, tmp_path, monkeypatch):
    from lowvram_lora.engine.caching import build_dataset_cache, entries
    from lowvram_lora.engine.config import DataConfig
    from lowvram_lora.engine.errors import StorageError

    monkeypatch.setattr(entries, "save_file", _disk_fills_after(entries.save_file, good_saves=0))
    with pytest.raises(StorageError) as failed:
        build_dataset_cache(ModelConfig(transformer_path=str(tiny_pipeline)),
                            DataConfig(path=str(tiny_dataset), resolution=64), tmp_path / "cache")
    message = str(failed.value)
    assert "SafetensorError" not in message and "disk is full" in message and "dataset-cache entry" in message
    assert re.search(r"more than the [\d.]+ [MG]B free in '" + re.escape(str(tmp_path / "cache")), message)
    assert _no_temp_files(tmp_path)


# -- a damaged state: set aside, never trained from ----------------------------------------------------------------

def _stopped_at_6(model, cache, tmp_path):
    with pytest.raises(ComfyInterrupt):
        _run(model, cache, tmp_path, Log(stop_after=6, raise_exc=ComfyInterrupt()))
    return next((tmp_path / "resume").iterdir())


@pytest.mark.parametrize("damage", ["tensor_bytes", "json_number"])
def test_a_damaged_state_is_set_aside_and_training_starts_fresh(model, tiny_cache, uninterrupted, tmp_path, damage):
    folder = _stopped_at_6(model, tiny_cache, tmp_path)
    if damage == "tensor_bytes":  # 4 KiB of its tensor data overwritten, the size unchanged
        path = folder / "state-0000006.safetensors"
        data = bytearray(path.read_bytes())
        header = 8 + int.from_bytes(data[:8], "little")
        data[header:header + 4096] = b"\xff" * min(4096, len(data) - header)
        path.write_bytes(bytes(data))
    else:  # one digit of a recorded loss changed, the JSON still valid
        path = folder / "state-0000006.json"
        text = path.read_text()
        i = text.index('"loss_history": [') + len('"loss_history": [') + 2
        while not text[i].isdigit():
            i += 1
        path.write_text(text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1:])
    cb = Log()
    result = _run(model, tiny_cache, tmp_path, cb)
    text = "\n".join(cb.lines)
    assert "failed its check" in text and "set aside" in text and "training starts fresh" in text
    assert "resuming" not in text
    assert result.steps == 10 and result.loss_history == uninterrupted.loss_history
    assert all(torch.equal(result.state_dict[k], v) for k, v in uninterrupted.state_dict.items())
    assert sorted(p.name for p in folder.iterdir()) == ["damaged-state-0000006.json",
                                                        "damaged-state-0000006.safetensors"]


def test_a_damaged_state_falls_back_to_an_older_good_one(model, tiny_cache, uninterrupted, tmp_path):
    folder = _stopped_at_6(model, tiny_cache, tmp_path)
    good = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(ComfyInterrupt):  # resumes at 6, stops at 8: step 6's state is replaced by 8's
        _run(model, tiny_cache, tmp_path, Log(stop_after=8, raise_exc=ComfyInterrupt()))
    for name, data in good.items():  # as if step 6's removal had not happened
        (folder / name).write_bytes(data)
    (folder / "state-0000008.safetensors").write_bytes(b"\0" * (folder / "state-0000008.safetensors").stat().st_size)
    cb = Log()
    result = _run(model, tiny_cache, tmp_path, cb)
    text = "\n".join(cb.lines)
    assert "state of step 8" in text and "Trying the state of step 6" in text and "resuming from step 6/10" in text
    assert all(torch.equal(result.state_dict[k], v) for k, v in uninterrupted.state_dict.items())


# -- one run per resume folder ---------------------------------------------------------------------------------

def test_a_second_run_of_the_same_key_is_refused_while_one_runs(model, tiny_cache, tmp_path):
    from lowvram_lora.engine.errors import ConfigError
    from lowvram_lora.engine.fileio import FileLock

    lora, train = LoraSettings(rank=2, alpha=2), TrainConfig(steps=3, seed=3)
    key = training_key(model_key(model), tiny_cache.dataset_hash, lora, train)
    other = FileLock(tmp_path / "locks" / f"training-{key}.lock")  # what the first run holds while it trains
    assert other.acquire()
    try:
        with pytest.raises(ConfigError, match=r"same model, dataset and settings is running now \(process \d+"):
            train_or_reuse(model, tiny_cache, lora, train, tmp_path, Log())
    finally:
        other.release()
    result = train_or_reuse(model, tiny_cache, lora, train, tmp_path, Log())  # free again: it trains
    assert result.steps == 3
    assert other.acquire()  # and lets go when done
    other.release()


# -- 8-bit AdamW state -------------------------------------------------------------------------------------------

def test_adamw8bit_state_is_stored_as_plain_tensors_and_comes_back(tmp_path):
    pytest.importorskip("torchao")
    from safetensors import safe_open

    from lowvram_lora.engine.train.optimizers import flat_adamw8bit
    from lowvram_lora.engine.train.resume import ResumeStore, RngSnapshot

    def make():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(32))]
        opt = flat_adamw8bit(params, lr=1e-3, weight_decay=0.01)
        return params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    params, opt, sched = make()
    (flat,) = opt.param_groups[0]["params"]
    g = torch.Generator().manual_seed(1)
    state = opt.state[flat]  # what a step leaves: the moments as torchao's 8-bit tensors
    state["step"] = torch.tensor(3.0)
    for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        m = opt._new_buffer(flat, signed)
        m.codes.copy_(torch.randint(0, 255, m.codes.shape, generator=g, dtype=torch.uint8))
        m.scale.copy_(torch.rand(m.scale.shape, generator=g))
        state[name] = m
    assert type(state["exp_avg"]).__name__ == "OptimState8bit"
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    store = ResumeStore(tmp_path, "k", {}, save_every=1)
    path = store.save(named, opt, sched, RngSnapshot.take(3, 3), [1.0, 0.9, 0.8], [1e-3] * 3)
    with safe_open(str(path.with_suffix(".safetensors")), framework="pt") as f:
        assert {"optim/0/exp_avg.codes", "optim/0/exp_avg.scale", "optim/0/exp_avg_sq.qmap"} <= set(f.keys())

    params2, opt2, sched2 = make()
    loaded = ResumeStore(tmp_path, "k", {}, save_every=1).load_latest()
    loaded.apply([(f"p{i}", p) for i, p in enumerate(params2)], opt2, sched2)
    (flat2,) = opt2.param_groups[0]["params"]
    for name in ("exp_avg", "exp_avg_sq"):
        a, b = opt2.state[flat2][name], state[name]
        assert type(a) is type(b) and a.signed == b.signed
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale) and torch.equal(a.qmap, b.qmap)
    assert torch.equal(opt2.state[flat2]["step"], torch.tensor(3.0))
    assert isinstance(opt2.param_groups[0]["lr"], torch.Tensor)  # torchao steps only with a tensor lr
    assert all(torch.equal(p, q) for p, q in zip(params, params2))


def test_adamw8bit_runs_save_resumable_states(model, tiny_cache, tmp_path, monkeypatch):
    """The store is on for adamw8bit (it was off: 'states are not saved with adamw8bit')."""
    from lowvram_lora.engine.runs import result_reuse

    seen = {}

    def fake_train(model_cfg, dataset, lora, train, callback, resume=None, **kw):
        seen["enabled"] = resume.enabled
        raise KeyboardInterrupt

    monkeypatch.setattr("lowvram_lora.engine.train.loop.train_lora", fake_train)
    cb = Log()
    with pytest.raises(KeyboardInterrupt):
        _run(model, tiny_cache, tmp_path, cb, optimizer="adamw8bit")
    assert seen["enabled"] and not any("not saved" in m for m in cb.lines)
