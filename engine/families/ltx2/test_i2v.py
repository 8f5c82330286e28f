"""LTX-2 image-to-video (``i2v.py``) on the tiny model, against diffusers 0.42.1's ``LTX2ImageToVideoPipeline`` as the
reference: the first frame's latent, the training forward (per-token timesteps), the preview's sampled latents, the
T2V / I2V choice, and training through the shipped template. fp32; tolerances stated per test."""
import inspect
import sys
from pathlib import Path

import pytest
import torch

from lowvram_lora.engine.families import predict_velocity
from lowvram_lora.engine.families.ltx2 import FAMILY
from lowvram_lora.engine.families.ltx2.family import audio_noise, audio_shape, audio_tokens
from lowvram_lora.engine.families.ltx2.fixtures import build_tiny_pipeline, write_comfy_gemma, write_single_file
from lowvram_lora.engine.families.ltx2.i2v import LTX2_I2V, encode_first_frame
from lowvram_lora.engine.families.ltx2.vae import LTX2_VAE
from lowvram_lora.engine.families.specs import HELD_KEY, HELD_ON_KEY, held_weights

TINY = FAMILY.tiny_variant
SPEC = FAMILY.text_encoder_specs(TINY)[0]
CAPTIONS = ["a red circle", "ohwx, a big blue dog"]


@pytest.fixture(scope="module")
def pipeline_folder(tmp_path_factory):
    return build_tiny_pipeline(tmp_path_factory.mktemp("ltx2i2v") / "ltx2-tiny")


@pytest.fixture(scope="module")
def pipe(pipeline_folder):
    from diffusers import LTX2ImageToVideoPipeline

    return LTX2ImageToVideoPipeline.from_pretrained(pipeline_folder, use_safetensors=True)


@pytest.fixture(scope="module")
def text(pipeline_folder):
    """The cached rows of CAPTIONS and of the empty prompt (the negative)."""
    from lowvram_lora.engine.caching.encoders import encoder_kind

    kind = encoder_kind(SPEC.kind)
    rows = kind.encode(pipeline_folder, None, FAMILY, SPEC, CAPTIONS + [""], torch.device("cpu"), torch.float32,
                       SPEC.max_length)
    return torch.stack(rows[:-1]), rows[-1][None]


def test_first_frame_alone_is_the_clips_first_latent_frame(pipe):
    """The pipeline encodes the image alone; the cache does the same with each window's first frame. The released
    encoder's temporal structure (causal convolutions, the class defaults the tiny VAE keeps: ``encoder_causal``,
    ``patch_size_t`` 1, the downsampler types) makes the first latent frame read the first pixel frame only, so it is
    the clip latent's frame 0 (1e-5; measured <= 6e-7 at 9, 17 and 89 frames): the condition is the clip's own
    first latent frame."""
    from diffusers import AutoencoderKLLTX2Video

    defaults = inspect.signature(AutoencoderKLLTX2Video.__init__).parameters
    cfg = pipe.vae.config
    for key in ("encoder_causal", "patch_size_t", "downsample_type"):
        got = tuple(cfg[key]) if isinstance(cfg[key], (list, tuple)) else cfg[key]
        assert got == defaults[key].default, key
    assert cfg.encoder_causal and cfg.patch_size_t == 1
    clip = torch.rand(1, 3, 17, 64, 96, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        whole = LTX2_VAE.encode(pipe.vae, clip)
        alone = encode_first_frame(pipe.vae, clip)[HELD_KEY]
    assert whole.shape[2] == 3 and alone.shape == (1, whole.shape[1], 1, 2, 3)
    torch.testing.assert_close(alone, whole[:, :, :1], atol=1e-5, rtol=0)


def test_i2v_training_forward_equals_the_transformer_as_the_i2v_pipeline_calls_it(pipe, text):
    """With the held first frame in the batch, ``model_inputs`` gives the transformer the I2V pipeline's inputs: frame
    0's tokens replaced by the condition, the video timestep per token ``1000 sigma (1 - conditioning_mask)`` (0 on
    frame 0), the prompt AdaLN the scalar ``1000 sigma``; the audio at sigma 1 as in text-to-video training. Exact.
    The noisy frame 0 is never read."""
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(2, 8, 3, 2, 3, generator=g)  # 17 frames at 96x64
    held = torch.randn(2, 8, 1, 2, 3, generator=g)
    sigmas = torch.tensor([0.3, 0.85])
    rows, _ = text
    b, _, f, h, w = latents.shape
    mask = torch.zeros(b, 1, f, h, w)
    mask[:, :, 0] = 1.0
    with torch.no_grad():
        ours = predict_velocity(FAMILY, pipe.transformer, latents, {"prompt_embeds": rows, HELD_KEY: held}, sigmas, 0.)
        other = latents.clone()
        other[:, :, 0] = torch.randn(b, 8, h, w, generator=g)
        again = predict_velocity(FAMILY, pipe.transformer, other, {"prompt_embeds": rows, HELD_KEY: held}, sigmas, 0.)
        ref = _as_the_pipeline_calls_it(pipe, torch.cat([held, latents[:, :, 1:]], dim=2), mask, rows, sigmas)
        t2v = predict_velocity(FAMILY, pipe.transformer, latents, {"prompt_embeds": rows}, sigmas, 0.)
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)
    torch.testing.assert_close(again, ours, atol=0, rtol=0)
    assert (t2v[:, :, 1:] - ours[:, :, 1:]).abs().max() > 1e-4  # the condition reaches the other frames


def _as_the_pipeline_calls_it(pipe, inputs, mask, rows, sigmas):
    """The transformer's velocity (B, C, F', h, w) for video ``inputs`` (B, C, F', h, w) with the conditioning ``mask``
    (B, 1, F', h, w) as ``LTX2ImageToVideoPipeline`` calls it: packed tokens, the per-token timestep
    ``1000 sigma (1 - mask)``, the prompt AdaLN the scalar one; the audio at sigma 1, as training feeds it."""
    b, _, f, h, w = inputs.shape
    width = pipe.transformer.config.cross_attention_dim
    t = sigmas * 1000
    packed_mask = pipe._pack_latents(mask).squeeze(-1)  # the pipeline's packed conditioning_mask (B, F' h w)
    length = audio_tokens(f)
    ones = torch.ones(b, rows.shape[1])
    out = pipe.transformer(
        hidden_states=pipe._pack_latents(inputs),
        audio_hidden_states=audio_noise(sigmas, length, 8, "cpu", torch.float32),
        encoder_hidden_states=rows[..., :width], audio_encoder_hidden_states=rows[..., width:],
        timestep=t.unsqueeze(-1) * (1 - packed_mask), sigma=t, audio_timestep=torch.full((b,), 1000.0),
        audio_sigma=torch.full((b,), 1000.0), encoder_attention_mask=ones, audio_encoder_attention_mask=ones,
        num_frames=f, height=h, width=w, fps=24.0, audio_num_frames=length, use_cross_timestep=True,
        return_dict=False)[0]
    return pipe._unpack_latents(out, f, h, w)


def test_a_mixed_batch_holds_only_the_drawn_clips(pipe, text):
    """``first_frame_p`` < 1 (``HELD_ON_KEY``): the samples marked hold their first frame as the I2V pipeline does, the
    others are text-to-video samples (their noisy frame 0 at the scalar timestep), as Lightricks' trainer builds a
    batch under ``first_frame_conditioning_p`` (``torch.where(mask, latents, noisy)``, timestep ``t (1 - mask)``).
    Against the transformer called with those inputs: exact; each sample also equals its own unmixed forward (1e-5)."""
    g = torch.Generator().manual_seed(4)
    latents = torch.randn(2, 8, 3, 2, 3, generator=g)
    held = torch.randn(2, 8, 1, 2, 3, generator=g)
    sigmas = torch.tensor([0.4, 0.7])
    on = torch.tensor([1.0, 0.0])
    rows, _ = text
    b, _, f, h, w = latents.shape
    mask = torch.zeros(b, 1, f, h, w)
    mask[0, :, 0] = 1.0  # only the first sample's frame 0 is the condition
    inputs = torch.where(mask > 0, torch.cat([held, latents[:, :, 1:]], dim=2), latents)
    embeds = {"prompt_embeds": rows, HELD_KEY: held, HELD_ON_KEY: on}
    with torch.no_grad():
        ours = predict_velocity(FAMILY, pipe.transformer, latents, embeds, sigmas, 0.)
        ref = _as_the_pipeline_calls_it(pipe, inputs, mask, rows, sigmas)
        i2v = predict_velocity(FAMILY, pipe.transformer, latents, {"prompt_embeds": rows, HELD_KEY: held}, sigmas, 0.)
        t2v = predict_velocity(FAMILY, pipe.transformer, latents, {"prompt_embeds": rows}, sigmas, 0.)
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)
    torch.testing.assert_close(ours[0], i2v[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[1], t2v[1], atol=1e-5, rtol=1e-5)


def test_mixed_held_weights_are_lightricks_mask_over_its_batch_mean():
    """In a mixed batch only the marked samples leave their first frame out, and the loss is the masked mean divided
    by the mask's mean over the batch (Lightricks' ``compute_loss``), here as weights: equal to that formula (1e-6);
    every sample marked gives the unmixed weights; a masked-loss weight multiplies in."""
    from lowvram_lora.engine.train.flow_matching import weighted_mse

    g = torch.Generator().manual_seed(2)
    pred, target = torch.randn(3, 8, 3, 2, 3, generator=g), torch.randn(3, 8, 3, 2, 3, generator=g)
    held = torch.zeros(3, 8, 1, 2, 3)
    on = torch.tensor([1.0, 0.0, 1.0])
    w = held_weights({HELD_KEY: held, HELD_ON_KEY: on}, pred, None)
    mask = torch.ones(3, 1, 3, 2, 3)
    mask[0, :, 0] = mask[2, :, 0] = 0.0
    want = ((pred - target).square() * mask).mean() / mask.mean()
    torch.testing.assert_close(weighted_mse(pred, target, w), want, atol=1e-6, rtol=1e-6)
    every = held_weights({HELD_KEY: held, HELD_ON_KEY: torch.ones(3)}, pred, None)
    torch.testing.assert_close(every, held_weights({HELD_KEY: held}, pred, None))
    image_mask = torch.rand(3, 2, 3, generator=g)
    torch.testing.assert_close(held_weights({HELD_KEY: held, HELD_ON_KEY: on}, pred, image_mask),
                               w * image_mask[:, None])


def test_first_frame_p_draws_per_clip_after_the_noise(pipe, text):
    """The loop's batch with ``first_frame_p``: at 1 the loss is the unmixed I2V loss, at 0 the text-to-video loss of
    the same noise (exact: the draw comes after the noise); between, the marks are the batch generator's next
    uniforms below p, and the loss is the mixed forward's under Lightricks' mask. A model without a held first frame
    refuses p < 1 before loading."""
    import contextlib

    from lowvram_lora.engine.config import TrainConfig
    from lowvram_lora.engine.errors import ConfigError
    from lowvram_lora.engine.train.loop import _batch_jobs, _check_loss_options, _draw_noise
    from lowvram_lora.engine.train.loss_options import LossOptions
    from lowvram_lora.engine.train.flow_matching import noisy_latents_and_target, weighted_mse

    g = torch.Generator().manual_seed(6)
    latents = torch.randn(4, 8, 3, 2, 3, generator=g)
    held = latents[:, :, :1].clone()
    rows, _ = text
    rows = torch.cat([rows, rows])
    cfg = TrainConfig()

    def loss(embeds, p, seed=11):
        jobs = _batch_jobs(pipe.transformer, FAMILY, latents, embeds, cfg, torch.Generator().manual_seed(seed),
                           contextlib.nullcontext(), 1.0, 0, (0.0, 1.0), None, LossOptions(first_frame_p=p))
        with torch.no_grad():
            return jobs.piece_loss(jobs.pieces[0], contextlib.nullcontext())

    i2v, t2v = {"prompt_embeds": rows, HELD_KEY: held}, {"prompt_embeds": rows}
    torch.testing.assert_close(loss(i2v, 1.0), _unmixed(pipe, latents, i2v, cfg), atol=0, rtol=0)
    torch.testing.assert_close(loss(i2v, 0.0), loss(t2v, 1.0), atol=0, rtol=0)
    gen = torch.Generator().manual_seed(11)
    sigmas, noise, _ = _draw_noise(FAMILY, latents, cfg, gen, (0.0, 1.0), LossOptions(first_frame_p=0.5))
    on = (torch.rand(4, generator=gen) < 0.5).float()
    assert 0 < on.sum() < 4  # this seed mixes
    noisy, target = noisy_latents_and_target(latents, noise, sigmas)
    mixed = {**i2v, HELD_ON_KEY: on}
    with torch.no_grad():
        pred = predict_velocity(FAMILY, pipe.transformer, noisy, mixed, sigmas, cfg.guidance)
    want = weighted_mse(pred, target, held_weights(mixed, latents, None))
    torch.testing.assert_close(loss(i2v, 0.5), want, atol=0, rtol=0)
    for p in (float("nan"), 1.5, -0.1):
        with pytest.raises(ConfigError, match="first_frame_p"):
            LossOptions(first_frame_p=p)
    t2v_cache = type("Cache", (), {"family": "ltx2", "variant": TINY, "validation_items": [],
                                  "preservation_text_key": ""})()
    with pytest.raises(ConfigError, match="holds no first frame"):
        _check_loss_options(LossOptions(first_frame_p=0.5), t2v_cache)


def _unmixed(pipe, latents, embeds, cfg):
    """The batch's loss as the loop computed it before ``first_frame_p`` (no loss options)."""
    import contextlib

    from lowvram_lora.engine.train.loop import _batch_jobs

    jobs = _batch_jobs(pipe.transformer, FAMILY, latents, embeds, cfg, torch.Generator().manual_seed(11),
                       contextlib.nullcontext(), 1.0, 0, (0.0, 1.0), None, None)
    with torch.no_grad():
        return jobs.piece_loss(jobs.pieces[0], contextlib.nullcontext())


def test_held_frames_are_out_of_the_loss():
    """``held_weights``: 0 on the held frames, F' / (F' - 1) (times the mask's weight) on the rest, so the weighted
    mean is the mean over frames 1.. (Lightricks' ``div(loss_mask.mean())``); nothing held: unchanged; a one-frame
    clip with its frame held is refused."""
    from lowvram_lora.engine.train.flow_matching import weighted_mse

    g = torch.Generator().manual_seed(1)
    pred, target = torch.randn(2, 8, 3, 2, 3, generator=g), torch.randn(2, 8, 3, 2, 3, generator=g)
    held = {HELD_KEY: torch.zeros(2, 8, 1, 2, 3)}
    w = held_weights(held, pred, None)
    assert w.shape == (2, 3, 2, 3) and (w[:, 0] == 0).all() and (w[:, 1:] == 1.5).all()
    torch.testing.assert_close(weighted_mse(pred, target, w), (pred - target)[:, :, 1:].square().mean())
    mask = torch.full((2, 2, 3), 0.5)
    wm = held_weights(held, pred, mask)
    assert (wm[:, 0] == 0).all() and (wm[:, 1:] == 0.75).all()
    assert held_weights({}, pred, mask) is mask
    with pytest.raises(ValueError, match="nothing to predict"):
        held_weights(held, pred[:, :, :1], None)


def test_preview_equals_the_image_to_video_pipeline(pipe, text):
    """engine/sampling with the held first frame gives ``LTX2ImageToVideoPipeline``'s video latents from the same
    image, seed and audio noise (a 9-frame clip at 96x64, 4 steps, CFG 3 / audio 7 against the empty prompt; the
    pipeline without STG, modality isolation, rescale and with ``image_crf=0``: previews take a video frame, i2v.py
    says why): frame 0 is the image's latent, frames 1.. stepped. 1e-4 (the pipeline steps through x0)."""
    import numpy as np
    from PIL import Image

    from lowvram_lora.engine.sampling import sample_latents

    rule = FAMILY.guidance("ltx2.3-i2v")
    rows, neg = text
    steps, seed, width, height, frames = 4, 11, 96, 64, 9
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8))
    pixels = pipe.video_processor.preprocess(image, height=height, width=width)
    shape = (1, *FAMILY.latent_shape(pipe.transformer, width, height, frames))
    audio = torch.randn((1, *audio_shape(pipe.transformer, shape[1:])), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        held = LTX2_I2V.encode_latents(pipe.vae, pixels)[HELD_KEY]
        ours = sample_latents(pipe.transformer, FAMILY, {"prompt_embeds": rows[:1], HELD_KEY: held}, width, height,
                              steps, seed, rule.scale, torch.device("cpu"), torch.float32, rule=rule,
                              negative={"prompt_embeds": neg, HELD_KEY: held}, frames=frames)
        video, _ = pipe(image=image, image_crf=0, prompt=CAPTIONS[0], negative_prompt="", width=width, height=height,
                        num_frames=frames, num_inference_steps=steps, max_sequence_length=SPEC.max_length,
                        guidance_scale=rule.scale, audio_guidance_scale=rule.joint.scale, stg_scale=0.0,
                        audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0,
                        audio_guidance_rescale=0.0, spatio_temporal_guidance_blocks=None,
                        generator=torch.Generator().manual_seed(seed), audio_latents=audio, output_type="latent",
                        return_dict=False)
    assert ours.shape == video.shape
    torch.testing.assert_close(ours[:, :, :1], held, atol=0, rtol=0)
    torch.testing.assert_close(LTX2_VAE.to_vae(pipe.vae, ours), video, atol=1e-4, rtol=1e-4)


def test_the_choice_picks_the_image_to_video_twin():
    """Shapes match the text-to-video variant; ``image_to_video`` picks its twin on the same config; a model without
    one is refused by name."""
    from lowvram_lora.engine.caching.task_choice import image_to_video_variant
    from lowvram_lora.engine.errors import ConfigError
    from lowvram_lora.engine.families import get_family

    assert FAMILY.variant_for_config(FAMILY.load_config(TINY)) == TINY
    assert FAMILY.first_frame(TINY) is None and FAMILY.first_frame("ltx2-tiny-i2v") is LTX2_I2V
    assert [image_to_video_variant(FAMILY, v) for v in ("ltx2-tiny", "ltx2.3", "ltx2.5", "ltx2.3-i2v")] == \
        ["ltx2-tiny-i2v", "ltx2.3-i2v", "ltx2.5-i2v", "ltx2.3-i2v"]
    assert FAMILY.text_encoder_specs("ltx2.3-i2v") == FAMILY.text_encoder_specs("ltx2.3")
    wan = get_family("wan")
    assert image_to_video_variant(wan, "wan2.2-i2v-a14b-high-noise") == "wan2.2-i2v-a14b-high-noise"
    with pytest.raises(ConfigError, match="no image-to-video mode"):
        image_to_video_variant(wan, "wan2.1-t2v-14b")


def test_i2v_template_trains_the_tiny_model(tmp_path, capsys):
    """``ltx23_i2v_lora`` as shipped (sizes and steps reduced) through ``lowvram-lora run`` on the tiny model: the
    cache is built for the I2V twin with each window's held first frame (the clip latent's frame 0, 1e-5), the
    preview starts from the dataset's first frame, and the saved LoRA merged into diffusers' model lowers the flow
    loss of frames 1.. (frame 0 is the condition) at fixed noise on the cached clip, the first frame held. The text
    encoder is ComfyUI's Gemma file; the connectors and the VAE come from the all-in-one checkpoint."""
    import argparse

    from lowvram_lora.engine.caching.cache import open_dataset_cache
    from lowvram_lora.engine.lora_io import load_lora
    from lowvram_lora.engine.testing import make_tiny_video_dataset
    from lowvram_lora.engine.train.flow_matching import noisy_latents_and_target, sample_sigmas, weighted_mse
    from lowvram_lora.host.run_command import run_workflow_command
    from lowvram_lora.host.templates import WORKFLOWS_DIR
    from lowvram_lora.nodes import NODE_CLASS_MAPPINGS
    from lowvram_lora.nodes.paths import configure_standalone_dirs

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
    from helpers import merged

    root = tmp_path / "root"
    pipe = build_tiny_pipeline(tmp_path / "pipe", seed=5)
    write_single_file(pipe, root / "models" / "checkpoints" / "ltx-2.3-22b-dev-fp8.safetensors",
                      prefix="model.diffusion_model.", bundle=True)
    write_comfy_gemma(pipe, root / "models" / "text_encoders" / "gemma_3_12B_it.safetensors", dtype=torch.bfloat16)
    make_tiny_video_dataset(root / "input" / "my_clips", count=1, frames=9)
    overrides = ["1.precision=bf16", "2.resolution=64", "2.sample_prompts=ohwx, a red circle", "2.video_frames=9",
                 "4.steps=8", "4.learning_rate=0.01", "4.warmup_steps=0", "4.sample_every=8",
                 "4.sample_resolution=64", "4.sample_steps=2", "4.sample_frames=9"]
    args = argparse.Namespace(workflow=str(WORKFLOWS_DIR / "ltx23_i2v_lora.json"), models_dir=str(root / "models"),
                              output_dir=str(root / "output"), no_progress=True, traceback=True, overrides=overrides)
    code = run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "sampled 1 prompt(s) at step 8" in out
    saved = sorted((root / "output" / "loras").glob("ltx23_i2v_lora_*_.safetensors"))
    assert len(saved) == 1

    cache = open_dataset_cache(next((root / "output" / "lowvram_cache").rglob("datasets/*.json")))
    assert cache.variant == "ltx2-tiny-i2v"
    lat, emb = cache.load_item(cache.items[0])
    assert emb[HELD_KEY].shape == (lat.shape[0], 1, *lat.shape[2:])
    torch.testing.assert_close(emb[HELD_KEY], lat[:, :1], atol=1e-5, rtol=0)

    ref = FAMILY.transformer_class().from_pretrained(pipe / "transformer", use_safetensors=True)
    lora = load_lora(saved[0])

    def flow_loss(model):
        g = torch.Generator().manual_seed(123)
        x0 = lat[None].float()
        embeds = {k: v.float() for k, v in cache.collate_text([emb]).items()}
        total = 0.0
        with torch.no_grad():
            for _ in range(8):
                sigma = sample_sigmas(1, g)
                noisy, target = noisy_latents_and_target(x0, torch.randn(x0.shape, generator=g), sigma)
                pred = predict_velocity(FAMILY, model, noisy, embeds, sigma, 1.0)
                total += weighted_mse(pred, target, held_weights(embeds, x0, None)).item()
        return total / 8

    before, after = flow_loss(ref), flow_loss(merged(ref, lora.state_dict, 1.0))
    assert after < before, (before, after)
