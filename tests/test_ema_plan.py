"""The adapter's EMA in the memory plan: its fp32 copy (4 bytes per adapter weight) is counted in VRAM, or in pinned
host RAM where the plan keeps the AdamW moments (optimizer_on_host: one rule for both), and training with it on the
host gives the EMA of training with it on the device; a resume restores it exactly (engine/train/ema.py, host_flat.py,
engine/offload/plan.py). The GPU run of the same is in tests/test_memory_gpu.py."""
from dataclasses import replace

import pytest
import torch

from lowvram_lora.engine.config import AdapterConfig, LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.offload import OffloadConfig
from lowvram_lora.engine.offload.plan import (EMA_BYTES_PER_PARAM, GB, HEADROOM_BYTES, ModelFootprint, Workload,
                                              build_plan, make_plan)
from lowvram_lora.engine.train import loop, train_lora
from lowvram_lora.engine.train.ema import AdapterEma
from lowvram_lora.engine.train.host_flat import HostFlat

WL = Workload(1, 4096, 512, "1024x1024")


def _flux1_dev(ema: bool) -> ModelFootprint:
    """Flux.1-dev's block sizes (bf16) with a LoRA r16 on the default targets (46.7M weights)."""
    return ModelFootprint(name="flux1-dev", block_names=[f"b{i}" for i in range(57)],
                          block_bytes=[679_700_000] * 19 + [283_200_000] * 38, other_bytes=160_000_000,
                          trainable_params=46_700_000, hidden_size=3072,
                          unit_bytes=[[377_300_000, 302_400_000]] * 19 + [None] * 38,
                          ema_bytes_per_param=EMA_BYTES_PER_PARAM if ema else 0.0)


@pytest.mark.parametrize("on_host", [False, True])
@pytest.mark.parametrize("resume", [False, True])
def test_the_plan_counts_the_ema_where_the_moments_live(on_host, resume):
    ema_bytes = 46_700_000 * 4
    args = dict(resident=range(20), prefetch_depth=2, activation_offload=True, optimizer_on_host=on_host,
                resume_staging=resume)
    without, with_ema = build_plan(_flux1_dev(False), WL, **args), build_plan(_flux1_dev(True), WL, **args)
    vram = with_ema.predicted_peak_bytes - without.predicted_peak_bytes
    host = with_ema.host_phases["train"] - without.host_phases["train"]
    # on the GPU: VRAM grows by the EMA; on the host: host RAM does, pinned beside the moments. A resume save stages it
    # in host RAM wherever it lives.
    assert vram == (0 if on_host else ema_bytes)
    assert host == (ema_bytes if on_host else 0) + (ema_bytes if resume else 0)
    assert with_ema.host_breakdown["ema"] == (ema_bytes if on_host else 0)
    assert with_ema.breakdown.get("ema", 0) == (0 if on_host else ema_bytes) and "ema" not in without.breakdown
    assert with_ema.ema_on_host == on_host and not without.ema_on_host
    where = "adapter EMA in pinned host RAM" if on_host else "adapter EMA on the training device"
    assert where in with_ema.describe() and "adapter EMA" not in without.describe()
    assert with_ema.summary()["ema"] == ("host" if on_host else "device") and without.summary()["ema"] is None


def test_auto_puts_the_ema_on_the_host_when_it_does_not_fit_on_the_gpu():
    # Flux.1-dev 1024² in 2 token chunks, every block streamed: 3.03 GB without an EMA, 3.22 GB with it on the GPU
    budget, chunks = int(3.1 * GB), OffloadConfig(mode="auto", recompute_chunks=2)
    plain = make_plan(_flux1_dev(False), WL, chunks, budget)
    assert not plain.optimizer_on_host  # without the EMA the moments stay on the GPU
    with pytest.raises(ConfigError, match="vram_budget_gb=3.1 is below the smallest plan"):
        make_plan(_flux1_dev(True), WL, replace(chunks, optimizer_on_host=False), budget)
    ema = make_plan(_flux1_dev(True), WL, chunks, budget)
    assert ema.optimizer_on_host and ema.ema_on_host and ema.predicted_peak_bytes + HEADROOM_BYTES <= budget
    assert ema.host_breakdown["ema"] == 46_700_000 * 4 and "ema" not in ema.breakdown
    assert "AdamW moments on the host, adapter EMA in pinned host RAM" in ema.describe()


def test_host_flat_round_trips_tensors_of_any_shape():
    torch.manual_seed(0)
    tensors = [torch.randn(3, 4), torch.randn(5), torch.tensor(2.5), torch.randn(2, 1, 3)]
    flat = HostFlat(tensors)
    assert [v.shape for v in flat.views] == [t.shape for t in tensors]
    assert all(torch.equal(v, t) for v, t in zip(flat.views, tensors))
    assert flat.flat[torch.device("cpu")].numel() == 3 * 4 + 5 + 1 + 6  # one buffer for the device
    work = flat.to_device()
    assert all(w.data_ptr() != v.data_ptr() for w, v in zip(work, flat.views))  # a copy, updated apart from the host
    for w in work:
        w.mul_(2)
    assert all(torch.equal(v, t) for v, t in zip(flat.views, tensors))
    flat.to_host()
    flat.wait()
    assert all(torch.equal(v, 2 * t) for v, t in zip(flat.views, tensors))


def _lora(**adapter):
    return LoraSettings(rank=2, alpha=2, adapter=AdapterConfig(**adapter))


def _host_ema(monkeypatch) -> list:
    """Every EMA the loop makes kept on the host (on a CPU run the plan has no host to choose: the same code path)."""
    made = []

    def on_host(named, decay, on_host=False):
        made.append(AdapterEma(named, decay, on_host=True))
        return made[-1]

    monkeypatch.setattr(loop, "AdapterEma", on_host)
    return made


def test_ema_on_the_host_trains_like_ema_on_the_device(tiny_pipeline, one_image_cache, monkeypatch):
    def run():
        return train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), one_image_cache, _lora(ema_decay=0.6),
                          TrainConfig(steps=3, learning_rate=1e-2, seed=0, device="cpu"))

    device = run()
    made = _host_ema(monkeypatch)
    host = run()
    assert len(made) == 1 and made[0].on_host
    assert host.ema_state_dict.keys() == device.ema_state_dict.keys()
    for k, v in device.ema_state_dict.items():
        torch.testing.assert_close(host.ema_state_dict[k], v, rtol=1e-6, atol=0, msg=k)
        assert torch.equal(host.state_dict[k], device.state_dict[k]), k  # the weights are untouched by where it lives
    assert any(not torch.equal(v, device.state_dict[k]) for k, v in device.ema_state_dict.items())


def test_resume_with_the_ema_on_the_host_is_bit_exact(tiny_pipeline, one_image_cache, tmp_path, monkeypatch):
    """Stopped at step 2 and resumed with the EMA on the host: weights and EMA equal an uninterrupted run's (EMA on the
    device) bit for bit: the resume state restores the EMA into its host buffer in place."""
    from lowvram_lora.engine.callbacks import TrainingCallback
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
    lora = _lora(ema_decay=0.7)
    whole = train_or_reuse(model, one_image_cache, lora, train, tmp_path / "a", StopAt())
    made = _host_ema(monkeypatch)
    first = train_or_reuse(model, one_image_cache, lora, train, tmp_path / "b", StopAt(2))
    assert first.interrupted and first.steps == 2
    resumed = train_or_reuse(model, one_image_cache, lora, train, tmp_path / "b", StopAt())
    assert resumed.steps == 4 and len(made) == 2 and all(e.on_host for e in made)
    for k, v in whole.state_dict.items():
        assert torch.equal(resumed.state_dict[k], v), k
        assert torch.equal(resumed.ema_state_dict[k], whole.ema_state_dict[k]), k


def test_the_training_plan_counts_the_ema_of_the_run(tiny_pipeline):
    """The placement gives the plan the run's EMA (the loop says whether there is one)."""
    from lowvram_lora.engine.train.placement import Streamed

    for ema in (False, True):
        placement = Streamed(OffloadConfig(mode="stream"), torch.device("cpu"))
        placement.ema = ema
        fp = _flux1_dev(False)
        placement._per_weight(fp, TrainConfig())
        assert fp.ema_bytes_per_param == (EMA_BYTES_PER_PARAM if ema else 0)
        assert replace(fp).ema_bytes_per_param == fp.ema_bytes_per_param  # a split's parts carry it (split.py)
