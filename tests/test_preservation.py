"""Differential output preservation: the class prompt's target is the adapter-off forward; training with it lowers
the combined loss; the class prompt is cached with the captions; the step-time model counts its passes."""
import copy

import pytest
import torch

from lowvram_lora.engine.caching import build_dataset_cache, open_dataset_cache
from lowvram_lora.engine.config import DataConfig, LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.data.options import DatasetOptions
from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.families import predict_velocity
from lowvram_lora.engine.models import load_transformer
from lowvram_lora.engine.testing import make_tiny_dataset
from lowvram_lora.engine.train import train_lora
from lowvram_lora.engine.train.flow_matching import noisy_latents_and_target
from lowvram_lora.engine.train.loss_options import LossOptions
from lowvram_lora.engine.train.preservation import class_embeds, preservation_target

from helpers import eval_flow_loss, merged

PROMPT = "a photo of a shape"


@pytest.fixture(scope="module")
def class_cache(tiny_pipeline, tmp_path_factory):
    root = tmp_path_factory.mktemp("dop")
    data = make_tiny_dataset(root / "data", count=1)
    return build_dataset_cache(ModelConfig(transformer_path=str(tiny_pipeline)),
                               DataConfig(path=str(data), resolution=128, bucket_step=32), root / "cache",
                               options=DatasetOptions(preservation_prompt=PROMPT))


def _fixed(cache, count=4):
    """(noisy, sigma) pairs of the dataset's image at fixed noise levels and noise."""
    lat, _ = cache.load_item(cache.items[0])
    out = []
    for k in range(count):
        sigma = torch.tensor([(k + 0.5) / count])
        noise = torch.randn((1,) + tuple(lat.shape), generator=torch.Generator().manual_seed(k))
        out.append((noisy_latents_and_target(lat[None], noise, sigma)[0], sigma))
    return out


def test_the_class_prompt_is_cached_once_and_reopened(tiny_pipeline, class_cache, tmp_path):
    assert class_cache.preservation_prompt == PROMPT
    assert (class_cache.cache_dir / "text" / f"{class_cache.preservation_text_key}.safetensors").exists()
    reopened = open_dataset_cache(class_cache.manifest_path)
    assert (reopened.preservation_prompt, reopened.preservation_text_key) == (PROMPT,
                                                                             class_cache.preservation_text_key)
    # Without the prompt the dataset keeps the hash it had before preservation existed (nothing extra in it); a
    # rebuild with it encodes only the class prompt.
    data = class_cache.items[0].image.rsplit("/", 1)[0]
    cfg = DataConfig(path=data, resolution=128, bucket_step=32)
    plain = build_dataset_cache(ModelConfig(transformer_path=str(tiny_pipeline)), cfg, class_cache.cache_dir)
    assert plain.dataset_hash != class_cache.dataset_hash and plain.preservation_text_key == ""
    again = build_dataset_cache(ModelConfig(transformer_path=str(tiny_pipeline)), cfg, tmp_path / "c",
                                options=DatasetOptions(preservation_prompt="a photo of a thing"))
    assert again.stats["text_built"] == 2  # its caption and the class prompt (a new cache folder)
    rebuilt = build_dataset_cache(ModelConfig(transformer_path=str(tiny_pipeline)), cfg, tmp_path / "c",
                                  options=DatasetOptions(preservation_prompt=PROMPT))
    assert rebuilt.stats["text_built"] == 1 and rebuilt.stats["text_reused"] == 1


def test_the_target_is_the_adapter_off_forward(tiny_pipeline, class_cache):
    from lowvram_lora.engine.train.lora_attach import attach_lora

    model, family, _, _ = load_transformer(tiny_pipeline, dtype=torch.float32)
    base = copy.deepcopy(model)  # the independent reference: a model that never had an adapter
    params = attach_lora(model, family, LoraSettings(rank=4), seed=0)
    with torch.no_grad():  # a LoRA that changes the output (B starts at zero)
        for p in params:
            p.normal_(0, 0.5, generator=torch.Generator().manual_seed(p.numel()))
    _, caption = class_cache.load_item(class_cache.items[0])
    emb = class_embeds(class_cache.load_text(class_cache.preservation_text_key), class_cache.collate_text([caption]))
    assert all(torch.equal(emb[k], v) for k, v in class_cache.load_text(class_cache.preservation_text_key).items())
    for noisy, sigma in _fixed(class_cache, 2):
        target = preservation_target(family, model, noisy, emb, sigma, 1.0)
        with torch.no_grad():
            reference = predict_velocity(family, base, noisy, emb, sigma, 1.0)
            adapted = predict_velocity(family, model, noisy, emb, sigma, 1.0)  # the adapter is on again
        assert not target.requires_grad
        torch.testing.assert_close(target, reference, rtol=1e-5, atol=1e-6)
        assert (adapted - reference).abs().max() > 1e-3
    assert all(p.requires_grad for p in params)


def test_training_with_preservation_lowers_the_combined_loss(tiny_pipeline, class_cache):
    base, family, _, variant = load_transformer(tiny_pipeline, dtype=torch.float32)
    weight = 2.0
    settings = (LoraSettings(rank=4), TrainConfig(steps=4, learning_rate=1e-2, seed=3, device="cpu"))
    result = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), class_cache, *settings,
                        preloaded=(base, family, variant), loss=LossOptions(preservation_weight=weight))
    plain = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), class_cache, *settings,
                       preloaded=(base, family, variant), loss=LossOptions())
    assert result.settings["preservation"] == {"prompt": PROMPT, "weight": weight}
    # Step 1 starts from B = 0: the adapter is the base model, preservation's loss is 0; then the runs part.
    assert result.loss_history[0] == pytest.approx(plain.loss_history[0], rel=1e-6)
    assert any(not torch.allclose(result.state_dict[k], plain.state_dict[k]) for k in plain.state_dict)
    emb = class_cache.load_text(class_cache.preservation_text_key)
    fixed = _fixed(class_cache, 2)

    def parts(model):  # (flow loss on the image, the class prompt's drift from the base), at fixed noise
        with torch.no_grad():
            drift = sum(torch.nn.functional.mse_loss(predict_velocity(family, model, noisy, emb, s, 1.0),
                                                     predict_velocity(family, base, noisy, emb, s, 1.0)).item()
                        for noisy, s in fixed) / len(fixed)
        return eval_flow_loss(model, family, class_cache, n=4), drift

    (flow_b, drift_b), (flow_t, drift_t), (_, drift_u) = (parts(m) for m in (
        base, merged(base, result.state_dict, result.scale), merged(base, plain.state_dict, plain.scale)))
    assert drift_b == 0.0
    assert flow_t + weight * drift_t < flow_b  # the combined loss fell
    assert drift_t < drift_u  # ... and the class drifts less than without preservation


def test_preservation_without_a_class_prompt_is_refused(tiny_pipeline, one_image_cache):
    with pytest.raises(ConfigError, match="preservation_weight=1 but the dataset cache has no class prompt; set "
                                          "preservation_prompt on Dataset Options"):
        train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), one_image_cache, LoraSettings(rank=4),
                   TrainConfig(steps=1, device="cpu"), loss=LossOptions(preservation_weight=1.0))
    with pytest.raises(ConfigError, match="preservation_weight=-1"):
        LossOptions(preservation_weight=-1)


def test_the_step_time_model_counts_the_extra_passes():
    from dataclasses import replace

    from lowvram_lora.engine.offload.plan import ModelFootprint, Workload, build_plan
    from lowvram_lora.engine.offload.steptime import Machine, predict_step_time

    fp = ModelFootprint("m", [f"b{i}" for i in range(8)], [10**9] * 8, 10**8, 10**6, 3072)
    wl = Workload(1, 4096, 512)
    machine = Machine(link_bytes_per_s=25e9, peak_flops=989e12)
    for resident in (list(range(8)), [0, 1]):  # all resident; streamed (copy-bound at this size)
        plan = build_plan(fp, wl, resident, 1, False)
        plain = predict_step_time(plan, machine)
        with_dop = predict_step_time(replace(plan, workload=replace(wl, preservation=True)), machine)
        # the step twice (a second forward + backward) and one forward: at least its compute share, and when
        # streamed one pass of the weights over the link
        share = 1 / 3
        assert with_dop.seconds >= 2 * plain.seconds + share * plain.compute_s * 0.9
        assert with_dop.seconds <= 2 * plain.seconds + max(plain.compute_s * 0.5, plain.link_busy_s / 2) + 1e-9
        if resident != list(range(8)):
            assert with_dop.seconds == pytest.approx(2 * plain.seconds + plain.link_busy_s / 2, rel=1e-6)
