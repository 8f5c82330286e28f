"""Wan (engine/families/wan/) on tiny models, against diffusers 0.42.1's own code as the reference: the name table
against convert_wan_transformer_to_diffusers, text against WanPipeline._get_t5_prompt_embeds, both VAEs against
AutoencoderKLWan as WanPipeline decodes, the sigmas against the hub's UniPC scheduler, sampling (CFG, 1 and 5
frames, TI2V's per-token timesteps) against WanPipeline's latents, the checkpoint reader against from_pretrained."""
import numpy as np
import pytest
import torch
from helpers import check_checkpoint_forms
from safetensors.torch import load_file

from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.families import family_for_single_file, get_family, predict_velocity
from lowvram_lora.engine.families.wan import FAMILY
from lowvram_lora.engine.families.wan.fixtures import (build_tiny_pipeline, write_single_file,
                                                       write_text_and_vae_files)

TINY, TI2V = FAMILY.tiny_variant, "wan2.2-ti2v-tiny"
SPEC = FAMILY.text_encoder_specs(TINY)[0]
CAPTIONS = ["a red circle", "a photo of a big blue dog on the left with a small yellow square"]


@pytest.fixture(scope="module")
def pipeline_folder(tmp_path_factory):
    return build_tiny_pipeline(tmp_path_factory.mktemp("wan") / "wan-tiny")


@pytest.fixture(scope="module")
def ti2v_folder(tmp_path_factory):
    return build_tiny_pipeline(tmp_path_factory.mktemp("wan22") / "wan-ti2v-tiny", variant=TI2V)


def _pipe(folder):
    from diffusers import WanPipeline

    return WanPipeline.from_pretrained(folder, use_safetensors=True)


@pytest.fixture(scope="module")
def pipe(pipeline_folder):
    return _pipe(pipeline_folder)


def _reference_embeds(pipe, prompts):
    with torch.no_grad():
        return pipe._get_t5_prompt_embeds(list(prompts), max_sequence_length=SPEC.max_length,
                                          device=torch.device("cpu"), dtype=torch.float32)


# --- identity ----------------------------------------------------------------------------------------------


def test_variants_detection_and_names(pipeline_folder, tmp_path):
    assert get_family("wan") is FAMILY
    c13, c14, c5 = (FAMILY.load_config(v) for v in ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.2-ti2v-5b"))
    assert (FAMILY.memory.hidden_size(c13), c13["num_layers"], c13["ffn_dim"]) == (1536, 30, 8960)
    assert (FAMILY.memory.hidden_size(c14), c14["num_layers"], c14["ffn_dim"]) == (5120, 40, 13824)
    assert (FAMILY.memory.hidden_size(c5), c5["in_channels"], c5["ffn_dim"]) == (3072, 48, 14336)
    n14 = sum(t.numel() for t in __import__("lowvram_lora.engine.families", fromlist=["x"]).meta_model(
        FAMILY, c14).state_dict().values())
    assert n14 == 14_288_491_584  # facts §3.2 (computed there; here from diffusers' own model)
    assert FAMILY.variant_for_config(c14) == "wan2.1-t2v-14b"
    for name, want in (("wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", "wan2.2-t2v-a14b-high-noise"),
                       ("wan2.2_t2v_low_noise_14B_fp16.safetensors", "wan2.2-t2v-a14b-low-noise"),
                       ("wan2.1_t2v_14B_bf16.safetensors", "wan2.1-t2v-14b")):
        assert FAMILY.variant_from_name("wan2.1-t2v-14b", name) == want
    assert FAMILY.variant_from_name("wan2.2-ti2v-5b", "wan2.2_ti2v_5B_fp16.safetensors") == "wan2.2-ti2v-5b"
    single = write_single_file(pipeline_folder, tmp_path / "w.safetensors", prefix="model.diffusion_model.")
    keys = {k[len("model.diffusion_model."):] for k in load_file(str(single))}
    assert {"blocks.0.self_attn.q.weight", "blocks.0.cross_attn.o.bias", "blocks.0.ffn.0.weight", "blocks.0.modulation",
            "head.head.weight", "head.modulation", "patch_embedding.weight", "text_embedding.0.weight",
            "time_embedding.2.weight", "time_projection.1.weight", "blocks.1.norm3.weight"} <= keys
    assert family_for_single_file(keys) is FAMILY


def test_name_table_is_diffusers_converter_inverted(pipeline_folder, tmp_path):
    """The file written from our table, through diffusers' own convert_wan_transformer_to_diffusers, gives the
    diffusers state dict: every key, exact tensors (also with ComfyUI's full-checkpoint prefix)."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    from lowvram_lora.engine.families.tiny import folder_state

    ref = folder_state(pipeline_folder / "transformer")
    for prefix in ("", "model.diffusion_model."):
        native = load_file(str(write_single_file(pipeline_folder, tmp_path / "n.safetensors", prefix=prefix)))
        got = convert_wan_transformer_to_diffusers(dict(native))
        assert sorted(got) == sorted(ref)
        assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_engine_checkpoint_reads_every_form(pipeline_folder, tmp_path):
    """Native file (bf16, prefixed) and the diffusers folder load as from_pretrained gives, bit for bit after the
    same cast; fp8 e4m3fn within its rounding."""
    check_checkpoint_forms(FAMILY, pipeline_folder, tmp_path, fp8_bound=1 / 16)  # e4m3's 3 mantissa bits


# --- text -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["folder", "single_file"])
def test_text_encoding_matches_pipeline(pipeline_folder, pipe, tmp_path, source):
    """encode_captions (umT5 with its attention mask, padding rows zeroed) equals WanPipeline._get_t5_prompt_embeds
    (trimmed to each caption's length, re-padded with zeros), from the folder and from the single file. 1e-5."""
    from lowvram_lora.engine.caching.single_files import load_text_encoder_file, text_encoder_kind
    from lowvram_lora.engine.caching.text_encoding import encode_captions

    ref = _reference_embeds(pipe, CAPTIONS)
    loader = None
    if source == "single_file":
        f = write_text_and_vae_files(pipeline_folder, tmp_path)["text_encoder"]
        assert text_encoder_kind(f) == "umt5xxl"
        loader = lambda: load_text_encoder_file(f, torch.float32, {})  # noqa: E731
    ours = encode_captions(None if loader else pipeline_folder, SPEC, list(CAPTIONS), torch.device("cpu"),
                           torch.float32, SPEC.max_length, loader=loader)
    for o, e in zip(ours, ref):
        assert o.shape == (SPEC.max_length, 32)
        torch.testing.assert_close(o, e, atol=1e-5, rtol=1e-5)
    n = int((ref[0].abs().sum(-1) > 0).sum())
    assert 0 < n < SPEC.max_length and ours[0][n:].abs().max() == 0  # real rows, then exact zeros


def test_t5_and_umt5_files_are_told_apart(tmp_path):
    """Same tensor names; umT5 has a relative-attention bias in every layer, T5 in the first only."""
    from transformers import T5Config, T5EncoderModel

    from lowvram_lora.engine.caching.single_files import text_encoder_kind
    from lowvram_lora.engine.families.tiny import save_tensors
    from lowvram_lora.engine.families.wan.fixtures import tiny_umt5

    t5 = T5EncoderModel(T5Config(vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4))
    def comfy_file(model, name):  # shared.weight only, as ComfyUI's files (embed_tokens is tied to it)
        return save_tensors({k: v.clone() for k, v in model.state_dict().items() if "embed_tokens" not in k},
                            tmp_path / name)

    a = comfy_file(t5, "t5xxl_fp16.safetensors")
    b = comfy_file(tiny_umt5(40, 32, 0), "umt5_xxl_fp16.safetensors")
    assert (text_encoder_kind(a), text_encoder_kind(b)) == ("t5xxl", "umt5xxl")


# --- VAE --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["wan2.1", "wan2.2"])
def test_vae_single_file_encode_and_decode_match_diffusers(pipeline_folder, ti2v_folder, tmp_path, which):
    """ComfyUI's VAE file (original Wan names; the 2.2 layout nests its resnets deeper) loads through the checkpoint
    reader into exactly the pipeline's VAE; encode = ``(mean - latents_mean) / latents_std`` of a 5-frame clip and
    of one image (a one-frame clip, the frame axis kept), decode = WanPipeline's un-normalise + decode. 1e-5."""
    from diffusers import AutoencoderKLWan

    from lowvram_lora.engine.caching.single_files import load_vae_file

    folder, variant = (pipeline_folder, TINY) if which == "wan2.1" else (ti2v_folder, TI2V)
    files = write_text_and_vae_files(folder, tmp_path)
    keys = set(load_file(str(files["vae"])))
    assert "encoder.conv1.weight" in keys
    if which == "wan2.2":  # ComfyUI's own test for the 2.2 VAE (comfy/sd.py)
        assert "decoder.upsamples.0.upsamples.0.residual.2.weight" in keys
    vae = load_vae_file(files["vae"], FAMILY, torch.float32, variant)
    ref = AutoencoderKLWan.from_pretrained(folder / "vae", use_safetensors=True)
    assert sorted(vae.state_dict()) == sorted(ref.state_dict())
    assert all(torch.equal(vae.state_dict()[k], v) for k, v in ref.state_dict().items())
    spec = FAMILY.vae_for(variant)
    z = ref.config.z_dim
    mean = torch.tensor(ref.config.latents_mean).view(1, z, 1, 1, 1)
    std = torch.tensor(ref.config.latents_std).view(1, z, 1, 1, 1)
    g = torch.Generator().manual_seed(0)
    model = FAMILY.transformer_class().from_config(FAMILY.load_config(variant))
    for pixels in (torch.rand(1, 3, 5, 32, 64, generator=g) * 2 - 1, torch.rand(1, 3, 32, 64, generator=g) * 2 - 1):
        frames = pixels.shape[2] if pixels.dim() == 5 else 1
        with torch.no_grad():
            ours = spec.encode(vae, pixels)
            want = (ref.encode(pixels if pixels.dim() == 5 else pixels[:, :, None]).latent_dist.mean - mean) / std
            assert ours.shape == want.shape == (1, *FAMILY.latent_shape(model, 64, 32, frames))
            torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)
            video = ref.decode(want / (1.0 / std) + mean, return_dict=False)[0]  # WanPipeline's decode
            torch.testing.assert_close(spec.decode(vae, ours), video, atol=1e-5, rtol=1e-5)


# --- training forward -------------------------------------------------------------------------------------------


def test_training_forward_matches_the_pipelines_call(pipe):
    """unpack(model(**model_inputs)) equals the transformer called as WanPipeline calls it (timestep 1000 sigma),
    for one frame and 5 frames; the velocity needs no sign. 1e-5."""
    model = pipe.transformer
    embeds = _reference_embeds(pipe, CAPTIONS)
    sigmas = torch.tensor([0.3, 0.85])
    for frames in (1, 5):
        latents = torch.randn(2, *FAMILY.latent_shape(model, 48, 32, frames), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            ours = predict_velocity(FAMILY, model, latents, {"prompt_embeds": embeds}, sigmas, 0.0)
            ref = model(hidden_states=latents, timestep=sigmas * 1000, encoder_hidden_states=embeds,
                        return_dict=False)[0]
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert FAMILY.schedule.prediction == type(FAMILY.schedule.prediction)(timestep="sigma_x1000", sign=1.0)
    with pytest.raises(ConfigError, match="4k"):
        FAMILY.latent_shape(model, 64, 64, 4)


def test_default_lora_targets_are_both_attentions(pipe):
    model = pipe.transformer
    ours = FAMILY.lora.target_modules(model)
    attn = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and (".attn1." in n or ".attn2." in n)}
    assert len(ours) == len(set(ours)) == 8 * len(model.blocks) and set(ours) == attn


# --- sampling ---------------------------------------------------------------------------------------------------


def test_sample_sigmas_equal_the_hub_scheduler(pipe, ti2v_folder):
    """The flow sigmas equal UniPCMultistepScheduler's with the hub config (flow_shift 3 T2V, 5 TI2V). 1e-6."""
    from diffusers import UniPCMultistepScheduler

    ti2v = UniPCMultistepScheduler.from_pretrained(ti2v_folder / "scheduler")
    for sched, channels in ((pipe.scheduler, 16), (ti2v, 48)):
        for steps in (1, 4, 20):
            sched.set_timesteps(steps)
            np.testing.assert_allclose(FAMILY.schedule.sample_sigmas(torch.zeros(1, channels, 1, 4, 4), steps),
                                       sched.sigmas.numpy(), atol=1e-6)
    assert (pipe.scheduler.config.flow_shift, ti2v.config.flow_shift) == (3.0, 5.0)


class _EulerOver:
    """WanPipeline's scheduler slot filled with FlowMatchEulerDiscreteScheduler stepping through given sigmas (the
    pipeline calls set_timesteps(steps) only): our sampler is Euler over the hub's sigmas, not UniPC's multistep."""

    def __new__(cls, sigmas):
        from diffusers import FlowMatchEulerDiscreteScheduler

        class Euler(FlowMatchEulerDiscreteScheduler):
            def set_timesteps(self, num_inference_steps=None, device=None, **kwargs):
                super().set_timesteps(sigmas=sigmas[:-1], device=device)

        return Euler(num_train_timesteps=1000, shift=1.0)


@pytest.mark.parametrize("frames", [1, 5])
@pytest.mark.parametrize("layout", ["t2v", "ti2v"])
def test_engine_sampling_with_cfg_matches_pipeline(pipe, ti2v_folder, frames, layout):
    """engine/sampling.sample_latents under the family's guidance (CFG, the empty prompt as the negative) gives
    WanPipeline's latents (output_type="latent") from the same noise, for one frame and a 5-frame clip; for the
    TI2V layout the pipeline's per-token timesteps (expand_timesteps) against our one timestep per sample. 1e-4."""
    from lowvram_lora.engine.sampling import sample_latents

    p = pipe if layout == "t2v" else _pipe(ti2v_folder)
    variant = TINY if layout == "t2v" else TI2V
    steps, seed, width, height = 3, 11, 64, 32
    rule = FAMILY.guidance(variant)
    embeds, neg = _reference_embeds(p, CAPTIONS[:1]), _reference_embeds(p, [""])
    shape = (1, *FAMILY.latent_shape(p.transformer, width, height, frames))
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    p.scheduler = _EulerOver(FAMILY.schedule.sample_sigmas(noise, steps))
    with torch.no_grad():
        ours = sample_latents(p.transformer, FAMILY, {"prompt_embeds": embeds}, width, height, steps, seed,
                              rule.scale, torch.device("cpu"), torch.float32, rule=rule,
                              negative={"prompt_embeds": neg}, frames=frames)
        ref = p(prompt_embeds=embeds, negative_prompt_embeds=neg, guidance_scale=rule.scale, num_inference_steps=steps,
                latents=noise.clone(), height=height, width=width, num_frames=frames, output_type="latent").frames
    assert ours.shape == ref.shape == shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # guidance matters here: without it the result is far off
        plain = sample_latents(p.transformer, FAMILY, {"prompt_embeds": embeds}, width, height, steps, seed, 0.0,
                               torch.device("cpu"), torch.float32, rule=rule, negative={"prompt_embeds": neg},
                               frames=frames)
    assert (plain - ours).abs().max() > 1e-3


def _tiny_expert(seed: int):
    """A second tiny transformer (other weights), standing in for the other A14B expert."""
    from lowvram_lora.engine.families.tiny import randomize_zero_inits

    torch.manual_seed(seed)
    model = FAMILY.transformer_class().from_config(FAMILY.load_config(TINY))
    randomize_zero_inits(model, seed)
    return model.eval()


@pytest.mark.parametrize("trained", ["high", "low"])
def test_a14b_previews_switch_expert_as_the_pipeline(pipe, trained):
    """An A14B expert's preview with its partner (PartnerExpert, from NoiseSchedule.preview_partner) gives the
    latents of WanPipeline(transformer=high, transformer_2=low, boundary_ratio=0.875, guidance_scale=4,
    guidance_scale_2=3) from the same noise, with the trained expert either one: 4 steps put sigma 1 and 0.9 on the
    high-noise side, 0.75 and 0.5 on the low-noise one. 1e-4 (fp32). Each expert matters: previews of one expert
    alone (the other replaced by it) are far off."""
    from diffusers import WanPipeline

    from lowvram_lora.engine.sampling import PartnerExpert, sample_latents

    high_v, low_v = "wan2.2-t2v-a14b-high-noise", "wan2.2-t2v-a14b-low-noise"
    assert FAMILY.schedule.preview_partner(high_v) == (low_v, 0.875) and FAMILY.schedule.preview_partner(low_v) == (high_v, 0.875)
    assert FAMILY.schedule.preview_partner(TINY) is None
    high, low = pipe.transformer, _tiny_expert(7)
    steps, seed, width, height, frames = 4, 5, 64, 32, 5
    embeds, neg = _reference_embeds(pipe, CAPTIONS[:1]), _reference_embeds(pipe, [""])
    shape = (1, *FAMILY.latent_shape(high, width, height, frames))
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    sigmas = FAMILY.schedule.sample_sigmas(noise, steps)
    assert [s >= 0.875 for s in sigmas[:-1]] == [True, True, False, False]
    g_high, g_low = FAMILY.guidance(high_v).scale, FAMILY.guidance(low_v).scale
    assert (g_high, g_low) == (4.0, 3.0)
    two = WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
                      scheduler=_EulerOver(sigmas), transformer=high, transformer_2=low, boundary_ratio=0.875)
    with torch.no_grad():
        ref = two(prompt_embeds=embeds, negative_prompt_embeds=neg, guidance_scale=g_high, guidance_scale_2=g_low,
                  num_inference_steps=steps, latents=noise.clone(), height=height, width=width, num_frames=frames,
                  output_type="latent").frames
    model, partner = (high, PartnerExpert(low, 0.875, False, g_low)) if trained == "high" else \
        (low, PartnerExpert(high, 0.875, True, g_high))
    rule = FAMILY.guidance(high_v if trained == "high" else low_v)

    def ours(model, partner):
        with torch.no_grad():
            return sample_latents(model, FAMILY, {"prompt_embeds": embeds}, width, height, steps, seed, rule.scale,
                                  torch.device("cpu"), torch.float32, rule=rule, negative={"prompt_embeds": neg},
                                  frames=frames, partner=partner)

    got = ours(model, partner)
    assert got.shape == ref.shape == shape
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    alone = ours(model, PartnerExpert(model, 0.875, partner.high, partner.guidance))
    assert (alone - ref).abs().max() > 1e-2


def test_the_planner_counts_each_variants_tokens():
    """One latent frame at 1280x704: 80 x 44 = 3520 tokens through the Wan 2.1 VAE (8x, 2x2 patches), a quarter
    of that (40 x 22) for TI2V-5B's 16x VAE; 49 frames are 13 latent frames."""

    assert FAMILY.memory.image_tokens(1280, 704, "wan2.1-t2v-1.3b") == (1280 // 16) * (704 // 16)
    assert FAMILY.memory.image_tokens(1280, 704, "wan2.2-ti2v-5b") == (1280 // 32) * (704 // 32) == 880
    assert FAMILY.memory.latent_frames(49) == 13 and FAMILY.memory.latent_frames(1) == 1 and FAMILY.memory.latent_frames(81) == 21


def test_sample_clip_decodes_as_the_pipeline_and_saves_every_frame(pipe, tmp_path):
    """A 5-frame sample clip (its latents are WanPipeline's: test_engine_sampling_with_cfg_matches_pipeline): decode_latents keeps all 5 frames and they are WanPipeline's decoded video (its
    output_type="np" from the same latents; 8-bit rounding: 1/255); the animated WebP the Sampler saves holds
    5 frames with exactly those pixels (lossless); the grid cell shows the first frame large and a strip below."""
    from lowvram_lora.engine.sampling import (PROMPT_BAND, STRIP, decode_latents, grid_image, load_clip, sample_latents,
                                              save_clip)

    steps, seed, width, height, frames = 2, 3, 64, 32, 5
    rule = FAMILY.guidance(TINY)
    embeds, neg = _reference_embeds(pipe, CAPTIONS[:1]), _reference_embeds(pipe, [""])
    with torch.no_grad():
        lat = sample_latents(pipe.transformer, FAMILY, {"prompt_embeds": embeds}, width, height, steps, seed,
                             rule.scale, torch.device("cpu"), torch.float32, rule=rule,
                             negative={"prompt_embeds": neg}, frames=frames)
    (clip,) = decode_latents(pipe.vae, FAMILY, [lat], torch.device("cpu"), TINY)
    assert isinstance(clip, list) and len(clip) == frames and clip[0].size == (width, height)
    with torch.no_grad():  # WanPipeline's own decode of these latents (un-normalise, decode, postprocess)
        mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1)
        video = pipe.vae.decode(lat * std + mean, return_dict=False)[0]
        want = pipe.video_processor.postprocess_video(video, output_type="np")[0]  # (F, H, W, 3) in [0, 1]
    ours = np.stack([np.asarray(f, dtype=np.float32) / 255 for f in clip])
    assert ours.shape == want.shape == (frames, height, width, 3)
    assert np.abs(ours - want).max() <= 1 / 255 + 1e-6

    path = tmp_path / "clip.webp"
    save_clip(clip, path, fps=16)
    from PIL import Image

    with Image.open(path) as img:
        assert img.format == "WEBP" and img.is_animated and img.n_frames == frames
        img.seek(1)
        img.load()  # Pillow reads a frame's duration when it decodes it
        assert img.info.get("duration") == round(1000 / 16)
    back = load_clip(path)
    assert len(back) == frames
    for a, b in zip(back, clip):
        assert np.array_equal(np.asarray(a), np.asarray(b))  # lossless

    cell = 64
    grid = grid_image([("step 0", [clip])], ["p"], cell=cell)
    assert grid.size == (cell, 18 + cell + cell // STRIP)
    band = cell - PROMPT_BAND  # the cell's prompt rides on a band along its bottom edge
    assert np.array_equal(np.asarray(grid)[18:18 + band], np.asarray(clip[0].resize((cell, cell)))[:band])
    strip = np.asarray(grid)[18 + cell:, : cell // STRIP]
    assert np.array_equal(strip, np.asarray(clip[1].resize((cell // STRIP, cell // STRIP))))


def test_an_a14b_expert_alone_is_not_previewed():
    """Sampling an expert alone would show noise or mush: preview_blocker says so for both experts (naming the
    range and why), and nothing for a whole model."""
    from lowvram_lora.engine.sampling import preview_blocker

    for variant in ("wan2.2-t2v-a14b-high-noise", "wan2.2-t2v-a14b-low-noise"):
        msg = preview_blocker(variant, FAMILY.schedule.train_sigma_range(variant), FAMILY.schedule.preview_partner(variant))
        assert msg and variant in msg and "both experts" in msg and "0.875" in msg
        assert "preview_partner" in msg and FAMILY.schedule.preview_partner(variant)[0] in msg  # the fix, named
    assert preview_blocker("wan2.1-t2v-1.3b", FAMILY.schedule.train_sigma_range("wan2.1-t2v-1.3b")) is None
