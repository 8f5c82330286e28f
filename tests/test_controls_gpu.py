"""Masked loss and validation on a real GPU, with blocks streamed: the validation's no-grad forwards between
training steps give the resident run's validation loss, and the masked loss trains. On the GPU machine::

    source bench/gpu_env.sh && python3 -m pytest -m gpu -s tests/test_controls_gpu.py
"""
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.families import get_family
from lowvram_lora.engine.offload import OffloadConfig
from lowvram_lora.engine.train import train_lora
from lowvram_lora.engine.train.loss_options import LossOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FAMILY = get_family("flux1")


def test_streamed_validation_and_masks_match_resident(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from test_offload_gpu import build
    from train_bench import mode_resident_masked, write_synthetic_cache

    model, cfg = build("mid")
    dataset = write_synthetic_cache(tmp_path, FAMILY, "flux1-dev", cfg, 512, 3, 0)
    dataset = replace(dataset, validation_items=dataset.items[:1], items=dataset.items[1:])
    loss = LossOptions(validation_every=2, validation_timesteps=3)

    def run(offload, data=dataset):
        torch.cuda.empty_cache()
        return train_lora(ModelConfig(dtype="bf16", family="flux1"), data, LoraSettings(rank=16, alpha=16),
                          TrainConfig(steps=4, learning_rate=1e-3, device="cuda"), None,
                          preloaded=(model, FAMILY, "flux1-dev"), offload=offload, loss=loss)

    ref = run(None)
    streamed = run(OffloadConfig(mode="stream", prefetch_depth=2))
    print(f"\nvalidation resident {ref.settings['validation']['loss']}, streamed "
          f"{streamed.settings['validation']['loss']}")
    assert ref.settings["validation"]["steps"] == [2, 4]
    assert streamed.settings["validation"]["loss"] == pytest.approx(ref.settings["validation"]["loss"], rel=2e-2)
    assert streamed.loss_history == pytest.approx(ref.loss_history, rel=2e-2)
    ctx = {"args": type("A", (), {"dtype": "bf16", "rank": 16, "device": "cuda", "batch": 1,
                                  "lora_targets": "default", "variant": "flux1-dev"})(),
           "model": model, "family": FAMILY}
    masked = mode_resident_masked(ctx, dataset, 4, None)
    assert all(0 < m < r for m, r in zip(masked.loss_history, ref.loss_history))  # half the latent counts
