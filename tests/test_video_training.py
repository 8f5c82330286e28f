"""Video LoRA training end to end on the tiny Wan model: clips (PyAV-written mp4) -> Cache (windows of 4k+1
frames, umT5 text, the Wan VAE per window) -> train_lora -> a LoRA that lowers the flow-matching loss on the
cached clip latents, checked against the reference model from the pipeline folder. And the A14B experts: a
high-noise expert run draws every training sigma from its own range."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from helpers import eval_flow_loss, merged

from lowvram_lora.engine.caching import build_dataset_cache
from lowvram_lora.engine.config import DataConfig, LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.data.video_config import VideoConfig
from lowvram_lora.engine.families import family_fixtures, get_family
from lowvram_lora.engine.testing import make_tiny_video_dataset
from lowvram_lora.engine.train import train_lora


def test_a_wan_video_lora_trains_on_clip_windows(tmp_path):
    family = get_family("wan")
    pipe = family_fixtures(family).build_tiny_pipeline(tmp_path / "pipe")
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
    pipe = family_fixtures(family).build_tiny_pipeline(tmp_path / "pipe")
    clips = make_tiny_video_dataset(tmp_path / "clips", count=1, frames=5, size=(64, 48))
    cache = build_dataset_cache(ModelConfig(transformer_path=str(pipe)),
                                DataConfig(path=str(clips), resolution=64, bucket_step=16), tmp_path / "cache",
                                video=VideoConfig(frame_counts=(5,), fps=0))
    seen = []
    real = family.model_inputs

    def spy(model, noisy, embeds, sigmas, guidance):
        seen.append(sigmas.detach().clone())
        return real(model, noisy, embeds, sigmas, guidance)

    monkeypatch.setattr(family, "model_inputs", spy)
    model, fam, _, _ = load_transformer(pipe, dtype=torch.float32)
    logs = []

    from lowvram_lora.engine.callbacks import TrainingCallback

    class Log(TrainingCallback):
        def log(self, message):
            logs.append(message)

    train_lora(ModelConfig(transformer_path=str(pipe)), cache, LoraSettings(rank=2, alpha=2),
               TrainConfig(steps=12, device="cpu"), Log(), preloaded=(model, fam, "wan2.2-t2v-a14b-high-noise"))
    drawn = torch.cat(seen)
    # Each step's sigmas twice: the modulation window's pass (engine/train/step_window.py), then the forward.
    assert len(drawn) == 24 and (drawn >= 0.875).all() and (drawn <= 1.0).all()
    assert any("sigma in [0.875, 1]" in line for line in logs)
    del loop


def _expert_pipelines(tmp_path):
    """Two tiny Wan pipelines named as the A14B experts' files are (``wan-tiny-high-noise`` / ``-low-noise``: the
    name tells the role, as ComfyUI's wan2.2_t2v_high_noise_14B / low_noise files), with different weights."""
    family = get_family("wan")
    high = family_fixtures(family).build_tiny_pipeline(tmp_path / "wan_tiny_high_noise", seed=0)
    low = family_fixtures(family).build_tiny_pipeline(tmp_path / "wan_tiny_low_noise", seed=1)
    return high, low


def test_an_expert_with_its_partner_writes_preview_clips_and_without_names_the_input(tmp_path):
    """A run on the tiny high-noise expert with the low-noise one as preview_partner writes a preview clip per
    checkpoint (its first steps by the trained expert, the rest by the partner: the log says so); the same run
    without the partner draws none and its log names the input that fixes it. A partner of the wrong role (the
    expert itself) is refused before any step, naming the file it needs."""
    import pytest

    from lowvram_lora.engine.callbacks import TrainingCallback
    from lowvram_lora.engine.errors import ConfigError
    from lowvram_lora.engine.sampling import SamplingConfig, saved_clips

    high, low = _expert_pipelines(tmp_path)
    clips = make_tiny_video_dataset(tmp_path / "clips", count=1, frames=5, size=(64, 48))
    cache = build_dataset_cache(ModelConfig(transformer_path=str(high)),
                                DataConfig(path=str(clips), resolution=64, bucket_step=16), tmp_path / "cache",
                                sample_prompts=("a red circle",), video=VideoConfig(frame_counts=(5,), fps=0))
    assert cache.variant == "wan-tiny-high-noise"
    sampling = SamplingConfig(every=2, steps=4, resolution=64, frames=5, guidance=4.0)

    class Log(TrainingCallback):
        def __init__(self):
            self.lines = []

        def log(self, message):
            self.lines.append(message)

    def run(partner, out):
        log = Log()
        result = train_lora(ModelConfig(transformer_path=str(high)), cache, LoraSettings(rank=2, alpha=2),
                            TrainConfig(steps=2, device="cpu"), log, sampling=sampling, sample_dir=out,
                            preview_partner=partner)
        return result, log.lines

    result, lines = run(ModelConfig(transformer_path=str(low)), tmp_path / "with")
    assert len(result.sample_grids) == 2  # before the first step and after the last
    clip = saved_clips(result.sample_grids[-1])
    assert len(clip) == 1 and clip[0].is_file()
    from lowvram_lora.engine.sampling import load_clip

    assert len(load_clip(clip[0])) == 5
    assert any("previews switch to wan-tiny-low-noise" in line and "below sigma 0.875" in line and "CFG 3" in line
               for line in lines)
    assert sum("preview partner loaded" in line for line in lines) == 1  # on the CPU it is kept between previews

    result, lines = run(None, tmp_path / "without")
    assert result.sample_grids == [] and not (tmp_path / "without").exists()
    assert any("sampling is off" in line and "preview_partner" in line and "wan-tiny-low-noise" in line
               for line in lines)

    with pytest.raises(ConfigError, match="need wan-tiny-low-noise"):
        run(ModelConfig(transformer_path=str(high)), tmp_path / "wrong")


def test_a_streamed_partner_samples_as_a_resident_one_and_is_released(tmp_path):
    """The partner's streaming path (on CUDA: apply_offload with its forward-only plan; here the same hooks through
    the inline copy engine on the CPU): every block streamed through a ring of 2 slots, the previews' latents equal
    those with the partner resident (1e-6), and after the preview no tensor of it is held (released: the model is
    dropped and the yielded PartnerExpert lets go of it); a kept partner goes back to its host copies."""
    import gc
    import weakref

    from lowvram_lora.engine.callbacks import TrainingCallback
    from lowvram_lora.engine.models import load_transformer
    from lowvram_lora.engine.offload.streamer import InlineCopyEngine
    from lowvram_lora.engine.sampling import sample_latents
    from lowvram_lora.engine.train.preview_partner import PreviewPartner

    family = get_family("wan")
    high, low = _expert_pipelines(tmp_path)
    cpu = torch.device("cpu")
    model, _, _, variant = load_transformer(high, dtype=torch.float32)
    assert variant == "wan-tiny-high-noise"
    emb = {"prompt_embeds": torch.randn(1, 32, model.config.text_dim, generator=torch.Generator().manual_seed(1))}
    neg = {"prompt_embeds": torch.zeros_like(emb["prompt_embeds"])}
    rule = family.guidance(variant)

    def sample(partner):
        return sample_latents(model, family, emb, 64, 32, 4, 3, rule.scale, cpu, torch.float32, rule=rule,
                              negative=neg, frames=5, partner=partner)

    resident = PreviewPartner(ModelConfig(transformer_path=str(low)), family, variant, cpu, torch.float32, None,
                              TrainingCallback())
    with resident.placed() as p:
        want = sample(p)
    streamed = PreviewPartner(ModelConfig(transformer_path=str(low)), family, variant, cpu, torch.float32, None,
                              TrainingCallback())
    streamed.stream, streamed.plan = streamed._plan()
    streamed._engine_factory, streamed.keep = InlineCopyEngine, False
    assert streamed.plan.streamed == [0, 1] and streamed.plan.num_slots == 2 and not streamed.plan.activation_offload
    assert streamed.rows_bytes() == streamed.plan.footprint.other_bytes + streamed.plan.ring_bytes > 0
    with streamed.placed() as p:
        ref = weakref.ref(p.model)
        assert p.high is False and p.guidance == 3.0 and p.boundary == 0.875
        got = sample(p)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    gc.collect()
    assert p.model is None and streamed.model is None and ref() is None  # released
    with resident.placed() as p:  # kept (the CPU keeps it): the same model object at the next preview
        assert p.model is resident.model


@pytest.mark.gpu
def test_a_partner_streamed_on_cuda_samples_as_a_resident_one(tmp_path):
    """The partner's real CUDA path (pinned host copies, the copy stream, its forward-only plan): the previews'
    latents equal those with the partner resident on the GPU (1e-4, fp32), and afterwards no tensor of the released
    partner is on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from lowvram_lora.engine.callbacks import TrainingCallback
    from lowvram_lora.engine.models import load_transformer
    from lowvram_lora.engine.sampling import sample_latents
    from lowvram_lora.engine.train.preview_partner import PreviewPartner

    family = get_family("wan")
    cuda = torch.device("cuda")
    high, low = _expert_pipelines(tmp_path)
    model, _, _, variant = load_transformer(high, dtype=torch.float32)
    model.to(cuda)
    emb = {"prompt_embeds": torch.randn(1, 32, model.config.text_dim, generator=torch.Generator().manual_seed(1))}
    neg = {"prompt_embeds": torch.zeros_like(emb["prompt_embeds"])}
    rule = family.guidance(variant)

    def sample(partner):
        return sample_latents(model, family, emb, 64, 32, 4, 3, rule.scale, cuda, torch.float32, rule=rule,
                              negative=neg, frames=5, partner=partner).cpu()

    resident = PreviewPartner(ModelConfig(transformer_path=str(low)), family, variant, cuda, torch.float32, None,
                              TrainingCallback())
    resident.plan, resident.keep = None, False  # resident on the GPU: no streaming plan
    with resident.placed() as p:
        want = sample(p)
    streamed = PreviewPartner(ModelConfig(transformer_path=str(low)), family, variant, cuda, torch.float32, None,
                              TrainingCallback())
    streamed.keep = False
    assert streamed.plan is not None and streamed.plan.streamed  # on CUDA the partner streams
    before = torch.cuda.memory_allocated(cuda)
    with streamed.placed() as p:
        got = sample(p)
    torch.cuda.synchronize(cuda)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.cuda.memory_allocated(cuda) <= before  # nothing of the released partner stays on the GPU


def test_both_experts_in_one_run_equal_two_one_expert_runs(tmp_path, monkeypatch):
    """Dual-GPU Split mode 'experts' (issue 42; here on cpu,cpu): the high-noise expert (Train LoRA's model) and the
    low-noise one (its preview_partner) train at once in two worker processes, and each LoRA equals the one-expert
    run of the same seed in this process (1e-6: the same computation in another process). The two-expert run stores
    each under the one-expert run's key, so one-expert reruns reuse them; a partner of the wrong role is refused
    before any worker starts."""
    from lowvram_lora.engine.callbacks import TrainingCallback
    from lowvram_lora.engine.errors import ConfigError
    from lowvram_lora.engine.models.inspect import inspect_transformer
    from lowvram_lora.engine.parallel import ParallelConfig
    from lowvram_lora.engine.runs.result_reuse import train_or_reuse

    high, low = _expert_pipelines(tmp_path)
    clips = make_tiny_video_dataset(tmp_path / "clips", count=1, frames=5, size=(64, 48))
    cache = build_dataset_cache(ModelConfig(transformer_path=str(high)),
                                DataConfig(path=str(clips), resolution=64, bucket_step=16), tmp_path / "cache",
                                video=VideoConfig(frame_counts=(5,), fps=0))
    m_high, m_low = (inspect_transformer(ModelConfig(transformer_path=str(p))) for p in (high, low))
    lora, train = LoraSettings(rank=2, alpha=2), TrainConfig(steps=3, learning_rate=1e-2, device="cpu", seed=3)
    experts = ParallelConfig(mode="experts", devices=("cpu", "cpu"))

    class Log(TrainingCallback):
        def __init__(self):
            self.lines, self.steps = [], []

        def log(self, message):
            self.lines.append(message)

        def on_step(self, info):
            self.steps.append(info.step)

    log = Log()
    t0 = time.perf_counter()
    both = train_or_reuse(m_high, cache, lora, train, tmp_path / "two", log, parallel=experts, preview_partner=m_low)
    wall = time.perf_counter() - t0
    assert both.variant == "wan-tiny-high-noise" and both.companion.variant == "wan-tiny-low-noise"
    # where the time outside the steps went, per expert: the worker's start, the run's start-up, the worker's exit
    for got in (both, both.companion):
        ready, exit_s, startup = (got.settings[k] for k in ("worker_ready_s", "worker_exit_s", "startup_s"))
        assert 0 < ready and 0 <= exit_s and ready + startup["total"] + exit_s < wall
    assert sum(line.startswith(("worker ready on cpu", "[low-noise expert (cpu)] worker ready on cpu"))
               for line in log.lines) == 2, log.lines
    exits = [line for line in log.lines if line.startswith("experts: worker exit after writing the result")]
    assert len(exits) == 1 and "high-noise expert's" in exits[0] and "low-noise expert's" in exits[0], log.lines
    assert log.steps == [1, 2, 3]  # the connected expert drives the progress
    assert any("[low-noise expert (cpu)] step 3/3" in line for line in log.lines)
    for got, (model, partner) in ((both, (m_high, m_low)), (both.companion, (m_low, m_high))):
        alone = train_or_reuse(model, cache, lora, train, tmp_path / "one", None, preview_partner=partner)
        assert set(got.state_dict) == set(alone.state_dict)
        for k, v in alone.state_dict.items():
            torch.testing.assert_close(got.state_dict[k], v, rtol=1e-6, atol=1e-7)
    # Save LoRA writes both, each under the prefix + its role, each the LoRA of its expert
    from safetensors.torch import load_file

    from lowvram_lora.engine.lora_io import save_lora
    from lowvram_lora.nodes import paths
    from lowvram_lora.nodes.save_lora import LowVRAMSaveLoRA

    monkeypatch.setitem(paths._standalone, "output_dir", tmp_path / "out")
    saved = LowVRAMSaveLoRA.execute(both, "loras/wan22").ui["text"]
    assert [Path(p).name for p in saved] == ["wan22_high_noise_00001_.safetensors",
                                            "wan22_low_noise_00001_.safetensors"]
    for path, one in zip(saved, (both, both.companion)):
        ref = load_file(str(save_lora(one, tmp_path / f"ref_{one.variant}.safetensors")))
        assert load_file(path).keys() == ref.keys()
        assert all(torch.equal(load_file(path)[k], v) for k, v in ref.items())
    log = Log()  # both one-expert runs are now stored: the two-expert run reuses them, no worker starts
    again = train_or_reuse(m_high, cache, lora, train, tmp_path / "one", log, parallel=experts, preview_partner=m_low)
    assert sum("reusing the finished run" in line for line in log.lines) == 2 and again.companion is not None
    with pytest.raises(ConfigError, match="the other expert of wan-tiny-high-noise is wan-tiny-low-noise"):
        train_or_reuse(m_high, cache, lora, train, tmp_path / "bad", None, parallel=experts, preview_partner=m_high)
    with pytest.raises(ConfigError, match="connect the other expert"):
        train_or_reuse(m_high, cache, lora, train, tmp_path / "bad", None, parallel=experts)
