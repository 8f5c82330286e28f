"""Qwen-Image-Edit through the cache and sampling, on tiny models against diffusers 0.42.1's own pieces.

- Cache Text Embeds on a pairs dataset (``add_tiny_controls``: targets + ``control/``) from ComfyUI-style single
  files: each item's cached prompt equals the multimodal prompt of the whole ``Qwen2_5_VLForConditionalGeneration``
  loaded from the pipeline folder (``edit_text.encode_with_model``, itself equal to the pipeline's in test_edit.py),
  and its control latents equal ``encode_controls`` on diffusers' VAE from that folder; ``load_item`` /
  ``collate_text`` deliver them as ``control_latents_0``. 1e-5 (fp32).
- Sampling previews: ``sample_latents`` with the control latents in the prompt's and the negative's embeds equals
  ``QwenImageEditPlusPipeline(..., negative_prompt="", true_cfg_scale=4, output_type="latent")`` (the pipeline's
  text encoder given ``mm_token_type_ids``, as in test_edit.py). 1e-4.
"""
import pytest
import torch
from PIL import Image

from lowvram_lora.engine.families.qwen_image import FAMILY
from lowvram_lora.engine.families.qwen_image import edit_text as et
from lowvram_lora.engine.families.qwen_image.controls import control_embeds, encode_controls

AREAS = FAMILY.edit_areas("qwen-image-edit-tiny")
PROMPT = "make the red circle blue"


def _image(w, h, seed):
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy())


@pytest.fixture(scope="module")
def edit_cache(tmp_path_factory):
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.config import DataConfig, ModelConfig
    from lowvram_lora.engine.families.qwen_image.fixtures import (add_tiny_controls, build_tiny_pipeline,
                                                                  write_single_file, write_text_and_vae_files)
    from lowvram_lora.engine.testing import make_tiny_dataset

    tmp = tmp_path_factory.mktemp("edit")
    pipe = build_tiny_pipeline(tmp / "pipe")
    model_cfg = ModelConfig(transformer_path=str(write_single_file(pipe, tmp / "qwen_image_edit_2509_bf16.safetensors")),
                            text_encoder_files=(str(write_text_and_vae_files(pipe, tmp / "files")["text_encoder"]),),
                            vae_file=str(tmp / "files" / "qwen_image_vae.safetensors"), dtype="fp32")
    data = add_tiny_controls(make_tiny_dataset(tmp / "data", count=3))
    cache = build_dataset_cache(model_cfg, DataConfig(path=str(data), resolution=64), tmp / "cache", device="cpu",
                                sample_prompts=["invert it", "make it red"])
    return pipe, model_cfg, data, cache, tmp


def test_cached_prompt_and_control_latents_equal_the_reference(edit_cache):
    from diffusers import AutoencoderKLQwenImage
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from lowvram_lora.engine.families.qwen_image.fixtures import tiny_qwen2vl_processor

    pipe, _, _, cache, _ = edit_cache
    assert cache.variant == "qwen-image-edit-tiny" and len(cache.items) == 3
    te = Qwen2_5_VLForConditionalGeneration.from_pretrained(pipe / "text_encoder", use_safetensors=True,
                                                            torch_dtype=torch.float32, local_files_only=True)
    processor = tiny_qwen2vl_processor(AutoTokenizer.from_pretrained(pipe / "tokenizer", local_files_only=True))
    vae = AutoencoderKLQwenImage.from_pretrained(pipe / "vae", use_safetensors=True, torch_dtype=torch.float32,
                                                 local_files_only=True)
    for item in cache.items:
        controls = [Image.open(c).convert("RGB") for c in item.controls]
        assert len(controls) == 1 and item.caption.startswith("invert the colours")
        want_text = et.encode_with_model(te, processor, [item.caption], [controls], "plus",
                                         condition_area=AREAS["condition_area"])[0]
        want_lat = encode_controls(vae, controls, area=AREAS["vae_area"])[0]
        latent, embeds = cache.load_item(item)
        torch.testing.assert_close(embeds["prompt_embeds"], want_text, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(embeds["control_latents_0"], want_lat[0], atol=1e-5, rtol=1e-5)
        batch = cache.collate_text([embeds])
        assert batch["control_latents_0"].shape == (1, *want_lat.shape[1:]) and batch["prompt_embeds_mask"].all()
    # each sample prompt has its own negative: the empty instruction with that pair's control image
    negatives = cache.negative_keys()
    assert len(negatives) == 2 and len(set(negatives)) == 2
    neg = cache.load_text(negatives[1])
    controls = [Image.open(cache.items[1].controls[0]).convert("RGB")]
    torch.testing.assert_close(neg["prompt_embeds"][0], et.encode_with_model(
        te, processor, [""], [controls], "plus", condition_area=AREAS["condition_area"])[0], atol=1e-5, rtol=1e-5)


def test_rebuild_reuses_and_a_changed_control_rebuilds(edit_cache):
    """The control file's bytes are part of the key: the same inputs reuse every entry, an edited control image
    rebuilds that item's text entry only (its target latent is reused)."""
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.caching.cache import open_dataset_cache
    from lowvram_lora.engine.config import DataConfig

    _, model_cfg, data, cache, tmp = edit_cache
    again = build_dataset_cache(model_cfg, DataConfig(path=str(data), resolution=64), tmp / "cache", device="cpu",
                                sample_prompts=["invert it", "make it red"])
    assert again.stats["text_built"] == 0 and again.stats["latents_built"] == 0
    assert [i.text_key for i in again.items] == [i.text_key for i in cache.items]
    reopened = open_dataset_cache(again.manifest_path)
    assert reopened.negative_keys() == cache.negative_keys() and reopened.items[0].controls == cache.items[0].controls
    edited = tmp / "data2"
    import shutil

    shutil.copytree(data, edited)
    _image(60, 60, 9).save(edited / "control" / "img_001.png")
    changed = build_dataset_cache(model_cfg, DataConfig(path=str(edited), resolution=64), tmp / "cache",
                                  device="cpu")
    assert changed.stats["text_built"] == 1 and changed.stats["latents_built"] == 0
    assert changed.items[1].text_key != cache.items[1].text_key and changed.items[0].text_key == cache.items[0].text_key


def test_batches_group_by_control_sizes_and_mixed_shapes_are_refused(edit_cache):
    """Items whose control latents differ in shape never share a batch (CachedItem.batch_key); collating them anyway
    is a clear error."""
    from lowvram_lora.engine.errors import CacheError
    from lowvram_lora.engine.train.batching import bucket_batches

    _, _, _, cache, _ = edit_cache
    keys = {i.batch_key() for i in cache.items}
    assert len({(k[0], k[1]) for k in keys}) < len(keys)  # the controls split a bucket
    stream = bucket_batches(cache.items, 3, 0, lambda it: it.batch_key())
    for _ in range(6):
        batch = next(stream)
        assert len({i.batch_key() for i in batch}) == 1
        cache.collate_text([cache.load_item(i)[1] for i in batch])
    rows = [cache.load_item(i)[1] for i in cache.items]
    mixed = [r for r in rows if r["control_latents_0"].shape != rows[0]["control_latents_0"].shape][:1] + rows[:1]
    with pytest.raises(CacheError, match="different shapes.*batch_key"):
        cache.collate_text(mixed)


def test_edit_dataset_errors(edit_cache, tmp_path):
    """flip, too many sample prompts and a target without a control image are refused with what to do."""
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.config import DataConfig
    from lowvram_lora.engine.errors import ConfigError, DatasetError

    _, model_cfg, data, _, tmp = edit_cache
    with pytest.raises(ConfigError, match="flip"):
        build_dataset_cache(model_cfg, DataConfig(path=str(data), resolution=64, flip=True), tmp_path / "c")
    with pytest.raises(ConfigError, match="at most 3 lines"):
        build_dataset_cache(model_cfg, DataConfig(path=str(data), resolution=64), tmp_path / "c",
                            sample_prompts=["a", "b", "c", "d"])
    import shutil

    shutil.copytree(data, tmp_path / "d")
    (tmp_path / "d" / "control" / "img_000.png").unlink()
    with pytest.raises(DatasetError, match="img_000.png"):
        build_dataset_cache(model_cfg, DataConfig(path=str(tmp_path / "d"), resolution=64), tmp_path / "c")


def test_sample_latents_with_controls_equal_the_edit_plus_pipeline(monkeypatch):
    """Preview sampling (true CFG 4 against the empty instruction carrying the same control images) equals
    QwenImageEditPlusPipeline's latents from the same noise."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    from lowvram_lora.engine.families.patches import pack_2x2
    from lowvram_lora.engine.families.qwen_image.fixtures import tiny_edit_pipeline
    from lowvram_lora.engine.sampling import sample_latents

    pipe = tiny_edit_pipeline("plus")
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", AREAS["vae_area"])
    monkeypatch.setattr(plus, "CONDITION_IMAGE_SIZE", AREAS["condition_area"])
    seen = {}
    real_call = type(pipe.processor).__call__

    def processor_call(self, *a, **k):
        out = real_call(self, *a, **k)
        seen.update(out)
        return out

    monkeypatch.setattr(type(pipe.processor), "__call__", processor_call)
    te_forward = pipe.text_encoder.forward
    monkeypatch.setattr(pipe.text_encoder, "forward",
                        lambda *a, **k: te_forward(*a, **{**k, "mm_token_type_ids": seen["mm_token_type_ids"]}))
    images = [_image(80, 60, 1), _image(50, 70, 2)]
    width, height, steps, scale = 64, 48, 3, 4.0
    with torch.no_grad():
        want = pipe(image=images, prompt=PROMPT, negative_prompt="", num_inference_steps=steps, true_cfg_scale=scale,
                    width=width, height=height, output_type="latent",
                    generator=torch.Generator().manual_seed(5)).images
    drop = pipe.prompt_template_encode_start_idx
    kw = dict(drop=drop, condition_area=AREAS["condition_area"])
    controls = control_embeds(encode_controls(pipe.vae, images, area=AREAS["vae_area"]))
    pos = et.encode_with_model(pipe.text_encoder, pipe.processor, [PROMPT], [images], "plus", **kw)[0]
    neg = et.encode_with_model(pipe.text_encoder, pipe.processor, [""], [images], "plus", **kw)[0]
    noise = torch.randn((1, 16, height // 8, width // 8), generator=torch.Generator().manual_seed(5))
    got = sample_latents(pipe.transformer, FAMILY, {"prompt_embeds": pos[None], **controls}, width, height, steps, 0,
                         scale, torch.device("cpu"), torch.float32, rule=FAMILY.guidance("qwen-image-edit-2509"),
                         negative={"prompt_embeds": neg[None], **controls}, noise=noise)
    torch.testing.assert_close(pack_2x2(got), want, atol=1e-4, rtol=1e-4)
    # the controls matter: without them in the negative the result differs
    other = sample_latents(pipe.transformer, FAMILY, {"prompt_embeds": pos[None], **controls}, width, height, steps, 0,
                           scale, torch.device("cpu"), torch.float32, rule=FAMILY.guidance("qwen-image-edit-2509"),
                           negative={"prompt_embeds": neg[None]}, noise=noise)
    assert (other - got).abs().max() > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_edit_lora_caches_and_trains_on_cuda(tmp_path):
    """The Edit path on the GPU: the vision tower and the language model layer-major on cuda, control latents, a
    streamed training run with samples; the cached prompt equals the CPU cache's (bf16 tolerance) and the run ends
    with a finite loss."""
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.config import DataConfig, LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.families.qwen_image.fixtures import (add_tiny_controls, build_tiny_pipeline,
                                                                  write_single_file, write_text_and_vae_files)
    from lowvram_lora.engine.offload import OffloadConfig
    from lowvram_lora.engine.sampling import SamplingConfig
    from lowvram_lora.engine.testing import make_tiny_dataset
    from lowvram_lora.engine.train import train_lora

    pipe = build_tiny_pipeline(tmp_path / "pipe")
    model_cfg = ModelConfig(transformer_path=str(write_single_file(pipe, tmp_path / "qwen_image_edit_2509_bf16.safetensors")),
                            text_encoder_files=(str(write_text_and_vae_files(pipe, tmp_path / "files")["text_encoder"]),),
                            vae_file=str(tmp_path / "files" / "qwen_image_vae.safetensors"))
    data = add_tiny_controls(make_tiny_dataset(tmp_path / "data", count=2))
    gpu = build_dataset_cache(model_cfg, DataConfig(path=str(data), resolution=64), tmp_path / "gpu", device="cuda",
                              sample_prompts=["invert it"])
    cpu = build_dataset_cache(model_cfg, DataConfig(path=str(data), resolution=64), tmp_path / "cpu", device="cpu")
    a, b = gpu.load_text(gpu.items[0].text_key), cpu.load_text(cpu.items[0].text_key)
    for key in ("prompt_embeds", "control_latents_0"):
        assert ((a[key].float() - b[key].float()).norm() / b[key].float().norm()).item() < 0.03, key
    lora = train_lora(model_cfg, gpu, LoraSettings(rank=4, alpha=4), TrainConfig(steps=4, device="cuda"),
                      offload=OffloadConfig(mode="stream"),
                      sampling=SamplingConfig(every=4, steps=2, resolution=64, guidance=4.0))
    assert lora.steps == 4 and all(torch.isfinite(v).all() for v in lora.state_dict.values())
