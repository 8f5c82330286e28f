"""The modulation window on a real GPU, streamed: every family's tiny model with every block streamed and activation
offload (blocks in parts where the family has them; Flux.1 also whole blocks without it), the window on against off.
Checked: the same losses and LoRA weights (fp32 on the GPU: rtol 1e-4 on the losses; AdamW's normalised step gives
~1e-7 of weight for a last-bit gradient difference), the window held its weights in pinned host memory, and the
streamer copied fewer bytes: the flagged weights inside the streamed blocks, once or twice per micro-step (forward,
and the recompute when the block left its slot). On the GPU machine::

    source bench/gpu_env.sh && python3 -m pytest -m gpu -s tests/test_step_window_gpu.py
"""
from __future__ import annotations

import copy

import pytest
import torch

from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.families import families, get_family
from lowvram_lora.engine.offload import OffloadConfig
from lowvram_lora.engine.train import train_lora

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FAMILIES = sorted(f for f in families() if get_family(f).memory.step_constants is not None)


# Every family with activation offload (its blocks in parts where it has them); Flux.1 also with whole blocks.
@pytest.mark.parametrize("family_id, act", [(f, True) for f in FAMILIES] + [("flux1", False)])
def test_streamed_window_equals_streamed_without(family_id, act):
    from test_step_window import _Dataset, _model

    from lowvram_lora.engine.offload.footprint import named_blocks
    from lowvram_lora.engine.offload.host import frozen_bytes
    from lowvram_lora.engine.train.step_window import mark

    family = get_family(family_id)
    model = _model(family)
    dataset = _Dataset(model, family)
    steps, accumulation = 5, 2
    offload = OffloadConfig(mode="stream", prefetch_depth=1, activation_offload=act, compile="off")

    def run(window, m):
        return train_lora(ModelConfig(transformer_path="tiny", dtype="fp32"), dataset, LoraSettings(rank=2, alpha=2),
                          TrainConfig(steps=steps, batch_size=2, gradient_accumulation=accumulation, learning_rate=1e-3,
                                      seed=5, guidance=3.5, device="cuda"),
                          preloaded=(m, family, family.tiny_variant), offload=copy.deepcopy(offload),
                          step_window=window)

    want = run(0, copy.deepcopy(model))
    got = run(2, model)
    assert got.settings["step_window"]["steps"] == 2 and got.settings["step_window"]["held_bytes"] > 0
    assert got.loss_history == pytest.approx(want.loss_history, rel=1e-4)
    for k, v in want.state_dict.items():
        torch.testing.assert_close(got.state_dict[k], v, rtol=1e-4, atol=2e-6, msg=k)

    # What the streamer no longer copies: the flagged weights inside the streamed blocks, in the forward and the
    # recompute of each of the 5 x 2 micro-steps.
    chosen = mark(model, family, ["to_q"], lambda line: None)
    flagged = {id(m) for _, m in chosen.all()}
    inside = sum(frozen_bytes(m) for _, block in named_blocks(model, family) for m in block.modules()
                 if id(m) in flagged)
    chosen.unmark()
    saved = want.settings["offload_stats"]["bytes_copied"] - got.settings["offload_stats"]["bytes_copied"]
    # Each micro-step loads a streamed block at most twice (forward, recompute), the same blocks with the window as
    # without; a block still in its slot is not loaded again (Qwen-Image's tiny model: its 2 blocks fit the 2 slots, so
    # each is loaded once in the whole run: saved == inside, measured on the H200).
    assert inside > 0 or family_id in ("flux2", "wan")  # their modulation is outside the blocks
    assert inside <= saved <= 2 * steps * accumulation * inside, (saved, inside)


def test_window_weights_read_from_the_slab_map_train_like_held_ones(tmp_path, monkeypatch):
    """Host RAM short (offload/window.py place_window_weights chooses it): the window's weights that are still in the
    slab file's map stay there and are copied to the GPU from it once per window (offload/host.py MappedBlock),
    giving the map's pages back after each copy. The same losses and LoRA as holding them in pinned memory."""
    from test_step_window import _Dataset

    from lowvram_lora.engine.offload import window as window_mod
    from lowvram_lora.engine.slab import build_slab, load_slab_transformer
    from lowvram_lora.engine.slab.testing import write_random_checkpoint

    family = get_family("flux1")
    cfg = dict(family.load_config("flux1-tiny"), num_layers=2, num_single_layers=3)
    ckpt = write_random_checkpoint(tmp_path / "ckpt", "flux1", config=cfg, layout="diffusers")
    slab = build_slab(ckpt, tmp_path / "tiny.slab.safetensors", progress=False)
    offload = OffloadConfig(mode="stream", prefetch_depth=1, activation_offload=True, compile="off")

    def run(mapped: bool):
        model = load_slab_transformer(slab, torch.float32)[0]
        if mapped:
            real = window_mod.place_window_weights
            monkeypatch.setattr(window_mod, "place_window_weights",
                                lambda planned, extra, may_map: (real(planned, {}, False)[0], True))
        try:
            return train_lora(ModelConfig(transformer_path="tiny", dtype="fp32"), _Dataset(model, family),
                              LoraSettings(rank=2, alpha=2),
                              TrainConfig(steps=4, batch_size=1, learning_rate=1e-3, seed=5, guidance=3.5,
                                          device="cuda"),
                              preloaded=(model, family, family.tiny_variant), offload=copy.deepcopy(offload),
                              step_window=2)
        finally:
            monkeypatch.undo()

    held, mapped = run(False), run(True)
    assert held.settings["step_window"]["mapped_bytes"] == 0
    assert mapped.settings["step_window"]["mapped_bytes"] > 0  # the blocks' modulation, left in the map
    assert mapped.loss_history == pytest.approx(held.loss_history, rel=1e-5)
    for k, v in held.state_dict.items():
        torch.testing.assert_close(mapped.state_dict[k], v, rtol=1e-5, atol=1e-7, msg=k)
