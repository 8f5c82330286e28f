"""The modulation window (engine/train/step_window.py): per-step constants computed once for K steps drawn ahead.

With the window on, a run gives today's run bit for bit on the CPU: the same losses, gradients and LoRA weights (each
module runs on the rows the forward would give it), over several windows, with
gradient accumulation and micro-batches, for every family of the registry on its tiny model; a run stopped in the
middle of a window and resumed equals the uninterrupted one; a LoRA on a modulation Linear leaves that Linear out of
the window (it is trained, not constant) and still gives today's run.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch

from lowvram_lora.engine.callbacks import TrainingCallback
from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.families import families, get_family
from lowvram_lora.engine.offload import OffloadConfig
from lowvram_lora.engine.train.loop import train_lora

@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one thread is fastest, and on a loaded machine two threads spin against each other (a layer norm
    of 8 x 32 took 22 ms instead of 3 us)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


FAMILIES = sorted(f for f in families() if get_family(f).memory.step_constants is not None)


@dataclass(frozen=True)
class _Item:
    index: int
    bucket: tuple  # (width, height) in pixels
    frames: tuple = (0,)  # one frame: an image
    control_sizes: tuple = ()

    def batch_key(self):
        return self.bucket


class _Dataset:
    """An in-memory stand-in for the dataset cache: ``count`` random latents and caption embeddings (one length),
    the members train_lora reads."""

    def __init__(self, model, family, count=6, size=32):
        from helpers import family_inputs

        self.items, self.flip, self.dataset_hash = [], True, "window-test"
        # the variant the cache was built for (the planner reads it: image-to-video is the cache's choice)
        self.variant = family.tiny_variant
        # Dataset Options' members, off: no held-out split, regularization images, caption variants or masks
        self.validation_items, self.reg_items, self.captions_vary = [], [], False
        self._data = []
        for i in range(count):
            torch.manual_seed(100 + i)
            latents, embeds, _ = family_inputs(model, family, size, size)
            g = torch.Generator().manual_seed(200 + i)
            self._data.append((torch.randn(latents.shape[1:], generator=g),
                               {k: (torch.randn(v.shape[1:], generator=g) if v.is_floating_point() else v[0])
                                for k, v in embeds.items()}))
            self.items.append(_Item(i, (size, size)))

    def training_items(self):
        return list(self.items)

    def load_item(self, item, flipped=False, text_key=None):
        latents, embeds = self._data[item.index]
        return (latents.flip(-1) if flipped else latents), dict(embeds)

    def load_mask(self, item, flipped=False):
        return None

    def collate_text(self, rows):
        return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}

    def check_fits(self, family, config):
        pass


class _Record(TrainingCallback):
    def __init__(self, stop_after=None):
        self.lines, self.grad_norms, self.grads, self.stop_after, self.step = [], [], [], stop_after, 0

    def log(self, message):
        self.lines.append(message)

    def on_step(self, info):
        self.step = info.step
        self.grad_norms.append(info.grad_norm)

    def should_stop(self):
        return self.stop_after is not None and self.step >= self.stop_after


def _model(family):
    from lowvram_lora.engine.families.tiny import randomize_zero_inits

    torch.manual_seed(0)
    model = family.transformer_class().from_config(family.load_config(family.tiny_variant))
    randomize_zero_inits(model, 0)  # zero-initialised modulation would make the test blind to it
    return model.requires_grad_(False)


def _train(model, family, dataset, window, cb=None, lora=None, resume=None, offload=None, **train):
    """``cb.grads``: the LoRA gradients (fp32 copies, in the optimizer's order) each step stepped on."""
    settings = dict(steps=5, batch_size=2, gradient_accumulation=2, learning_rate=1e-3, seed=5, guidance=3.5,
                    max_grad_norm=0.0)
    settings.update(train)
    cb = cb if cb is not None else _Record()

    def record(optimizer, args, kwargs):
        cb.grads.append([p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"]])

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(record)
    try:
        return _train_lora_call(model, family, dataset, window, cb, lora, resume, settings,
                                offload or OffloadConfig(mode="resident", micro_batch_size=1))
    finally:
        handle.remove()


def _train_lora_call(model, family, dataset, window, cb, lora, resume, settings, offload):
    return train_lora(ModelConfig(transformer_path=f"{family.id}-tiny", dtype="fp32"), dataset, lora or LoraSettings(rank=2, alpha=2), TrainConfig(**settings), cb,
                      preloaded=(model, family, family.tiny_variant), step_window=window, resume=resume,
                      offload=offload)


def _assert_same(got, want, got_cb, want_cb, exact=True):
    """The same losses, gradient norms, every step's LoRA gradients and the final LoRA weights: bit for bit (the window
    runs each module on the rows the forward would, with the same ops), or within rtol 1e-5 where compiled graphs
    differ (``exact=False``: AdamW's normalised step turns a last-bit gradient difference of a near-zero gradient into
    ~1e-7 of weight, hence atol 2e-6 on the weights, which move ~5e-3 in these runs)."""
    assert got.steps == want.steps
    assert len(got_cb.grads) == len(want_cb.grads) == got.steps
    assert got.state_dict.keys() == want.state_dict.keys()
    if exact:
        assert got.loss_history == want.loss_history and got_cb.grad_norms == want_cb.grad_norms
        for step, (gs, ws) in enumerate(zip(got_cb.grads, want_cb.grads), 1):
            assert all(torch.equal(g, w) for g, w in zip(gs, ws)), f"step {step}"
        assert all(torch.equal(got.state_dict[k], v) for k, v in want.state_dict.items())
        return
    assert got.loss_history == pytest.approx(want.loss_history, rel=1e-5)
    assert got_cb.grad_norms == pytest.approx(want_cb.grad_norms, rel=1e-5)
    for step, (gs, ws) in enumerate(zip(got_cb.grads, want_cb.grads), 1):
        for i, (g, w) in enumerate(zip(gs, ws)):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-8, msg=f"step {step}, LoRA tensor {i}")
    for k, v in want.state_dict.items():
        torch.testing.assert_close(got.state_dict[k], v, rtol=1e-5, atol=2e-6, msg=k)


@pytest.mark.parametrize("family_id", FAMILIES)
def test_window_and_a_resume_inside_it_give_todays_run(family_id, tmp_path, monkeypatch):
    """5 steps of 2 micro-batches of 2 samples, each run 1 sample at a time (20 calls of the model), in windows of 3
    steps: the run stops after step 2, inside its first window, and a second run resumes it from its saved state (a
    fresh window at step 3). Against today's uninterrupted run: the same losses, every step's LoRA gradients and the
    final LoRA weights; the declared modules never ran during training (their outputs came from the window), the
    time embedding ran once per call, in the window's pass."""
    from lowvram_lora.engine.train import step_window
    from lowvram_lora.engine.train.resume import ResumeStore

    family = get_family(family_id)
    model = _model(family)
    dataset = _Dataset(model, family)
    want_cb = _Record()
    want = _train(copy.deepcopy(model), family, dataset, 0, want_cb)
    assert not any("modulation window" in line for line in want_cb.lines)

    ran = []
    real = step_window._run_module
    monkeypatch.setattr(step_window, "_run_module", lambda m, a, k: ran.append(m) or real(m, a, k))
    first_cb, second_cb = _Record(stop_after=2), _Record()
    first = _train(model, family, dataset, 3, first_cb, resume=ResumeStore(tmp_path, "k", {}, save_every=0))
    assert first.steps == 2 and first.interrupted
    assert any("modulation window" in line and "per 3 steps" in line for line in first_cb.lines), first_cb.lines
    got = _train(model, family, dataset, 3, second_cb, resume=ResumeStore(tmp_path, "k", {}, save_every=0))
    assert any("resuming from step 2" in line for line in second_cb.lines), second_cb.lines

    source = dict(model.named_modules())[family.memory.step_constants.source]
    # Window 1 drew steps 1-3 (12 calls), the resume's window steps 3-5 (12 calls): one probe of the source each.
    assert [m for m in ran if m is not source] == [] and len(ran) == 24
    second_cb.grad_norms[:0] = first_cb.grad_norms
    second_cb.grads[:0] = first_cb.grads
    _assert_same(got, want, second_cb, want_cb)


def test_a_lora_on_a_modulation_linear_keeps_it_out_of_the_window():
    """A LoRA on the double blocks' image modulation makes it trained, not constant: it stays in its block and runs
    every step (logged), the rest of the window still serves, and the run is today's."""
    family = get_family("flux1")
    model = _model(family)
    dataset = _Dataset(model, family, count=4)
    lora = LoraSettings(rank=2, alpha=2, target_modules=["attn.to_q", "norm1.linear"])
    want_cb, got_cb = _Record(), _Record()
    want = _train(copy.deepcopy(model), family, dataset, 0, want_cb, lora=lora, steps=3)
    got = _train(model, family, dataset, 2, got_cb, lora=lora, steps=3)
    assert any("carry a LoRA (e.g. transformer_blocks.0.norm1.linear)" in line for line in got_cb.lines), got_cb.lines
    assert any(".norm1.linear.lora_A" in k for k in got.state_dict)
    _assert_same(got, want, got_cb, want_cb)


@pytest.mark.parametrize("family_id", FAMILIES)
def test_blocks_and_the_footprint_leave_the_windows_weights_out(family_id):
    """Flagged modules' weights are not a block's (its pinned host copy, its GPU slot) nor in the planner's block bytes:
    each block's bytes drop by exactly the flagged weights inside it, and the bytes outside the blocks (the plan's
    resident weights) by those outside them (Flux.2's global modulation: the window holds it on the host); unflagged,
    they are as before."""
    from lowvram_lora.engine.offload.footprint import measure_footprint, named_blocks
    from lowvram_lora.engine.offload.host import frozen_bytes
    from lowvram_lora.engine.train.step_window import mark

    family = get_family(family_id)
    model = _model(family)
    whole = measure_footprint(model, family)
    before = whole.block_bytes
    chosen = mark(model, family, ["to_q"], lambda line: None)
    try:
        marked = measure_footprint(model, family)
        after = marked.block_bytes
        flagged = {id(m) for _, m in chosen.all()}
        inside = [sum(frozen_bytes(m) for m in block.modules() if id(m) in flagged) for _, block in named_blocks(model, family)]
        outside = sum(t.numel() * t.element_size() for _, m in chosen.all() if id(m) in flagged
                      for t in m.parameters()) - sum(
            t.numel() * t.element_size() for _, block in named_blocks(model, family)
            for m in block.modules() if id(m) in flagged for t in m.parameters())
    finally:
        chosen.unmark()
    assert [b - a for b, a in zip(before, after)] == inside
    assert whole.other_bytes - marked.other_bytes == outside
    assert sum(inside) > 0 or family_id in ("flux2", "wan")  # Flux.2's and Wan's modulation is outside the blocks
    assert measure_footprint(model, family).block_bytes == before


def test_compiled_blocks_read_the_window_without_recompiling(monkeypatch):
    """Compiled blocks (aot_eager: torch.compile's graph capture and autograd split) trace the window's stored output
    as a graph input: the window run compiles exactly the graphs of the run without it (no graph per window, block or
    call), and gives its losses and gradients."""
    from lowvram_lora.engine.train import compile as compile_mod

    monkeypatch.setattr(compile_mod, "DEFAULT_BACKEND", "aot_eager")
    torch._dynamo.reset()
    family = get_family("flux1")
    model = _model(family)
    dataset = _Dataset(model, family, count=4)
    compiled = OffloadConfig(mode="resident", compile="blocks")
    want_cb, got_cb = _Record(), _Record()
    want = _train(copy.deepcopy(model), family, dataset, 0, want_cb, offload=compiled, steps=4)
    torch._dynamo.reset()
    got = _train(model, family, dataset, 2, got_cb, offload=compiled, steps=4)
    assert want.settings["compile"]["graphs"] > 0
    assert got.settings["compile"]["graphs"] == want.settings["compile"]["graphs"]
    _assert_same(got, want, got_cb, want_cb, exact=False)
