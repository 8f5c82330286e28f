"""Training: the loss falls, only LoRA weights change, determinism, schedules, stopping."""
import pytest
import torch

from lowvram_lora.engine.callbacks import TrainingCallback
from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.families import get_family
from lowvram_lora.engine.models import load_transformer
from lowvram_lora.engine.train import train_lora
from lowvram_lora.engine.train.flow_matching import sample_sigmas

from helpers import eval_flow_loss, merged


class Recorder(TrainingCallback):
    def __init__(self, stop_after=None):
        self.steps, self.stop_after = [], stop_after

    def on_step(self, info):
        self.steps.append(info)

    def should_stop(self):
        return self.stop_after is not None and len(self.steps) >= self.stop_after


def _eval_loss(model, dataset, n=16):
    return eval_flow_loss(model, get_family("flux1"), dataset, n)


def test_loss_falls_on_a_repeated_batch_and_only_lora_changes(tiny_pipeline, one_image_cache):
    base, family, _, variant = load_transformer(tiny_pipeline, dtype=torch.float32)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    rec = Recorder()
    result = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), one_image_cache, LoraSettings(rank=8, alpha=8),
                        TrainConfig(steps=30, learning_rate=5e-3, seed=0, device="cpu"), rec, preloaded=(base, family, variant))
    assert result.steps == 30 and len(rec.steps) == 30 and not result.interrupted
    # base weights untouched, LoRA B moved away from its zero init
    after = base.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    b_norms = [v.norm().item() for k, v in result.state_dict.items() if ".lora_B." in k]
    assert len(b_norms) == 2 * 8 + 2 * 5 and min(b_norms) > 0
    # the trained model fits its one image better than the base, at fixed noise/timesteps
    base_loss = _eval_loss(base, one_image_cache)
    trained_loss = _eval_loss(merged(base, result.state_dict, result.scale), one_image_cache)
    assert trained_loss < 0.8 * base_loss, (base_loss, trained_loss)
    first5, last5 = sum(result.loss_history[:5]) / 5, sum(result.loss_history[-5:]) / 5
    assert last5 < first5


def test_same_seed_same_run_different_seed_differs(tiny_pipeline, tiny_cache):
    mc = ModelConfig(transformer_path=str(tiny_pipeline))
    runs = [train_lora(mc, tiny_cache, LoraSettings(rank=4), TrainConfig(steps=4, learning_rate=1e-3, seed=s)) for s in (7, 7, 8)]
    assert runs[0].loss_history == runs[1].loss_history
    assert all(torch.equal(runs[0].state_dict[k], runs[1].state_dict[k]) for k in runs[0].state_dict)
    assert runs[0].loss_history != runs[2].loss_history


def _assert_same_lora(result, reference, rtol=0.0, atol=0.0):
    """Same LoRA weights as the reference run; tolerance 0 (bit for bit) unless stated."""
    assert set(result.state_dict) == set(reference.state_dict) and result.state_dict
    for k, v in reference.state_dict.items():
        torch.testing.assert_close(result.state_dict[k], v, rtol=rtol, atol=atol, msg=k)


def test_accumulation_batches_cosine_warmup_and_callback(tiny_single_file, tiny_pipeline, tiny_cache):
    import math

    rec = Recorder()
    train = TrainConfig(steps=6, learning_rate=1e-3, batch_size=2, gradient_accumulation=2,
                        lr_scheduler="cosine", warmup_steps=2, max_grad_norm=0.5, device="cpu")
    result = train_lora(ModelConfig(transformer_path=str(tiny_single_file)), tiny_cache, LoraSettings(rank=2, alpha=1),
                        train, rec)
    assert [s.step for s in rec.steps] == list(range(1, 7))
    lrs = result.lr_history
    assert lrs[0] < lrs[1] and lrs[1] >= lrs[2] > lrs[-1]  # warmup, then cosine decay
    # reference: the closed form (linear warmup over 2 steps, then half a cosine to 0 at step 6), rel 1e-9
    expected = [1e-3 * (k / 2 if k < 2 else 0.5 * (1 + math.cos(math.pi * (k - 2) / (6 - 2)))) for k in range(1, 7)]
    assert lrs == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert all(s.grad_norm > 0 and s.seconds_per_step > 0 and s.peak_vram_gb == 0.0 for s in rec.steps)
    assert result.scale == 0.5
    # reference: the same run from the diffusers folder (bit-identical weights, tests/test_models.py); fp32
    # outputs differ by reassociation only (1e-6), so the LoRAs agree to rtol 1e-3 / atol 1e-5
    folder = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), tiny_cache, LoraSettings(rank=2, alpha=1),
                        train)
    assert result.loss_history == pytest.approx(folder.loss_history, rel=1e-4)
    _assert_same_lora(result, folder, rtol=1e-3, atol=1e-5)


def test_callback_can_stop_training(tiny_pipeline, tiny_cache):
    result = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), tiny_cache, LoraSettings(rank=2),
                        TrainConfig(steps=50), Recorder(stop_after=3))
    assert result.steps == 3 and result.interrupted
    # reference: a run of exactly 3 steps (constant schedule): the kept LoRA is its LoRA, bit for bit
    three = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), tiny_cache, LoraSettings(rank=2),
                       TrainConfig(steps=3))
    assert result.loss_history == three.loss_history
    _assert_same_lora(result, three)


@pytest.mark.parametrize("kwargs, match", [
    ({"steps": 0}, "steps"), ({"learning_rate": 0}, "learning_rate"), ({"lr_scheduler": "linear"}, "constant, cosine"),
    ({"warmup_steps": 10, "steps": 5}, "warmup_steps"), ({"batch_size": 0}, "batch_size"),
])
def test_bad_train_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(**kwargs)


def test_cuda_required_error_is_clear(tiny_pipeline, tiny_cache):
    if torch.cuda.is_available():
        pytest.skip("machine has CUDA")
    with pytest.raises(ConfigError, match="CUDA"):
        train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), tiny_cache, LoraSettings(), TrainConfig(device="cuda"))


def test_flux_time_shift_pushes_toward_noise_at_high_resolution():
    family = get_family("flux1")
    small, large = torch.zeros(1, 16, 64, 64), torch.zeros(1, 16, 128, 128)
    assert family.schedule.train_shift_mu(small) == pytest.approx(1.15 * 0 + 0.5 + (1024 - 256) * (0.65 / 3840), rel=1e-6)
    g = torch.Generator().manual_seed(0)
    s_small = sample_sigmas(4096, g, mu=family.schedule.train_shift_mu(small)).mean()
    g = torch.Generator().manual_seed(0)
    s_large = sample_sigmas(4096, g, mu=family.schedule.train_shift_mu(large)).mean()
    assert 0.5 < s_small < s_large < 1.0


@pytest.mark.parametrize("lo, hi, mu", [(0.875, 1.0, 1.0986), (0.0, 0.875, 1.0986), (0.3, 0.6, None)])
def test_an_experts_sigmas_are_the_full_distribution_restricted_to_its_range(lo, hi, mu):
    """sample_sigmas(lo, hi) draws the full-range distribution conditioned on [lo, hi] (inverse CDF): every draw
    inside the range, and its quantiles equal those of full-range draws that fall in the range (an independent
    rejection sample, 200k draws) within 0.01. The full range still draws exactly as before (randn)."""
    import math

    g = torch.Generator().manual_seed(0)
    ours = sample_sigmas(20000, g, 0.0, 1.0, mu, lo, hi)
    assert ((ours >= lo) & (ours <= hi)).all()
    g = torch.Generator().manual_seed(1)
    full = sample_sigmas(200000, g, 0.0, 1.0, mu)
    kept = full[(full >= lo) & (full <= hi)]
    q = torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9])
    torch.testing.assert_close(torch.quantile(ours, q), torch.quantile(kept, q), atol=0.01, rtol=0)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    u = torch.sigmoid(torch.randn(8, generator=g2)).clamp(1e-5, 1 - 1e-5)
    want = math.exp(0.5) / (math.exp(0.5) + (1.0 / u - 1.0))
    assert torch.equal(sample_sigmas(8, g1, 0.0, 1.0, 0.5), want)


def test_a14b_experts_train_on_their_side_of_the_boundary():
    """Wan 2.2 A14B: the high-noise expert's range is [0.875, 1], the low-noise one's [0, 0.875]; other models
    (and other families) train on everything."""
    wan = get_family("wan")
    assert wan.schedule.train_sigma_range("wan2.2-t2v-a14b-high-noise") == (0.875, 1.0)
    assert wan.schedule.train_sigma_range("wan2.2-t2v-a14b-low-noise") == (0.0, 0.875)
    assert wan.schedule.train_sigma_range("wan2.1-t2v-14b") == (0.0, 1.0)
    assert get_family("flux1").schedule.train_sigma_range("flux1-dev") == (0.0, 1.0)


def test_stop_between_micro_steps_keeps_finished_steps(tiny_pipeline, tiny_cache):
    class StopInSecondStep(TrainingCallback):
        def __init__(self):
            self.polls = 0

        def should_stop(self):
            self.polls += 1
            return self.polls >= 3  # polls: step1 micro0, step1 end, step2 micro0 -> stop

    result = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), tiny_cache, LoraSettings(rank=2),
                        TrainConfig(steps=10, gradient_accumulation=2), StopInSecondStep())
    assert result.interrupted and result.steps == 1 and len(result.loss_history) == 1
    # reference: a one-step run; the half-done second step left no trace in the LoRA (bit for bit)
    one = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), tiny_cache, LoraSettings(rank=2),
                     TrainConfig(steps=1, gradient_accumulation=2))
    assert result.loss_history == one.loss_history
    _assert_same_lora(result, one)


def test_stop_request_on_the_last_step_does_not_discard_the_run(tiny_pipeline, tiny_cache):
    class AlwaysRaise(TrainingCallback):
        def should_stop(self):
            raise KeyboardInterrupt  # would lose the run if polled after the final step

    result = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), tiny_cache, LoraSettings(rank=2),
                        TrainConfig(steps=1), AlwaysRaise())
    assert result.steps == 1 and not result.interrupted
    # reference: the same step without a callback; the kept run is that run, bit for bit
    _assert_same_lora(result, train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), tiny_cache,
                                         LoraSettings(rank=2), TrainConfig(steps=1)))


def test_adamw8bit_is_cuda_only_with_a_clear_error(tiny_pipeline, tiny_cache):
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    with pytest.raises(ConfigError, match="adamw8bit.*CUDA only"):
        train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), tiny_cache, LoraSettings(rank=2),
                   TrainConfig(steps=1, optimizer="adamw8bit"))
    with pytest.raises(ConfigError, match="adamw, adamw8bit"):
        TrainConfig(optimizer="sgd")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_adamw8bit_trains_on_gpu(tiny_pipeline, one_image_cache):
    result = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), one_image_cache, LoraSettings(rank=8),
                        TrainConfig(steps=30, learning_rate=5e-3, seed=0, optimizer="adamw8bit", device="cuda"))
    assert result.steps == 30
    assert sum(result.loss_history[-5:]) < sum(result.loss_history[:5])


def test_a_cpu_run_reports_no_gpu_only_figures():
    """On a CPU run the step breakdown leaves out block-copy waits and GPU host time (issue 28 point 7); on a GPU
    run they stay."""
    from lowvram_lora.engine.train.step_timing import describe

    parts = {"data": 0.01, "compute": 1.0, "optimizer": 0.1, "copy_stall": 0.0, "host": 0.05, "wall": 1.2}
    assert "block copies" not in describe(parts, gpu=False) and "host outside" not in describe(parts, gpu=False)
    assert "waiting for block copies 0.000 s" in describe(parts, gpu=True)


def test_the_phase_clock_splits_the_time_between_marks():
    """Each mark closes the phase since the previous one; a phase marked twice adds up; the line leaves out phases
    under 0.05 s."""
    from lowvram_lora.engine.train import step_timing

    now = iter([10.0, 12.5, 12.51, 20.0, 21.0])
    clock = step_timing.PhaseClock(now=lambda: next(now))
    assert clock.mark("model") == 2.5 and clock.mark("data") == pytest.approx(0.01)
    clock.mark("placement")
    assert clock.mark("model") == 3.5  # 2.5 + 1.0
    assert clock.seconds == {"model": 3.5, "data": 0.01, "placement": 7.49} and clock.total() == 11.0
    assert clock.describe("start-up") == "start-up 11.0 s: model 3.5 s, placement 7.5 s"


def test_the_finite_check_before_a_save_names_the_bad_tensor():
    """The save-time check reads one flag per device, and still names the tensor that went non-finite."""
    from lowvram_lora.engine.errors import TrainingDivergedError
    from lowvram_lora.engine.train.loop import _check_finite_weights

    good = [("a", torch.ones(3)), ("b", torch.zeros(2, 2))]
    _check_finite_weights(good, 4)
    with pytest.raises(TrainingDivergedError, match="'c'"):
        _check_finite_weights(good + [("c", torch.tensor([1.0, float("inf")]))], 4)
