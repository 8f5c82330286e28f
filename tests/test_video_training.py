"""Video LoRA training end to end on the tiny Wan model: clips (PyAV-written mp4) -> Cache (windows of 4k+1
frames, umT5 text, the Wan VAE per window) -> train_lora -> a LoRA that lowers the flow-matching loss on the
cached clip latents, checked against the reference model from the pipeline folder. And the A14B experts: a
high-noise expert run draws every training sigma from its own range."""
from __future__ import annotations

import torch
from helpers import eval_flow_loss, merged

from lowvram_lora.engine.caching import build_dataset_cache
from lowvram_lora.engine.config import DataConfig, LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.data.video_config import VideoConfig
from lowvram_lora.engine.families import get_family
from lowvram_lora.engine.testing import make_tiny_video_dataset
from lowvram_lora.engine.train import train_lora


def test_a_wan_video_lora_trains_on_clip_windows(tmp_path):
    family = get_family("wan")
    pipe = family.fixtures().build_tiny_pipeline(tmp_path / "pipe")
    clips = make_tiny_video_dataset(tmp_path / "clips", count=2, frames=9, size=(64, 48))
    cache = build_dataset_cache(ModelConfig(transformer_path=str(pipe)),
                                DataConfig(path=str(clips), resolution=64, bucket_step=16), tmp_path / "cache",
                                video=VideoConfig(frame_counts=(5, 9), fps=0))
    assert len(cache.items) == 2 and all(len(it.frames) == 9 for it in cache.items)
    latent, _ = cache.load_item(cache.items[0])
    assert latent.shape[1] == 3 and latent.dim() == 4  # (C, (9 - 1) // 4 + 1, h, w)
    lora = train_lora(ModelConfig(transformer_path=str(pipe)), cache, LoraSettings(rank=4, alpha=4),
                      TrainConfig(steps=10, learning_rate=1e-2, device="cpu"))
    ref = family.transformer_class().from_pretrained(pipe / "transformer", use_safetensors=True,
                                                     torch_dtype=torch.float32, local_files_only=True)
    before = eval_flow_loss(ref, family, cache)
    after = eval_flow_loss(merged(ref, lora.state_dict, lora.scale), family, cache)
    assert after < before, f"the video LoRA did not lower the loss: {before:.5f} -> {after:.5f}"


def test_a_high_noise_expert_trains_only_above_the_boundary(tmp_path, monkeypatch):
    """A run on the A14B high-noise expert: every sigma _micro_step draws is in [0.875, 1] (the model is given
    1000 sigma), and the log says which range it trains."""
    from lowvram_lora.engine.train import loop
    from lowvram_lora.engine.models import load_transformer

    family = get_family("wan")
    pipe = family.fixtures().build_tiny_pipeline(tmp_path / "pipe")
    clips = make_tiny_video_dataset(tmp_path / "clips", count=1, frames=5, size=(64, 48))
    cache = build_dataset_cache(ModelConfig(transformer_path=str(pipe)),
                                DataConfig(path=str(clips), resolution=64, bucket_step=16), tmp_path / "cache",
                                video=VideoConfig(frame_counts=(5,), fps=0))
    seen = []
    real = family.predict_velocity

    def spy(model, noisy, embeds, sigmas, guidance):
        seen.append(sigmas.detach().clone())
        return real(model, noisy, embeds, sigmas, guidance)

    monkeypatch.setattr(family, "predict_velocity", spy)
    model, fam, _, _ = load_transformer(pipe, dtype=torch.float32)
    logs = []

    from lowvram_lora.engine.callbacks import TrainingCallback

    class Log(TrainingCallback):
        def log(self, message):
            logs.append(message)

    train_lora(ModelConfig(transformer_path=str(pipe)), cache, LoraSettings(rank=2, alpha=2),
               TrainConfig(steps=12, device="cpu"), Log(), preloaded=(model, fam, "wan2.2-t2v-a14b-high-noise"))
    drawn = torch.cat(seen)
    assert len(drawn) == 12 and (drawn >= 0.875).all() and (drawn <= 1.0).all()
    assert any("sigma in [0.875, 1]" in line for line in logs)
    del loop
