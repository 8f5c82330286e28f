"""Noise-level samplers and loss weightings: the family's draw stays the default; others match their definitions."""
import math

import pytest
import torch

from lowvram_lora.engine.config import TrainConfig
from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.families import families, get_family
from lowvram_lora.engine.train.flow_matching import draw_sigmas, loss_weights, sample_sigmas
from lowvram_lora.engine.train.loop import _draw_levels
from lowvram_lora.engine.train.loss_options import LossOptions


@pytest.mark.parametrize("family_id", sorted(families()))
def test_every_family_keeps_its_draw_as_the_default(family_id):
    family = get_family(family_id)
    assert family.schedule.train_sampling == "shift" and family.schedule.loss_weighting == "none"
    lat = torch.zeros(2, 16, 1, 32, 32) if family.video else torch.zeros(2, 16, 32, 32)
    cfg = TrainConfig(steps=1)
    want = sample_sigmas(2, torch.Generator().manual_seed(1), 0.0, 1.0, family.schedule.train_shift_mu(lat))
    for opts in (None, LossOptions()):
        sigmas, weights = _draw_levels(family, lat, cfg, torch.Generator().manual_seed(1), (0.0, 1.0), opts)
        assert torch.equal(sigmas, want) and weights is None


def _quantile(x, q):
    return float(torch.quantile(x.double(), q))


def test_samplers_follow_their_definitions():
    n = 40000
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    u = draw_sigmas("uniform", n, g())
    assert float(u.mean()) == pytest.approx(0.5, abs=0.01) and float(u.var()) == pytest.approx(1 / 12, rel=0.03)
    part = draw_sigmas("uniform", n, g(), lo=0.2, hi=0.6)
    assert 0.2 <= float(part.min()) and float(part.max()) <= 0.6 and float(part.mean()) == pytest.approx(0.4, abs=0.01)
    # sigmoid(scale x z): its 84.13th percentile is sigmoid(scale) (z's is 1).
    s = draw_sigmas("sigmoid", n, g(), scale=1.5)
    assert _quantile(s, 0.8413) == pytest.approx(1 / (1 + math.exp(-1.5)), abs=0.01)
    ln = draw_sigmas("logit_normal", n, g(), mean=0.5, std=0.7)
    assert _quantile(ln, 0.5) == pytest.approx(1 / (1 + math.exp(-0.5)), abs=0.01)
    # shift: the median is the shifted median, e^mu / (e^mu + 1/t - 1) at t = sigmoid(mean).
    sh = draw_sigmas("shift", n, g(), mean=0.0, std=1.0, mu=math.log(3.0))
    assert _quantile(sh, 0.5) == pytest.approx(3.0 / (3.0 + 1.0), abs=0.01)
    with pytest.raises(ValueError, match="not one of shift, logit_normal, uniform, sigmoid"):
        draw_sigmas("cosine", 1, g())


def test_weightings_equal_diffusers_sd3_and_the_min_snr_formula():
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    sigmas = torch.tensor([0.05, 0.2, 0.5, 0.7, 0.95])
    for scheme in ("sigma_sqrt", "cosmap"):
        torch.testing.assert_close(loss_weights(scheme, sigmas), compute_loss_weighting_for_sd3(scheme, sigmas),
                                   rtol=1e-5, atol=0)
    assert loss_weights("none", sigmas) is None
    # min(SNR, gamma) x sigma^2, SNR = ((1 - s) / s)^2: (1 - s)^2 below gamma, gamma s^2 above it.
    want = [min(((1 - s) / s) ** 2, 5.0) * s * s for s in sigmas.tolist()]
    assert loss_weights("min_snr", sigmas).tolist() == pytest.approx(want, rel=1e-6)
    assert want[0] == pytest.approx(5.0 * 0.05 ** 2) and want[3] == pytest.approx(0.3 ** 2)


def test_chosen_draws_reach_the_step_and_enter_the_runs_key():
    family = get_family("flux1")
    lat = torch.zeros(4, 16, 32, 32)
    opts = LossOptions(timestep_sampling="uniform", loss_weighting="min_snr", snr_gamma=2.0)
    sigmas, weights = _draw_levels(family, lat, TrainConfig(steps=1), torch.Generator().manual_seed(3), (0.0, 1.0), opts)
    assert torch.equal(sigmas, draw_sigmas("uniform", 4, torch.Generator().manual_seed(3)))
    assert torch.equal(weights, loss_weights("min_snr", sigmas, 2.0))
    assert opts.result_key_settings() == {"timestep_sampling": "uniform", "loss_weighting": "min_snr",
                                          "snr_gamma": 2.0}
    with pytest.raises(ConfigError, match="timestep_sampling='cosine' is not one of family, shift"):
        LossOptions(timestep_sampling="cosine")
