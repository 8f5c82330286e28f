"""Periodic resume saves off the training thread (engine/train/state_writer.py): the loop goes on while a state
is written, the state is the one of its step, a writer's error surfaces, a kill mid-write keeps the previous
state, and a stop or the end of the run waits for the write in flight."""
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from lowvram_lora.engine.callbacks import TrainingCallback
from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.models.inspect import inspect_transformer
from lowvram_lora.engine.runs.result_reuse import train_or_reuse
from lowvram_lora.engine.train import resume
from lowvram_lora.engine.train.resume import ResumeStore, RngSnapshot

GATE_TIMEOUT = 30  # seconds a gated write waits for its release before writing anyway (a test then fails)


class Log(TrainingCallback):
    """Records log lines and steps; calls ``at[step]()`` in on_step; raises ``raise_exc`` from should_stop once
    ``stop_after`` steps are done."""

    def __init__(self, at=None, stop_after=None, raise_exc=None):
        self.lines, self.steps, self.at = [], 0, at or {}
        self.stop_after, self.raise_exc = stop_after, raise_exc

    def log(self, message):
        self.lines.append(message)

    def on_step(self, info):
        self.steps = info.step
        if info.step in self.at:
            self.at[info.step]()

    def should_stop(self):
        if self.stop_after is not None and self.steps >= self.stop_after:
            raise self.raise_exc
        return False


class ComfyInterrupt(Exception):
    """Stands in for ComfyUI's InterruptProcessingException."""


def _run(model, cache, tmp, cb, **train):
    settings = dict(steps=10, learning_rate=5e-3, seed=3, gradient_accumulation=2, lr_scheduler="cosine",
                    warmup_steps=2, save_every=4)
    settings.update(train)
    return train_or_reuse(model, cache, LoraSettings(rank=2, alpha=2), TrainConfig(**settings), tmp, cb)


def _step_of(path) -> int | None:
    m = re.search(r"state-(\d{7})\.safetensors", str(path))
    return int(m[1]) if m else None


class GatedSaveFile:
    """resume.save_file that records when each state's write begins and ends; the write of ``gated`` waits for
    ``release`` first (then ``delay`` more seconds); ``aside``: each written file is also copied there."""

    def __init__(self, gated=None, delay=0.0, aside=None, fail=None):
        self.real, self.gated, self.delay, self.aside, self.fail = resume.save_file, gated, delay, aside, fail
        self.release, self.ended, self.events = threading.Event(), threading.Event(), []

    def __call__(self, tensors, path, *args, **kwargs):
        step = _step_of(path)
        self.events.append(("begin", step))
        try:
            if step == self.gated:
                assert self.release.wait(GATE_TIMEOUT), "the gated write was never released"
                time.sleep(self.delay)
            if step == self.fail:
                raise RuntimeError("the writer broke")
            self.real(tensors, path, *args, **kwargs)
            if self.aside is not None:
                self.aside.mkdir(exist_ok=True)
                shutil.copy(path, self.aside / f"{step}.safetensors")
        finally:
            self.events.append(("end", step))
            if step == self.gated or step == self.fail:
                self.ended.set()


@pytest.fixture(scope="module")
def model(tiny_pipeline):
    return inspect_transformer(ModelConfig(transformer_path=str(tiny_pipeline)))


@pytest.fixture(scope="module")
def plain(model, tiny_cache, tmp_path_factory):
    """A run whose saves are not held up, each state file copied aside: the reference."""
    with pytest.MonkeyPatch.context() as mp:
        save = GatedSaveFile(aside=tmp_path_factory.mktemp("plain_states"))
        mp.setattr(resume, "save_file", save)
        result = _run(model, tiny_cache, tmp_path_factory.mktemp("plain"), Log())
    return result, save.aside


@pytest.fixture(scope="module")
def held(model, tiny_cache, tmp_path_factory):
    """A run whose step-4 save is held until step 7 ends: (result, log, steps seen while it was held, files)."""
    with pytest.MonkeyPatch.context() as mp:
        save = GatedSaveFile(gated=4, aside=tmp_path_factory.mktemp("held_states"))
        mp.setattr(resume, "save_file", save)
        seen = []

        def note(step):
            return lambda: seen.append((step, save.ended.is_set()))

        at = {s: note(s) for s in (4, 5, 6)}
        at[7] = lambda: (seen.append((7, save.ended.is_set())), save.release.set())
        cb = Log(at=at)
        result = _run(model, tiny_cache, tmp_path_factory.mktemp("held"), cb)
    return result, cb, seen, save


def test_a_periodic_save_returns_before_its_write_ends_and_training_goes_on(held, plain):
    result, cb, seen, save = held
    assert seen == [(4, False), (5, False), (6, False), (7, False)]  # steps 5-7 ran while step 4 was written
    assert ("end", 4) in save.events and result.steps == 10 and not result.interrupted
    saved = [i for i, line in enumerate(cb.lines) if "training state at step 4/10 saved" in line]
    assert len(saved) == 1  # said once, on the training thread, after the write ended
    reference, _ = plain
    assert result.loss_history == reference.loss_history  # the save in flight did not change training
    assert all(torch.equal(result.state_dict[k], v) for k, v in reference.state_dict.items())


def test_the_state_written_is_the_one_of_its_step_though_training_changed_the_weights(held, plain):
    _, _, _, save = held
    _, reference_files = plain
    late, reference = load_file(str(save.aside / "4.safetensors")), load_file(str(reference_files / "4.safetensors"))
    assert sorted(late) == sorted(reference)
    assert all(torch.equal(late[k], reference[k]) for k in reference), [k for k in reference
                                                                       if not torch.equal(late[k], reference[k])]
    after = load_file(str(reference_files / "8.safetensors"))  # the test can fail: the weights did change
    assert any(not torch.equal(after[k], reference[k]) for k in reference if k.startswith("lora/"))
    assert any(not torch.equal(after[k], reference[k]) for k in reference if k.startswith("optim/"))


def test_the_host_copy_is_taken_when_the_save_is_asked_for(tmp_path, monkeypatch):
    """Store level, optimizer moments included: weights and moments changed in place while the write waits."""
    save = GatedSaveFile(gated=3)
    monkeypatch.setattr(resume, "save_file", save)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.AdamW(params, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for _ in range(3):
        sum((p ** 2).sum() for p in params).backward()
        opt.step()
        opt.zero_grad()
    want = {f"lora/p{i}": p.detach().clone() for i, p in enumerate(params)}
    want.update({f"optim/{i}/{m}": opt.state[p][m].clone() for i, p in enumerate(params)
                 for m in ("exp_avg", "exp_avg_sq")})
    store = ResumeStore(tmp_path, "k", {}, save_every=1)
    assert store.save_in_background([(f"p{i}", p) for i, p in enumerate(params)], opt, sched,
                                    RngSnapshot.take(3, 3), [1.0, 0.9, 0.8], [1e-2] * 3)
    assert store.saving and store.finished() == []
    sum((p ** 3).sum() for p in params).backward()  # training goes on: weights and moments change in place
    opt.step()
    assert not torch.equal(params[0].detach(), want["lora/p0"])
    save.release.set()
    (outcome,) = store.finished(wait=True)
    assert outcome.error is None and outcome.step == 3 and outcome.path.name == "state-0000003.json"
    loaded = ResumeStore(tmp_path, "k", {}, save_every=1).load_latest()
    assert loaded.step == 3 and loaded.info["loss_history"] == [1.0, 0.9, 0.8]
    for k, v in want.items():
        assert torch.equal(loaded.tensors[k], v), k
    store.close()


def test_an_error_on_the_writer_surfaces_at_the_next_step_boundary(model, tiny_cache, tmp_path, monkeypatch):
    save = GatedSaveFile(fail=4)
    monkeypatch.setattr(resume, "save_file", save)

    def written():  # step 4's failed write is over before step 5 runs: its error must come out at step 5
        assert save.ended.wait(GATE_TIMEOUT)
        time.sleep(0.3)

    cb = Log(at={4: written})
    with pytest.raises(RuntimeError, match="the writer broke") as raised:
        _run(model, tiny_cache, tmp_path, cb)
    assert cb.steps == 4  # raised at step 5's boundary, before its on_step
    notes = " ".join(getattr(raised.value, "__notes__", []))
    assert "training state of step 4" in notes and "background writer" in notes
    assert not [p for p in (tmp_path / "resume").rglob("*") if p.is_file() and p.name != ".lock"]


def test_an_error_on_the_writer_is_never_lost_at_the_end(tmp_path, monkeypatch):
    monkeypatch.setattr(resume, "save_file", GatedSaveFile(fail=2))
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p])
    store = ResumeStore(tmp_path, "k", {}, save_every=1)
    store.save_in_background([("p", p)], opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                             RngSnapshot.take(2, 2), [1.0, 1.0], [1e-3, 1e-3])
    store.close()  # waits; the outcome is kept
    (outcome,) = store.finished()
    assert isinstance(outcome.error, RuntimeError) and "step 2" in " ".join(outcome.error.__notes__)


def test_a_stop_waits_for_the_write_in_flight(model, tiny_cache, plain, tmp_path, monkeypatch):
    """Step 4's write is released at step 6 and then takes 0.3 s more; Cancel at step 6: its own save begins
    only after step 4's ended, and is the one kept."""
    save = GatedSaveFile(gated=4, delay=0.3)
    monkeypatch.setattr(resume, "save_file", save)
    cb = Log(at={6: save.release.set}, stop_after=6, raise_exc=ComfyInterrupt("cancelled"))
    with pytest.raises(ComfyInterrupt):
        _run(model, tiny_cache, tmp_path, cb)
    assert save.events == [("begin", 4), ("end", 4), ("begin", 6), ("end", 6)]
    said = [line for line in cb.lines if re.search(r"training state at step \d+/10 saved", line)]
    assert [re.search(r"step (\d+)/", line)[1] for line in said] == ["4", "6"]
    folder = next((tmp_path / "resume").iterdir())
    assert sorted(p.name for p in folder.glob("state-*")) == ["state-0000006.json", "state-0000006.safetensors"]
    monkeypatch.setattr(resume, "save_file", save.real)
    again = Log()
    resumed = _run(model, tiny_cache, tmp_path, again)
    assert any("resuming from step 6/10" in line for line in again.lines)
    reference, _ = plain
    assert all(torch.equal(resumed.state_dict[k], v) for k, v in reference.state_dict.items())


def test_the_end_of_the_run_waits_for_the_write_in_flight(model, tiny_cache, tmp_path, monkeypatch):
    save = GatedSaveFile(gated=8)
    monkeypatch.setattr(resume, "save_file", save)
    release = threading.Timer(0.5, save.release.set)  # after the last step, while train_lora is ending
    cb = Log(at={10: release.start})
    result = _run(model, tiny_cache, tmp_path, cb)
    assert result.steps == 10 and save.events[-1] == ("end", 8)  # ended before train_or_reuse returned
    assert any("training state at step 8/10 saved" in line for line in cb.lines)
    assert not [t for t in threading.enumerate() if t.name.startswith("lowvram-lora-resume-writer")]
    assert not list((tmp_path / "resume").rglob("state-*"))  # finished: its states dropped after the write


_KILLED_CHILD = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    from safetensors.torch import save_file
    from lowvram_lora.engine.train import resume
    from lowvram_lora.engine.train.resume import ResumeStore, RngSnapshot

    root = Path(sys.argv[1])
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(256, 64))
    opt = torch.optim.AdamW([p], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    store = ResumeStore(root / "resume", "k", {}, save_every=4)

    def train(steps):
        for _ in range(steps):
            (p ** 2).sum().backward(); opt.step(); opt.zero_grad()

    train(4)
    store.save([("p", p)], opt, sched, RngSnapshot.take(4, 4), [1.0] * 4, [1e-2] * 4)
    save_file({"p": p.detach().clone()}, str(root / "expected.safetensors"))
    train(4)

    def half_then_hang(tensors, path):  # the kill comes in the middle of the tensor file
        with open(path, "wb") as f:
            f.write(b"\\0" * 10000)
            f.flush()
        sys.stdout.write("writing\\n")  # one write: print() writes the text and its newline apart, so the
        sys.stdout.flush()  # training thread's line could land between them ("writingstepping", CI 2026-11-29)
        time.sleep(600)

    resume.save_file = half_then_hang
    store.save_in_background([("p", p)], opt, sched, RngSnapshot.take(8, 8), [1.0] * 8, [1e-2] * 8)
    train(2)  # training goes on while step 8 is written
    sys.stdout.write("stepping\\n")
    sys.stdout.flush()
    time.sleep(600)
""")


def _lines(child, count: int, timeout: float) -> set[str]:
    """The child's next ``count`` output lines, or fewer if it is silent for ``timeout`` seconds. Read from the
    pipe's file descriptor, not through the buffered text stream: two lines arriving together would otherwise
    sit in the stream's buffer while select() waits for more bytes on the pipe."""
    import selectors

    fd = child.stdout.fileno()
    lines, data, sel = set(), b"", selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    while len(lines) < count and sel.select(timeout):
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
        *done, data = data.split(b"\n")
        lines.update(line.decode().strip() for line in done)
    return lines


def test_a_kill_during_a_background_write_leaves_the_previous_state_loadable(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, str(tmp_path)], stdout=subprocess.PIPE,
                             text=True, env=os.environ.copy())
    try:
        lines = _lines(child, 2, timeout=120)
        assert lines == {"writing", "stepping"}, lines  # killed mid-write, while the training thread went on
        folder = tmp_path / "resume" / "k"
        assert [p.name for p in folder.iterdir() if p.name.startswith(".state-0000008.safetensors.tmp-")]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    loaded = ResumeStore(tmp_path / "resume", "k", {}, save_every=4).load_latest()
    assert loaded is not None and loaded.step == 4
    assert torch.equal(loaded.tensors["lora/p"], load_file(str(tmp_path / "expected.safetensors"))["p"])
    assert not (folder / "state-0000008.json").exists()
