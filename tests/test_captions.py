"""Caption controls: tag shuffle keeping the first tags, cached as a fixed set of variants; caption dropout."""
from collections import Counter

import pytest
import torch

from lowvram_lora.engine.caching import build_dataset_cache, open_dataset_cache
from lowvram_lora.engine.config import DataConfig, LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.data.captions import caption_variants, shuffled_caption
from lowvram_lora.engine.data.options import DatasetOptions
from lowvram_lora.engine.testing import make_tiny_dataset
from lowvram_lora.engine.train import train_lora


def test_a_shuffle_keeps_the_first_tags_and_is_a_pure_function():
    caption = "ohwx, red, circle, blue background, centred, flat"
    assert shuffled_caption(caption, 2, 0) == caption
    for v in range(1, 6):
        tags = shuffled_caption(caption, 2, v).split(", ")
        assert tags[:2] == ["ohwx", "red"] and sorted(tags) == sorted(caption.split(", "))
        assert shuffled_caption(caption, 2, v) == shuffled_caption(caption, 2, v)
    assert len(caption_variants(caption, 2, 6)) == 6 and caption_variants("one tag", 1, 6) == ["one tag"]


@pytest.fixture(scope="module")
def tagged(tmp_path_factory):
    root = tmp_path_factory.mktemp("tags")
    data = make_tiny_dataset(root / "data", count=2)
    for i, txt in enumerate(sorted(data.glob("*.txt"))):
        txt.write_text(f"shape {i}, red, flat, blue background, centred")
    return root, data


def _build(pipe, root, data, **options):
    return build_dataset_cache(ModelConfig(transformer_path=str(pipe)),
                               DataConfig(path=str(data), resolution=128, bucket_step=32, trigger_word="ohwx",
                                          repeats=3),
                               root / "cache", options=DatasetOptions(**options))


def test_the_cache_encodes_only_new_variants_and_training_draws_them(tiny_pipeline, tagged):
    root, data = tagged
    plain = _build(tiny_pipeline, root, data)
    three = _build(tiny_pipeline, root, data, shuffle_tags=True, caption_variants=3)
    assert three.stats["text_built"] == 2 * 2 and three.stats["latents_built"] == 0  # 2 shuffles per caption
    four = _build(tiny_pipeline, root, data, shuffle_tags=True, caption_variants=4)
    assert four.stats["text_built"] == 2 and four.stats["latents_built"] == 0  # one new shuffle per caption
    again = _build(tiny_pipeline, root, data, shuffle_tags=True, caption_variants=4, caption_dropout=0.25)
    assert again.stats["text_built"] == 1  # the empty caption, nothing else
    assert len({plain.dataset_hash, three.dataset_hash, four.dataset_hash, again.dataset_hash}) == 4
    assert _build(tiny_pipeline, root, data).dataset_hash == plain.dataset_hash
    # The trigger word is the first tag (kept first by keep_tags=1); repeats still expand the items.
    reopened = open_dataset_cache(again.manifest_path)
    assert reopened.caption_dropout == 0.25 and len(reopened.training_items()) == 3 * 2
    item = reopened.items[0]
    assert len(item.text_variants) == 3 and item.caption.startswith("ohwx, shape 0")
    # Draws: the empty caption about a quarter of the time, the four orders evenly the rest.
    g = torch.Generator().manual_seed(0)
    counts = Counter(reopened.caption_key(item, g) for _ in range(4000))
    assert counts[reopened.empty_text_key] == pytest.approx(1000, rel=0.12)
    for key in [item.text_key] + item.text_variants:
        assert counts[key] == pytest.approx(750, rel=0.15)
    # A training step reads them through the loop (each from its own cached entry) and trains.
    from lowvram_lora.engine.models import load_transformer

    base, family, _, variant = load_transformer(tiny_pipeline, dtype=torch.float32)
    result = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), reopened, LoraSettings(rank=4),
                        TrainConfig(steps=1, learning_rate=1e-3, device="cpu"), preloaded=(base, family, variant))
    assert result.steps == 1 and result.loss_history[0] > 0
