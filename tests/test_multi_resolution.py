"""Multi-resolution training: each image cached at several sizes (latents equal to the VAE encode of the resized
image), batches never mix sizes, only the new sizes are built, the plan is made for the largest."""
import itertools

import numpy as np
import pytest
import torch
from PIL import Image

from lowvram_lora.engine.caching import build_dataset_cache, open_dataset_cache
from lowvram_lora.engine.config import DataConfig, LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.data.options import DatasetOptions, parse_resolutions
from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.families import get_family
from lowvram_lora.engine.models import load_transformer
from lowvram_lora.engine.offload.footprint import workload_for
from lowvram_lora.engine.testing import make_tiny_dataset
from lowvram_lora.engine.train import train_lora
from lowvram_lora.engine.train.batching import bucket_batches


def _build(pipe, data, cache_dir, **options):
    return build_dataset_cache(ModelConfig(transformer_path=str(pipe)),
                               DataConfig(path=str(data), resolution=128, bucket_step=32), cache_dir,
                               options=DatasetOptions(**options) if options else None)


@pytest.fixture(scope="module")
def sizes(tiny_pipeline, tmp_path_factory):
    root = tmp_path_factory.mktemp("multires")
    data = make_tiny_dataset(root / "data", count=3)
    plain = _build(tiny_pipeline, data, root / "cache")
    multi = _build(tiny_pipeline, data, root / "cache", resolutions=(64, 128))
    return plain, multi


def test_each_size_is_an_item_and_only_the_new_size_is_built(sizes):
    plain, multi = sizes
    assert len(plain.items) == 3 and len(multi.items) == 6
    # The main size's entries are the ones the one-size cache had (its keys did not change); the rebuild encoded
    # only the 64-pixel latents, and no text (the captions are shared).
    assert {(i.image, i.latent_key, i.text_key) for i in plain.items} <= \
        {(i.image, i.latent_key, i.text_key) for i in multi.items}
    assert multi.stats["latents_built"] == 3 and multi.stats["latents_reused"] == 3
    assert multi.stats["text_built"] == 0
    assert {max(i.bucket) <= 96 for i in multi.items if i not in plain.items} == {True}
    assert open_dataset_cache(multi.manifest_path).items == multi.items
    assert multi.dataset_hash != plain.dataset_hash


def test_each_sizes_latent_is_the_vae_encode_of_the_resized_image(tiny_pipeline, sizes):
    from diffusers import AutoencoderKL

    _, multi = sizes
    vae = AutoencoderKL.from_pretrained(tiny_pipeline / "vae", torch_dtype=torch.float32, use_safetensors=True,
                                        local_files_only=True).eval()
    square = [i for i in multi.items if i.image.endswith("img_000.png")]  # a 128x128 image: no crop at either size
    assert sorted(i.bucket for i in square) == [(64, 64), (128, 128)]
    for item in square:
        w, h = item.bucket
        img = Image.open(item.image).convert("RGB")
        img = img.resize((w, h), Image.Resampling.LANCZOS) if (w, h) != img.size else img
        pixels = torch.from_numpy(np.array(img)).to(torch.float32).permute(2, 0, 1)  # (3, h, w)
        with torch.no_grad():
            mean = vae.encode(pixels[None] / 127.5 - 1.0).latent_dist.mean
        expected = (mean - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor
        latent, _ = multi.load_item(item)
        torch.testing.assert_close(latent, expected[0], rtol=1e-4, atol=1e-4)


def test_batches_never_mix_sizes_and_the_plan_is_the_largest(tiny_pipeline, sizes):
    _, multi = sizes
    stream = bucket_batches(multi.training_items(), 4, 0, lambda it: it.batch_key())
    for batch in itertools.islice(stream, 12):
        assert len({it.bucket for it in batch}) == 1
    family = get_family("flux1")
    largest = workload_for(multi, family, multi.variant, 1)
    assert largest.image_tokens == max(family.memory.image_tokens(w, h, multi.variant) for w, h in
                                       (i.bucket for i in multi.items))
    assert largest.label in {"128x128", "160x96", "96x160"}
    base, fam, _, variant = load_transformer(tiny_pipeline, dtype=torch.float32)
    result = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), multi, LoraSettings(rank=4),
                        TrainConfig(steps=2, batch_size=2, device="cpu"), preloaded=(base, fam, variant))
    assert result.steps == 2 and all(v == v for v in result.loss_history)


def test_bad_sizes_are_named():
    assert parse_resolutions("512, 768 1024") == (512, 768, 1024) and parse_resolutions("  ") == ()
    with pytest.raises(ConfigError, match="resolutions: 'x' is not a whole number"):
        parse_resolutions("512, x")
    with pytest.raises(ConfigError, match="resolutions: 100 must be .* a multiple of 16"):
        DatasetOptions(resolutions=(100,))
