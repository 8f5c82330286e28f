"""Masked loss: masks found, checked and cropped like their images; the loss equals a hand-computed masked MSE."""
import contextlib

import numpy as np
import pytest
import torch
from PIL import Image

from lowvram_lora.engine.caching import build_dataset_cache
from lowvram_lora.engine.config import DataConfig, LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.data.masks import latent_mask, load_mask
from lowvram_lora.engine.data.options import DatasetOptions
from lowvram_lora.engine.errors import ConfigError, DatasetError
from lowvram_lora.engine.families import get_family, predict_velocity
from lowvram_lora.engine.models import load_transformer
from lowvram_lora.engine.testing import make_tiny_dataset
from lowvram_lora.engine.train import train_lora
from lowvram_lora.engine.train.flow_matching import mask_weights, noisy_latents_and_target, sample_sigmas
from lowvram_lora.engine.train.loop import _load_batch, _micro_step
from lowvram_lora.engine.train.loss_options import LossOptions


def _mask(size, box):
    """White ``box`` (left, top, right, bottom) on black."""
    m = np.zeros((size[1], size[0]), np.uint8)
    m[box[1]:box[3], box[0]:box[2]] = 255
    return m


def _dataset_with_masks(folder, where="beside", count=3):
    return _add_masks(make_tiny_dataset(folder, count=count), where)


def _add_masks(data, where="beside"):
    for img in sorted(data.glob("*.png")):
        with Image.open(img) as im:
            size = im.size
        m = Image.fromarray(_mask(size, (8, 16, size[0] // 2 + 8, size[1] - 24)))
        if where == "beside":
            m.save(img.with_name(img.stem + "_mask.png"))
        else:
            (data / "masks").mkdir(exist_ok=True)
            m.save(data / "masks" / img.name)
    return data


def _build(pipe, data, root, **options):
    return build_dataset_cache(ModelConfig(transformer_path=str(pipe)),
                               DataConfig(path=str(data), resolution=128, bucket_step=32), root / "cache",
                               options=DatasetOptions(**options))


@pytest.fixture(scope="module")
def masked_cache(tiny_pipeline, tmp_path_factory):
    root = tmp_path_factory.mktemp("masked")
    return _build(tiny_pipeline, _dataset_with_masks(root / "data", count=2), root, mask_source="beside")


def test_a_mask_is_cropped_like_its_image_and_averaged_per_latent_cell(tmp_path):
    # 160x112 into a 128x128 bucket: scaled to cover (height 112 -> 128, width 160 -> 183), centre-cropped.
    img = Image.new("RGBA", (160, 112), (255, 0, 0, 255))
    alpha = _mask((160, 112), (0, 0, 80, 112))  # left half opaque
    img.putalpha(Image.fromarray(alpha))
    img.save(tmp_path / "a.png")
    m = load_mask(tmp_path / "a.png", "alpha", (128, 128))
    assert m.shape == (128, 128) and m.dtype == torch.uint8
    ref = np.asarray(Image.fromarray(alpha).resize((128, 128), Image.Resampling.BICUBIC,
                                                   box=((160 - 112) / 2, 0, (160 + 112) / 2, 112)))
    assert np.abs(m.numpy().astype(int) - ref.astype(int)).max() <= 1
    flipped = load_mask(tmp_path / "a.png", "alpha", (128, 128), flip=True)
    assert torch.equal(flipped, m.flip(-1))
    # Area rule: each latent cell is the mean of the 8x8 pixels it covers.
    cells = latent_mask(m, (16, 16)).numpy()
    np.testing.assert_allclose(cells, m.numpy().reshape(16, 8, 16, 8).mean((1, 3)) / 255.0, rtol=0, atol=1e-6)


def test_the_masked_loss_equals_a_hand_computed_masked_mse(tiny_pipeline, masked_cache):
    model, family, _, variant = load_transformer(tiny_pipeline, dtype=torch.float32)
    model.requires_grad_(True)  # the micro-step runs its backward
    item = masked_cache.items[0]
    latents, embeds, masks = _load_batch(masked_cache, [item], "cpu", torch.float32, torch.Generator())
    assert masks is not None and masks.shape == (1, item.bucket[1], item.bucket[0])
    weights = mask_weights(masks, latents.shape[-2:], 0.25)
    cfg = TrainConfig(steps=1, device="cpu")
    loss = _micro_step(model, family, latents, embeds, cfg, torch.Generator().manual_seed(5),
                       contextlib.nullcontext(), 1.0, 0, (0.0, 1.0), weights)
    # By hand: the same draws, the model's prediction, numpy's masked mean in float64.
    g = torch.Generator().manual_seed(5)
    sigmas = sample_sigmas(1, g, mu=family.schedule.train_shift_mu(latents))
    noise = torch.randn(latents.shape, generator=g)
    noisy, target = noisy_latents_and_target(latents, noise, sigmas)
    with torch.no_grad():
        pred = predict_velocity(family, model, noisy, embeds, sigmas, 1.0)
    h, w = latents.shape[-2:]
    pix = masks[0].numpy().astype(np.float64) / 255.0
    cell = pix.reshape(h, pix.shape[0] // h, w, pix.shape[1] // w).mean((1, 3))
    weight = 0.25 + 0.75 * cell  # unmasked area counts 0.25
    err = (pred.double().numpy() - target.double().numpy()) ** 2  # (1, C, h, w)
    hand = (err * weight[None, None]).mean()
    assert loss == pytest.approx(hand, rel=1e-5)
    assert hand < err.mean()  # the mask did something


def test_unmasked_weight_one_is_the_plain_loss_and_a_black_mask_trains_nothing(tiny_pipeline, masked_cache, tmp_path):
    mc = ModelConfig(transformer_path=str(tiny_pipeline))
    base, family, _, variant = load_transformer(tiny_pipeline, dtype=torch.float32)
    train = TrainConfig(steps=1, learning_rate=1e-3, seed=3, device="cpu")
    plain_cache = _build(tiny_pipeline, masked_cache.items[0].image.rsplit("/", 1)[0], tmp_path)

    def run(cache, **loss):
        return train_lora(mc, cache, LoraSettings(rank=4), train, loss=LossOptions(**loss),
                          preloaded=(base, family, variant))

    plain = run(plain_cache)
    full = run(masked_cache, unmasked_weight=1.0)
    assert full.loss_history == pytest.approx(plain.loss_history, rel=1e-6)
    masked = run(masked_cache)
    assert all(m < p for m, p in zip(masked.loss_history, plain.loss_history))


def test_masks_beside_in_a_folder_and_a_rebuild_adds_only_the_masks(tiny_pipeline, tmp_path):
    data = _dataset_with_masks(tmp_path / "data", where="folder", count=2)
    plain = _build(tiny_pipeline, data, tmp_path)
    masked = _build(tiny_pipeline, data, tmp_path, mask_source="folder")
    assert masked.stats["text_built"] == masked.stats["latents_built"] == 0 and masked.stats["masks_built"] == 2
    assert masked.dataset_hash != plain.dataset_hash and all(i.mask_key for i in masked.items)
    again = _build(tiny_pipeline, data, tmp_path, mask_source="folder")
    assert again.stats["masks_built"] == 0 and again.stats["masks_reused"] == 2
    assert _build(tiny_pipeline, data, tmp_path).dataset_hash == plain.dataset_hash  # no masks: the hash as before


def test_missing_wrong_size_and_alpha_less_masks_are_named(tiny_pipeline, tmp_path):
    data = _dataset_with_masks(tmp_path / "data", count=3)
    (data / "img_001_mask.png").unlink()
    Image.new("L", (10, 10), 255).save(data / "img_002_mask.png")
    with pytest.raises(DatasetError, match=r"2 image\(s\) have no usable mask: img_001.png: no mask .*img_002.png: "
                                           r"its mask img_002_mask.png is 10x10"):
        _build(tiny_pipeline, data, tmp_path, mask_source="beside")
    said = []

    class Log:
        def log(self, m):
            said.append(m)

        def on_progress(self, *a):
            pass

    cache = build_dataset_cache(ModelConfig(transformer_path=str(tiny_pipeline)),
                                DataConfig(path=str(data), resolution=128, bucket_step=32), tmp_path / "cache",
                                callback=Log(), options=DatasetOptions(mask_source="beside", missing_mask="skip"))
    assert [i.image.rsplit("/", 1)[1] for i in cache.items] == ["img_000.png"]
    assert any("skipping img_001.png: no mask" in m for m in said)
    with pytest.raises(DatasetError, match="img_000.png: no alpha channel"):
        _build(tiny_pipeline, data, tmp_path, mask_source="alpha")
    with pytest.raises(ConfigError, match="mask_source='mask' is not one of none, beside, folder, alpha"):
        DatasetOptions(mask_source="mask")


def _kontext_pairs_with_masks(tiny_pipeline, root, count=2):
    """The tiny Flux.1 pipeline under a Kontext name (a reference image per target) and a pairs dataset whose TARGETS
    have masks beside them (``add_tiny_controls``: each reference at 3/4 of its target's size)."""
    from lowvram_lora.engine.families.tiny import add_tiny_controls

    import shutil

    named = shutil.copytree(tiny_pipeline, root / "FLUX.1-Kontext-tiny")  # a copy: what a path was is remembered
    return named, _add_masks(add_tiny_controls(make_tiny_dataset(root / "data", count=count)))


def _build_pairs(pipe, data, root, **options):
    return build_dataset_cache(ModelConfig(transformer_path=str(pipe), dtype="fp32"),
                               DataConfig(path=str(data), resolution=128, bucket_step=32), root / "cache",
                               device="cpu", options=DatasetOptions(**options))


def test_an_edit_pairs_target_mask_weighs_the_loss_and_its_reference_is_unmasked(tiny_pipeline, tmp_path):
    """Flux.1 Kontext pairs: the target's mask (beside it) is cached at the target's bucket and weighs the loss on the
    target's latent grid; the reference latent is in the inputs, unmasked. The loss equals numpy's masked mean of the
    model's target prediction (float64, rel 1e-5)."""
    pipe, data = _kontext_pairs_with_masks(tiny_pipeline, tmp_path)
    cache = _build_pairs(pipe, data, tmp_path, mask_source="beside")
    assert cache.variant == "flux1-kontext-tiny" and all(i.mask_key and i.controls for i in cache.items)
    model, family, _, _ = load_transformer(pipe, dtype=torch.float32)
    model.requires_grad_(True)
    item = cache.items[0]
    latents, embeds, masks = _load_batch(cache, [item], "cpu", torch.float32, torch.Generator())
    assert "control_latents_0" in embeds and masks.shape == (1, item.bucket[1], item.bucket[0])
    assert embeds["control_latents_0"].shape[-2:] != latents.shape[-2:]  # the reference has its own grid, no mask
    weights = mask_weights(masks, latents.shape[-2:], 0.0)
    loss = _micro_step(model, family, latents, embeds, TrainConfig(steps=1, device="cpu"),
                       torch.Generator().manual_seed(7), contextlib.nullcontext(), 1.0, 0, (0.0, 1.0), weights)
    g = torch.Generator().manual_seed(7)
    sigmas = sample_sigmas(1, g, mu=family.schedule.train_shift_mu(latents))
    noise = torch.randn(latents.shape, generator=g)
    noisy, target = noisy_latents_and_target(latents, noise, sigmas)
    with torch.no_grad():
        pred = predict_velocity(family, model, noisy, embeds, sigmas, 1.0)  # the target's tokens only
    assert pred.shape == target.shape
    h, w = latents.shape[-2:]
    with Image.open(data / f"{item.image.rsplit('/', 1)[1][:-4]}_mask.png") as m:  # the file, resized by hand
        assert m.size == (item.bucket[0], item.bucket[1])  # the tiny targets are already bucket-sized
        pix = np.asarray(m, np.float64) / 255.0
    cell = pix.reshape(h, pix.shape[0] // h, w, pix.shape[1] // w).mean((1, 3))
    err = (pred.double().numpy() - target.double().numpy()) ** 2
    hand = (err * cell[None, None]).mean()
    assert loss == pytest.approx(hand, rel=1e-5)
    assert 0 < hand < err.mean()


def test_edit_pairs_name_a_missing_or_wrong_size_target_mask(tiny_pipeline, tmp_path):
    """A target without its mask, or with a mask of its reference's size, is a named error (or a named skip of the
    pair); a mask never comes from the control folder."""
    pipe, data = _kontext_pairs_with_masks(tiny_pipeline, tmp_path, count=3)
    (data / "img_001_mask.png").unlink()
    with Image.open(data / "control" / "img_002.png") as ref:
        Image.new("L", ref.size, 255).save(data / "img_002_mask.png")  # the reference's size, not the target's
    with pytest.raises(DatasetError, match=r"2 target image\(s\) have no usable mask: img_001.png: no mask .*"
                                           r"img_002.png: its mask img_002_mask.png is 84x120, the image 112x160"):
        _build_pairs(pipe, data, tmp_path, mask_source="beside")
    said = []

    class Log:
        def log(self, m):
            said.append(m)

        def on_progress(self, *a):
            pass

    cache = build_dataset_cache(ModelConfig(transformer_path=str(pipe), dtype="fp32"),
                                DataConfig(path=str(data), resolution=128, bucket_step=32), tmp_path / "cache",
                                device="cpu", callback=Log(),
                                options=DatasetOptions(mask_source="beside", missing_mask="skip"))
    assert [(i.image.rsplit("/", 1)[1], i.controls[0].rsplit("/", 1)[1]) for i in cache.items] == [("img_000.png",
                                                                                                    "img_000.png")]
    assert any("skipping img_001.png: no mask" in m for m in said)
