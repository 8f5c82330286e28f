"""Dataset cache: layer-major encoding, reuse, invalidation, errors."""
import pytest
import torch

from lowvram_lora.engine.caching import build_dataset_cache, layer_major, main_layer_list, open_dataset_cache
from lowvram_lora.engine.caching.encoders import encoder_kind
from lowvram_lora.engine.caching.text_encoding import load_text_encoder
from lowvram_lora.engine.config import DataConfig, ModelConfig
from lowvram_lora.engine.errors import CacheError, DatasetError, ModelLoadError
from lowvram_lora.engine.families import get_family


def _build(pipe, data, cache, **kw):
    cfg = DataConfig(path=str(data), resolution=128, bucket_step=32, **kw)
    return build_dataset_cache(ModelConfig(transformer_path=str(pipe)), cfg, cache)


@pytest.mark.parametrize("encoder", [0, 1])
def test_layer_major_matches_plain_forward(tiny_pipeline, encoder):
    spec = get_family("flux1").text_encoder_specs("flux1-tiny")[encoder]
    tok, model = load_text_encoder(tiny_pipeline, spec, torch.float32)
    captions = ["a red circle", "a blue square on a green background", "ohwx", "the big cat", "a dog"]
    ids = tok(captions, padding="max_length", max_length=16, truncation=True, return_tensors="pt").input_ids
    attr = "pooler_output" if encoder_kind(spec.kind).output == "pooled" else "last_hidden_state"
    with torch.no_grad():
        ref = getattr(model(input_ids=ids), attr)
        layers = main_layer_list(model)
        with layer_major(model, torch.device("cpu"), chunk_size=2):
            assert type(layers[0]).__name__ == "_ChunkedLayer"
            out = getattr(model(input_ids=ids), attr)
    assert type(layers[0]).__name__ != "_ChunkedLayer"  # restored
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_cache_reuse_and_partial_invalidation(tiny_pipeline, tiny_dataset, tmp_path):
    cache = tmp_path / "cache"
    first = _build(tiny_pipeline, tiny_dataset, cache)
    assert first.stats["text_built"] == 4 and first.stats["latents_built"] == 4
    lat, emb = first.load_item(first.items[0])
    assert lat.shape == (4, 16, 16) and emb["prompt_embeds"].shape == (32, 32) and emb["pooled_prompt_embeds"].shape == (32,)

    again = _build(tiny_pipeline, tiny_dataset, cache)
    assert again.stats == {"text_built": 0, "text_reused": 4, "latents_built": 0, "latents_reused": 4}
    assert again.dataset_hash == first.dataset_hash

    (tiny_dataset / "img_001.txt").write_text("a purple circle on a white background")
    changed = _build(tiny_pipeline, tiny_dataset, cache)
    assert changed.stats["text_built"] == 1 and changed.stats["latents_built"] == 0
    assert changed.dataset_hash != first.dataset_hash

    from PIL import Image
    Image.new("RGB", (128, 128), (1, 2, 3)).save(tiny_dataset / "img_002.png")
    changed = _build(tiny_pipeline, tiny_dataset, cache)
    assert changed.stats["latents_built"] == 1 and changed.stats["text_built"] == 0

    trigger = _build(tiny_pipeline, tiny_dataset, cache, trigger_word="sks")
    assert trigger.stats["text_built"] == 4 and trigger.stats["latents_built"] == 0
    assert all(i.caption.startswith("sks") for i in trigger.items)

    flipped = _build(tiny_pipeline, tiny_dataset, cache, flip=True)
    assert flipped.stats["latents_built"] == 4
    a, _ = flipped.load_item(flipped.items[0], flipped=False)
    b, _ = flipped.load_item(flipped.items[0], flipped=True)
    assert not torch.equal(a, b)

    reopened = open_dataset_cache(flipped.manifest_path)
    assert reopened.dataset_hash == flipped.dataset_hash and len(reopened.items) == 4


def test_missing_captions_error_keeps_existing_cache(tiny_pipeline, tiny_dataset, tmp_path):
    cache = tmp_path / "cache"
    built = _build(tiny_pipeline, tiny_dataset, cache)
    files = sorted(p.relative_to(cache) for p in cache.rglob("*") if p.is_file())
    (tiny_dataset / "img_000.txt").unlink()
    (tiny_dataset / "img_003.txt").unlink()
    with pytest.raises(DatasetError) as e:
        _build(tiny_pipeline, tiny_dataset, cache)
    assert "img_000.png" in str(e.value) and "img_003.png" in str(e.value)
    assert sorted(p.relative_to(cache) for p in cache.rglob("*") if p.is_file()) == files
    assert open_dataset_cache(built.manifest_path).dataset_hash == built.dataset_hash
    ok = _build(tiny_pipeline, tiny_dataset, cache, default_caption="a shape")
    assert ok.stats["text_built"] == 1  # both uncaptioned images share the default caption


def test_single_file_model_needs_pipeline_folder(tiny_single_file, tiny_dataset, tmp_path):
    cfg = DataConfig(path=str(tiny_dataset), resolution=128)
    with pytest.raises(ModelLoadError, match="pipeline_path"):
        build_dataset_cache(ModelConfig(transformer_path=str(tiny_single_file)), cfg, tmp_path / "c")
    with pytest.raises(ModelLoadError, match="not a diffusers pipeline folder"):
        build_dataset_cache(ModelConfig(transformer_path=str(tiny_single_file), pipeline_path=str(tmp_path)), cfg, tmp_path / "c")


def test_cache_with_single_file_transformer_and_pipeline(tiny_single_file, tiny_pipeline, tiny_dataset, tmp_path):
    cfg = DataConfig(path=str(tiny_dataset), resolution=128, bucket_step=32)
    built = build_dataset_cache(
        ModelConfig(transformer_path=str(tiny_single_file), pipeline_path=str(tiny_pipeline)), cfg, tmp_path / "c"
    )
    assert built.family == "flux1" and built.variant == "flux1-tiny"
    # Reference: the cache built from the pipeline folder alone. Text encoders and VAE come from the same folder,
    # so every latent and embedding must be bit-identical (tolerance 0).
    ref = build_dataset_cache(ModelConfig(transformer_path=str(tiny_pipeline)), cfg, tmp_path / "ref")
    assert [i.caption for i in built.items] == [i.caption for i in ref.items] and len(ref.items) == 4
    for a, b in zip(ref.items, built.items):
        (la, ea), (lb, eb) = ref.load_item(a), built.load_item(b)
        torch.testing.assert_close(lb, la, rtol=0, atol=0)
        assert set(eb) == set(ea)
        for k in ea:
            torch.testing.assert_close(eb[k], ea[k], rtol=0, atol=0, msg=k)


def test_corrupt_manifest_and_missing_entry(tiny_pipeline, tiny_dataset, tmp_path):
    built = _build(tiny_pipeline, tiny_dataset, tmp_path / "cache")
    next((tmp_path / "cache" / "latents").glob("*.safetensors")).unlink()
    with pytest.raises(CacheError, match="missing"):
        open_dataset_cache(built.manifest_path)
    built.manifest_path.write_text("{not json")
    with pytest.raises(CacheError, match="rebuild"):
        open_dataset_cache(built.manifest_path)


def test_same_layout_different_weights_have_different_identities(tmp_path):
    """A fine-tune saved like its base has a byte-identical header and size: the identity
    must still differ, or caches, slabs and finished runs of the base would be reused."""
    from safetensors.torch import save_file

    from lowvram_lora.engine.hashing import path_identity

    for name, value in (("base", 0.0), ("finetune", 1.0), ("base_copy", 0.0)):
        save_file({"w": torch.full((1024, 1024), value)}, str(tmp_path / f"{name}.safetensors"))
    ids = {n: path_identity(tmp_path / f"{n}.safetensors") for n in ("base", "finetune", "base_copy")}
    assert ids["base"] != ids["finetune"] and ids["base"] == ids["base_copy"]
