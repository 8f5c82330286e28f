"""Wan image-to-video (engine/families/wan/i2v.py) on tiny models, against diffusers 0.42.1's
WanImageToVideoPipeline as the reference: the variants and their boundary, the 20 condition channels
(prepare_latents), the CLIP states (encode_image), the training forward as the pipeline calls the transformer, the
dataset cache's per-window conditioning, and sampled latents from a dataset first frame (Wan 2.1 I2V with CLIP; the
Wan 2.2 I2V experts switching at 0.9)."""
import pytest
import torch

from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.families import meta_model, predict_velocity
from lowvram_lora.engine.families.wan import FAMILY
from lowvram_lora.engine.families.wan.fixtures import build_tiny_pipeline
from lowvram_lora.engine.families.wan.i2v import CONDITION_KEY, IMAGE_EMBEDS_KEY, encode_condition

I2V21, I2V22 = "wan-i2v-tiny", "wan2.2-i2v-tiny"
HIGH, LOW = "wan2.2-i2v-a14b-high-noise", "wan2.2-i2v-a14b-low-noise"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan-i2v")
    return {v: build_tiny_pipeline(root / v, variant=v) for v in (I2V21, I2V22)}


def _pipe(folder):
    from diffusers import WanImageToVideoPipeline

    return WanImageToVideoPipeline.from_pretrained(folder, use_safetensors=True)


def _embeds(pipe, prompts):
    """WanPipeline's umT5 encoding (the I2V pipeline's copy needs ftfy, which this environment lacks)."""
    from diffusers import WanPipeline

    with torch.no_grad():
        return WanPipeline._get_t5_prompt_embeds(pipe, list(prompts), max_sequence_length=FAMILY.text_encoder_specs(
            I2V21 if pipe.image_encoder is not None else I2V22)[0].max_length, device=torch.device("cpu"),
            dtype=torch.float32)


def _image(width, height, seed=0):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(height, width, 3, generator=g) * 255).to(torch.uint8).numpy())


def _pixels(image):
    """The PIL image as the pipeline's video_processor.preprocess gives it at its own size: (1, 3, H, W) in [-1, 1]."""
    import numpy as np

    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)[None]


def test_i2v_variants_are_detected_and_no_longer_refused():
    """36 input channels: Wan 2.1 I2V (image_dim 1280) or a Wan 2.2 I2V expert by its file name (boundary 0.9, not
    T2V's 0.875); a Wan 2.2 I2V file that does not say which expert is refused naming the fix. Parameters as the
    facts computed them (§1.1); native names k_img / v_img; the LoRA targets the image cross-attention only where it
    exists."""
    c21, c22 = FAMILY.load_config("wan2.1-i2v-14b"), FAMILY.load_config("wan2.2-i2v-a14b")
    assert FAMILY.variant_for_config(c21) == "wan2.1-i2v-14b" and FAMILY.variant_for_config(c22) == "wan2.2-i2v-a14b"
    assert sum(t.numel() for t in meta_model(FAMILY, c21).state_dict().values()) == 16_394_878_784
    assert sum(t.numel() for t in meta_model(FAMILY, c22).state_dict().values()) == 14_288_901_184
    for name, want in (("wan2.2_i2v_high_noise_14B_fp8_scaled.safetensors", HIGH),
                       ("wan2.2_i2v_low_noise_14B_fp16.safetensors", LOW)):
        assert FAMILY.variant_from_name("wan2.2-i2v-a14b", name) == want
    assert FAMILY.variant_from_name("wan2.1-i2v-14b", "wan2.1_i2v_480p_14B_fp16.safetensors") == "wan2.1-i2v-14b"
    with pytest.raises(ConfigError, match="high_noise"):
        FAMILY.variant_from_name("wan2.2-i2v-a14b", "my_i2v_model.safetensors")
    assert FAMILY.schedule.train_sigma_range(HIGH) == (0.9, 1.0) and FAMILY.schedule.train_sigma_range(LOW) == (0.0, 0.9)
    assert FAMILY.schedule.preview_partner(HIGH) == (LOW, 0.9)
    assert FAMILY.schedule.preview_partner("wan2.2-t2v-a14b-high-noise")[1] == 0.875
    assert FAMILY.first_frame("wan2.1-i2v-14b").image_encoder is not None and FAMILY.first_frame(HIGH).image_encoder is None
    assert FAMILY.first_frame("wan2.1-t2v-14b") is None
    native = {p.name for p in FAMILY.param_table(FAMILY.load_config(I2V21))}
    assert {"blocks.0.cross_attn.k_img.weight", "blocks.0.cross_attn.v_img.bias", "img_emb.proj.1.weight"} <= native
    m21, m22 = (meta_model(FAMILY, FAMILY.load_config(v)) for v in (I2V21, I2V22))
    t21, t22 = FAMILY.lora.target_modules(m21), FAMILY.lora.target_modules(m22)
    assert len(t21) == 10 * len(m21.blocks) and "blocks.1.attn2.add_k_proj" in t21
    assert len(t22) == 8 * len(m22.blocks) and not any("add_" in t for t in t22)


def test_condition_equals_the_pipelines(folders):
    """encode_condition of a 9-frame window = WanImageToVideoPipeline.prepare_latents' condition for its first frame
    (mask, then one VAE encode of [frame, zeros x 8]). 1e-5. It is not the first frame's latent padded with zeros."""
    pipe = _pipe(folders[I2V22])
    width, height, frames = 48, 32, 9
    image = _image(width, height)
    window = torch.rand(1, 3, frames, height, width, generator=torch.Generator().manual_seed(1)) * 2 - 1
    window[:, :, 0] = _pixels(image)[0]
    with torch.no_grad():
        ours = encode_condition(pipe.vae, window)[CONDITION_KEY]
        _, want = pipe.prepare_latents(pipe.video_processor.preprocess(image, height=height, width=width), 1, 16,
                                       height, width, frames, torch.float32, torch.device("cpu"))
    assert ours.shape == want.shape == (1, 20, 3, height // 8, width // 8)
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours[:, :4, 0], torch.ones_like(ours[:, :4, 0])) and ours[:, :4, 1:].abs().max() == 0
    padded = torch.zeros_like(ours[:, 4:])
    padded[:, :, :1] = FAMILY.vae_for(I2V22).encode(pipe.vae, window[:, :, :1])
    assert (padded[:, :, 1:] - ours[:, 4:, 1:]).abs().max() > 1e-2


def test_training_forward_matches_the_pipelines_call(folders):
    """predict_velocity(model_inputs) = the transformer called as WanImageToVideoPipeline calls it: the latents with
    the condition concatenated, timestep 1000 sigma, and for Wan 2.1 I2V the CLIP states as
    encoder_hidden_states_image. 1e-5. A missing condition is an error naming it."""
    for variant in (I2V21, I2V22):
        pipe = _pipe(folders[variant])
        model = pipe.transformer
        g = torch.Generator().manual_seed(3)
        latents = torch.randn(2, 16, 3, 4, 6, generator=g)
        embeds = {"prompt_embeds": _embeds(pipe, ["a red circle", "a blue dog"]),
                  CONDITION_KEY: torch.randn(2, 20, 3, 4, 6, generator=g)}
        image = None
        if variant == I2V21:
            with torch.no_grad():
                image = pipe.encode_image([_image(48, 32, 1), _image(48, 32, 2)], torch.device("cpu"))
            embeds[IMAGE_EMBEDS_KEY] = image
        sigmas = torch.tensor([0.3, 0.95])
        with torch.no_grad():
            ours = predict_velocity(FAMILY, model, latents, embeds, sigmas, 0.0)
            ref = model(hidden_states=torch.cat([latents, embeds[CONDITION_KEY]], 1), timestep=sigmas * 1000,
                        encoder_hidden_states=embeds["prompt_embeds"], encoder_hidden_states_image=image,
                        return_dict=False)[0]
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match=CONDITION_KEY):
            FAMILY.model_inputs(model, latents, {"prompt_embeds": embeds["prompt_embeds"]}, sigmas, 0.0)


@pytest.fixture(scope="module")
def i2v_cache(folders, tmp_path_factory):
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.config import DataConfig, ModelConfig
    from lowvram_lora.engine.data import VideoConfig
    from lowvram_lora.engine.testing import make_tiny_video_dataset

    pytest.importorskip("av")  # the clips are written with PyAV (the video extra)
    root = tmp_path_factory.mktemp("i2v-cache")
    data = make_tiny_video_dataset(root / "clips", count=2, frames=9, size=(64, 48))
    return build_dataset_cache(ModelConfig(transformer_path=str(folders[I2V21])),
                               DataConfig(path=str(data), resolution=64, bucket_step=16, flip=True), root / "cache",
                               video=VideoConfig(frame_counts=(5,)), sample_prompts=["a dog", "a cat"])


def test_the_cache_holds_each_windows_condition_and_clip_states(i2v_cache, folders):
    """Each clip window's latent entry holds its condition (= encode_condition of the window's pixels with the
    pipeline's VAE) and the CLIP states of its first frame (= WanImageToVideoPipeline.encode_image of that frame),
    the mirrored copies for a flipped item; load_item hands them to model_inputs with the text. 1e-5."""
    from lowvram_lora.engine.caching.entries import _pixels
    from lowvram_lora.engine.caching.image_encoder import frame_image

    pipe = _pipe(folders[I2V21])
    assert i2v_cache.items and all(len(i.frames) == 5 for i in i2v_cache.items)
    for item in i2v_cache.items:
        for flipped in (False, True):
            latent, embeds = i2v_cache.load_item(item, flipped)
            pixels = _pixels(item, flipped)
            with torch.no_grad():
                cond = encode_condition(pipe.vae, pixels[None])[CONDITION_KEY][0]
                clip = pipe.encode_image(frame_image(pixels), torch.device("cpu"))[0]
            assert embeds[CONDITION_KEY].shape == (20, *latent.shape[1:])
            torch.testing.assert_close(embeds[CONDITION_KEY], cond, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(embeds[IMAGE_EMBEDS_KEY], clip, atol=1e-5, rtol=1e-5)
            assert set(embeds) == {"prompt_embeds", CONDITION_KEY, IMAGE_EMBEDS_KEY}


class _EulerOver:
    def __new__(cls, sigmas):
        from diffusers import FlowMatchEulerDiscreteScheduler

        class Euler(FlowMatchEulerDiscreteScheduler):
            def set_timesteps(self, num_inference_steps=None, device=None, **kwargs):
                super().set_timesteps(sigmas=sigmas[:-1], device=device)

        return Euler(num_train_timesteps=1000, shift=1.0)


@pytest.mark.parametrize("variant", [I2V21, "experts"])
def test_previews_from_a_dataset_first_frame_equal_the_pipelines(folders, i2v_cache, variant):
    """A preview drawn from dataset item 0's first frame (preview_conditions: the frame at the preview size through
    the VAE, the cached CLIP states) under the family's CFG gives WanImageToVideoPipeline's latents for that frame
    from the same noise: Wan 2.1 I2V with CLIP; the Wan 2.2 I2V experts with the partner switching at 0.9 (4 steps:
    sigma 1 and 0.93 on the high-noise side). 1e-4."""
    from diffusers import WanImageToVideoPipeline

    from lowvram_lora.engine.caching.image_encoder import frame_image
    from lowvram_lora.engine.sampling import PartnerExpert, sample_latents
    from lowvram_lora.engine.sampling.first_frame import first_frame_pixels, preview_conditions
    from lowvram_lora.engine.families.tiny import randomize_zero_inits

    width, height, frames, steps, seed = 32, 32, 5, 4, 7
    item = i2v_cache.items[0]
    image = frame_image(first_frame_pixels(item, width, height, frames)[0])
    pipe = _pipe(folders[I2V21 if variant == I2V21 else I2V22])
    dataset = i2v_cache
    if variant != I2V21:  # the same dataset, read as a Wan 2.2 I2V expert's (no CLIP states)
        import dataclasses

        dataset = dataclasses.replace(i2v_cache, variant=HIGH)
    (cond,) = preview_conditions(dataset, FAMILY, pipe.vae, width, height, frames, torch.device("cpu"),
                                 torch.float32, 1)
    embeds, neg = _embeds(pipe, ["a dog"]), _embeds(pipe, [""])
    noise = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(seed))
    sigmas = FAMILY.schedule.sample_sigmas(noise, steps)
    kwargs = dict(prompt_embeds=embeds, negative_prompt_embeds=neg, num_inference_steps=steps, latents=noise.clone(),
                  height=height, width=width, num_frames=frames, output_type="latent")
    if variant == I2V21:
        rule, model, partner = FAMILY.guidance(I2V21), pipe.transformer, None
        pipe.scheduler = _EulerOver(sigmas)
        cached = i2v_cache.load_item(item)[1][IMAGE_EMBEDS_KEY][None]
        torch.testing.assert_close(cond[IMAGE_EMBEDS_KEY], cached)
        # The preview's CLIP states are the window's cached ones (the pipeline takes either image or image_embeds,
        # not both: its encode_image gives them here).
        pipe.encode_image = lambda image, device=None: cached
        with torch.no_grad():
            ref = pipe(image=image, guidance_scale=rule.scale, **kwargs).frames
    else:
        assert set(cond) == {CONDITION_KEY}
        rule = FAMILY.guidance(HIGH)
        torch.manual_seed(9)
        low = FAMILY.transformer_class().from_config(FAMILY.load_config(I2V22))
        randomize_zero_inits(low, 9)
        model, partner = pipe.transformer, PartnerExpert(low.eval(), 0.9, False, FAMILY.guidance(LOW).scale)
        assert [s >= 0.9 for s in sigmas[:-1]] == [True, True, False, False]
        two = WanImageToVideoPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
                                      scheduler=_EulerOver(sigmas), transformer=pipe.transformer,
                                      transformer_2=low.eval(), boundary_ratio=0.9)
        with torch.no_grad():
            ref = two(image=image, guidance_scale=rule.scale, guidance_scale_2=partner.guidance, **kwargs).frames
    negative = {"prompt_embeds": neg} | cond
    with torch.no_grad():
        ours = sample_latents(model, FAMILY, {"prompt_embeds": embeds} | cond, width, height, steps, seed, rule.scale,
                              torch.device("cpu"), torch.float32, rule=rule, negative=negative, frames=frames,
                              partner=partner)
    assert ours.shape == ref.shape == noise.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_i2v_trains_streamed_on_cuda_as_resident(folders, i2v_cache):
    """Wan 2.1 I2V on CUDA from its dataset cache (condition channels and CLIP states per window): three steps with
    the blocks streamed (activation offload on) give the resident run's losses (fp32, rel 1e-4)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.offload import OffloadConfig
    from lowvram_lora.engine.train import train_lora

    def losses(offload):
        lora = train_lora(ModelConfig(transformer_path=str(folders[I2V21]), dtype="fp32"), i2v_cache,
                          LoraSettings(rank=4, alpha=4), TrainConfig(steps=3, learning_rate=1e-3, device="cuda"),
                          offload=offload)
        assert any("add_k_proj" in k for k in lora.state_dict)
        return lora.loss_history

    want = losses(None)
    got = losses(OffloadConfig(mode="stream", activation_offload=True))
    assert len(got) == 3 and got == pytest.approx(want, rel=1e-4)


def test_the_sampler_conditions_each_prompt_on_a_dataset_first_frame(folders, i2v_cache, tmp_path):
    """Sampler.run on the Wan 2.1 I2V cache: each prompt and its negative carry prompt i's first-frame conditioning
    (preview_conditions of dataset item i), and a clip comes out; more prompt lines than windows is refused by name."""
    import dataclasses

    from lowvram_lora.engine.callbacks import TrainingCallback
    from lowvram_lora.engine.sampling import Sampler, SamplingConfig
    from lowvram_lora.engine.sampling.first_frame import preview_conditions

    model = _pipe(folders[I2V21]).transformer
    cfg = SamplingConfig(every=1, steps=2, resolution=64, frames=5, guidance=5.0)
    sampler = Sampler(cfg, i2v_cache, FAMILY, model, torch.device("cpu"), torch.float32, tmp_path, TrainingCallback())
    grid, path = sampler.run(0)
    assert path is not None and path.exists() and len(sampler.columns[0][1][0]) == 5
    want = preview_conditions(i2v_cache, FAMILY, sampler.vae(), 64, 64, 5, torch.device("cpu"), torch.float32, 2)
    for embeds, negative, cond in zip(sampler.embeds, sampler.negatives, want, strict=True):
        for rows in (embeds, negative):
            assert torch.equal(rows[CONDITION_KEY], cond[CONDITION_KEY])
            assert torch.equal(rows[IMAGE_EMBEDS_KEY], cond[IMAGE_EMBEDS_KEY])
    many = dataclasses.replace(i2v_cache, sample_prompts=[("p", i2v_cache.sample_prompts[0][1])] * (len(i2v_cache.items) + 1))
    with pytest.raises(ConfigError, match="first frame"):
        Sampler(cfg, many, FAMILY, model, torch.device("cpu"), torch.float32, tmp_path, TrainingCallback())


def test_comfyuis_clip_vision_file_is_found_among_the_text_encoders_and_loads_as_the_pipelines(folders, tmp_path):
    """clip_vision_h.safetensors (HF names, a visual_projection beside them) given with the umT5 file is told apart by
    its tensors (sources_for), loads into the pipeline's image encoder exactly, and its states equal
    WanImageToVideoPipeline.encode_image's. A Wan 2.1 I2V cache from single files without it names the file."""
    from lowvram_lora.engine.caching.image_encoder import encode_first_frames, load_image_encoder
    from lowvram_lora.engine.caching.single_files import sources_for
    from lowvram_lora.engine.errors import ModelLoadError
    from lowvram_lora.engine.families.wan.fixtures import write_clip_vision_file, write_text_and_vae_files

    folder = folders[I2V21]
    files = write_text_and_vae_files(folder, tmp_path)
    clip_file = write_clip_vision_file(folder, tmp_path / "clip_vision_h.safetensors")
    singles = sources_for(FAMILY, I2V21, [clip_file, files["text_encoder"]], files["vae"])
    assert singles.image_encoder == clip_file and list(singles.text_encoders.values()) == [files["text_encoder"]]
    spec = FAMILY.first_frame(I2V21).image_encoder
    model, processor = load_image_encoder(spec, torch.float32, file=clip_file)
    pipe = _pipe(folder)
    ref = pipe.image_encoder.state_dict()
    assert sorted(model.state_dict()) == sorted(ref) and all(torch.equal(model.state_dict()[k], v) for k, v in ref.items())
    image = _image(40, 24, 3)
    with torch.no_grad():
        (ours,) = encode_first_frames(model, processor, spec, [image], torch.device("cpu"), torch.float32)
        want = pipe.encode_image(image, torch.device("cpu"))[0]
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)
    from lowvram_lora.engine.caching.model_sources import CacheModels

    bare = CacheModels(FAMILY, I2V21, None, sources_for(FAMILY, I2V21, [files["text_encoder"]], files["vae"]),
                       torch.device("cpu"), torch.float32)
    with pytest.raises(ModelLoadError, match="clip_vision_h"):
        bare.image_encoder_files()


def test_a_text_to_video_cache_is_refused_by_an_i2v_model(i2v_cache):
    """A cache without first-frame conditioning (built for a T2V model) is refused before an I2V model loads, naming
    the fix; the I2V cache fits its own model."""
    import dataclasses

    i2v_cache.check_fits(FAMILY, FAMILY.load_config(I2V21))
    t2v = dataclasses.replace(i2v_cache, variant=FAMILY.tiny_variant)
    with pytest.raises(ConfigError, match="first-frame conditioning"):
        t2v.check_fits(FAMILY, FAMILY.load_config(I2V22))


def test_comfyuis_i2v_files_are_identified(folders, tmp_path):
    """ComfyUI-named native files (full-checkpoint prefix): the Wan 2.1 I2V layout (img_emb, k_img / v_img) and the
    Wan 2.2 I2V experts by their names, read back as from_pretrained gives them."""
    from lowvram_lora.engine.checkpoint import identify
    from lowvram_lora.engine.families.wan.fixtures import write_single_file
    from lowvram_lora.engine.models import load_transformer

    for variant, name, want in ((I2V21, "wan2.1_i2v_480p_14B_fp16.safetensors", I2V21),
                                (I2V22, "wan2.2_i2v_low_noise_14B_fp8_scaled.safetensors", "wan2.2-i2v-tiny-low-noise")):
        path = write_single_file(folders[variant], tmp_path / name, prefix="model.diffusion_model.")
        ident = identify(path, "auto")
        assert (ident.family.id, ident.variant) == ("wan", want)
        model = load_transformer(path, dtype=torch.float32)[0]
        ref = _pipe(folders[variant]).transformer.state_dict()
        assert all(torch.equal(model.state_dict()[k], v) for k, v in ref.items())
