"""Qwen-Image (engine/families/qwen_image/) on tiny models, against diffusers 0.42.1's own code as the reference:
text against QwenImagePipeline._get_qwen_prompt_embeds, the VAE against AutoencoderKLQwenImage as the pipeline and
the training script call it, the training forward against the pipeline's packing, sampling (true CFG, the
stretched dynamic schedule) against QwenImagePipeline's latents, the checkpoint reader against from_pretrained."""
import pytest
import torch
from helpers import check_checkpoint_forms
from safetensors.torch import load_file

from lowvram_lora.engine.families import family_for_single_file, get_family, predict_velocity
from lowvram_lora.engine.families.qwen_image import FAMILY
from lowvram_lora.engine.families.qwen_image.family import SYSTEM_PREFIX
from lowvram_lora.engine.families.qwen_image.fixtures import (build_tiny_pipeline, write_single_file,
                                                              write_text_and_vae_files)

TINY = FAMILY.tiny_variant
SPEC = FAMILY.text_encoder_specs(TINY)[0]
CAPTIONS = ["a red circle", "a photo of a big blue dog on the left with a small yellow square"]


@pytest.fixture(scope="module")
def pipeline_folder(tmp_path_factory):
    return build_tiny_pipeline(tmp_path_factory.mktemp("qwen") / "qwen-image-tiny")


@pytest.fixture(scope="module")
def pipe(pipeline_folder):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(pipeline_folder, use_safetensors=True)
    pipe.prompt_template_encode_start_idx = SPEC.drop_tokens  # the tiny tokenizer's count of the same prefix
    return pipe


def _reference_embeds(pipe, prompts):
    """The pipeline's (B, L, D) zero-padded embeddings and (B, L) mask."""
    with torch.no_grad():
        return pipe._get_qwen_prompt_embeds(list(prompts), device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture(scope="module")
def caption_embeds(pipe):
    return _reference_embeds(pipe, CAPTIONS)


def _batch(embeds, mask):
    return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}


# --- identity ----------------------------------------------------------------------------------------------


def test_registry_variants_and_detection(pipeline_folder, tmp_path):

    assert get_family("qwen_image") is FAMILY
    real = FAMILY.load_config("qwen-image")
    assert real["num_layers"] == 60 and real["joint_attention_dim"] == 3584 and real["axes_dims_rope"] == [16, 56, 56]
    assert FAMILY.variant_for_config(real) == "qwen-image"
    assert FAMILY.memory.hidden_size(real) == 3072
    single = write_single_file(pipeline_folder, tmp_path / "qwen_image_bf16.safetensors", prefix="model.diffusion_model.")
    assert family_for_single_file({k[len("model.diffusion_model."):] for k in load_file(str(single))}) is FAMILY
    # Edit files are identified (test_edit.py covers every name and the 2511 flag), no longer refused
    assert FAMILY.variant_from_name("qwen-image", "qwen_image_edit_2509_fp8_e4m3fn.safetensors") == "qwen-image-edit-2509"
    assert FAMILY.variant_from_name("qwen-image", "qwen_image_2512_bf16.safetensors") == "qwen-image"


def test_template_drop_counts_the_system_turn():
    """The tiny spec drops exactly the tokens its tokenizer makes of the system turn + "<|im_start|>user\\n", as
    the real spec's 34 are Qwen2's (checked with the real tokenizer in tests/comfyui when ComfyUI is present)."""
    from lowvram_lora.engine.families.qwen_image.fixtures import tiny_qwen25_tokenizer

    tokenizer, _ = tiny_qwen25_tokenizer()
    assert len(tokenizer(SYSTEM_PREFIX).input_ids) == SPEC.drop_tokens
    assert FAMILY.text_encoder_specs("qwen-image")[0].drop_tokens == 34


def test_engine_checkpoint_reads_every_form(pipeline_folder, tmp_path):
    """The file (bf16; with ComfyUI's full-checkpoint prefix; fp8 e4m3fn as qwen_image_fp8_e4m3fn is) and the
    diffusers folder load as diffusers' from_pretrained gives: bit for bit after the same cast, and fp8 within
    its rounding (relative 0.04 per tensor)."""
    check_checkpoint_forms(FAMILY, pipeline_folder, tmp_path, fp8_bound=0.04)


# --- text -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["folder", "single_file"])
def test_engine_text_encoding_matches_pipeline(pipeline_folder, pipe, caption_embeds, tmp_path, source):
    """encode_stacked (layer-major from the memory map, the final norm, the system turn dropped, each caption at its
    own length) equals QwenImagePipeline._get_qwen_prompt_embeds row for row; from the folder and from ComfyUI's
    single-file layout. Tolerance 1e-5 (fp32)."""
    from lowvram_lora.engine.caching.single_files import decoder_lm_source
    from lowvram_lora.engine.caching.stacked_text import encode_stacked

    ref, mask = caption_embeds
    src = None
    if source == "single_file":
        files = write_text_and_vae_files(pipeline_folder, tmp_path)
        src = decoder_lm_source(files["text_encoder"], FAMILY, SPEC)
    ours = encode_stacked(None if src else pipeline_folder, SPEC, list(CAPTIONS), torch.device("cpu"), torch.float32,
                          SPEC.max_length, source=src)
    lengths = mask.sum(dim=1).tolist()
    assert [o.shape[0] for o in ours] == lengths and lengths[0] != lengths[1]
    for o, e, n in zip(ours, ref, lengths):
        torch.testing.assert_close(o, e[:n], atol=1e-5, rtol=1e-5)


# --- VAE --------------------------------------------------------------------------------------------------------


def test_vae_single_file_encode_and_decode_match_diffusers(pipeline_folder, pipe, tmp_path):
    """ComfyUI's VAE file (original Wan names) loads through the checkpoint reader and diffusers' Wan converter
    into exactly the pipeline's VAE; encode = the training script's ``(mean - latents_mean) * (1/latents_std)`` on
    one frame, decode = QwenImagePipeline's un-normalise + decode + first frame. Tolerance 1e-5."""
    from lowvram_lora.engine.caching.single_files import load_vae_file

    files = write_text_and_vae_files(pipeline_folder, tmp_path)
    assert "encoder.conv1.weight" in load_file(str(files["vae"]))  # the original names, not diffusers'
    vae = load_vae_file(files["vae"], FAMILY, torch.float32)
    ref = pipe.vae
    assert sorted(vae.state_dict()) == sorted(ref.state_dict())
    assert all(torch.equal(vae.state_dict()[k], v) for k, v in ref.state_dict().items())
    image = torch.rand(1, 3, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        ours = FAMILY.vae_for(None).encode(vae, image)
        z = ref.encode(image[:, :, None]).latent_dist.mean
        mean = torch.tensor(ref.config.latents_mean).view(1, 16, 1, 1, 1)
        std = torch.tensor(ref.config.latents_std).view(1, 16, 1, 1, 1)
        want = ((z - mean) * (1.0 / std))[:, :, 0]
        assert ours.shape == (1, 16, 4, 6) == (1, *FAMILY.latent_shape(pipe.transformer, 48, 32))
        torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)
        pixels = FAMILY.vae_for(None).decode(vae, ours)
        lat = want[:, :, None] / (1.0 / std) + mean
        torch.testing.assert_close(pixels, ref.decode(lat, return_dict=False)[0][:, :, 0], atol=1e-5, rtol=1e-5)


# --- training forward -------------------------------------------------------------------------------------------


def test_training_forward_matches_the_pipelines_call(pipe, caption_embeds):
    """unpack(model(**model_inputs)) on a padded batch of two captions equals the transformer called as
    QwenImagePipeline calls it (its _pack_latents, timestep = sigma, img_shapes, the mask) then its
    _unpack_latents; the velocity needs no sign (the training target is noise - x0). Tolerance 1e-5."""
    from diffusers import QwenImagePipeline

    model = pipe.transformer
    embeds, mask = caption_embeds
    latents = torch.randn(2, 16, 8, 6, generator=torch.Generator().manual_seed(3))
    sigmas = torch.tensor([0.3, 0.85])
    with torch.no_grad():
        ours = predict_velocity(FAMILY, model, latents, _batch(embeds, mask), sigmas, 0.0)
        packed = QwenImagePipeline._pack_latents(latents, 2, 16, 8, 6)
        out = model(hidden_states=packed, timestep=sigmas, encoder_hidden_states=embeds,
                    encoder_hidden_states_mask=mask, img_shapes=[[(1, 4, 3)]] * 2, return_dict=False)[0]
        ref = QwenImagePipeline._unpack_latents(out, 64, 48, 8)[:, :, 0]
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert FAMILY.schedule.prediction.sign == 1.0 and FAMILY.schedule.prediction.timestep == "sigma"


def test_default_lora_targets_are_both_streams_attention_that_feeds_the_output(pipe):
    """Both streams' attention projections in every block, except the two of the last block whose output
    nothing reads: a loss on the model's output gives every kept target a gradient and the two left out none."""
    from peft import LoraConfig

    model = pipe.transformer
    ours = FAMILY.lora.target_modules(model)
    last = len(model.transformer_blocks) - 1
    dead = {f"transformer_blocks.{last}.attn.add_q_proj", f"transformer_blocks.{last}.attn.to_add_out"}
    attn = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".attn." in n}
    assert len(ours) == len(set(ours)) == 8 * len(model.transformer_blocks) - 2 and set(ours) == attn - dead
    import copy

    probe = copy.deepcopy(model).requires_grad_(False)
    probe.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=sorted(attn)))
    with torch.no_grad():  # B starts at zero, which would leave every A without a gradient
        for name, p in probe.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    latents = torch.randn(1, 16, 8, 6, generator=torch.Generator().manual_seed(1))
    embeds = {"prompt_embeds": torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(2))}
    predict_velocity(FAMILY, probe, latents, embeds, torch.tensor([0.5]), 0.0).square().mean().backward()
    modules = dict(probe.named_modules())
    grads = {t: modules[f"{t}.lora_A.default"].weight.grad for t in attn}
    assert all(grads[t] is not None and grads[t].abs().sum() > 0 for t in ours)
    assert all(grads[t] is None or grads[t].abs().sum() == 0 for t in dead)


# --- sampling ---------------------------------------------------------------------------------------------------


def test_sample_sigmas_equal_the_schedulers(pipe):
    """The stretched dynamic schedule equals FlowMatchEulerDiscreteScheduler's with the hub config, at 1024² and
    the tiny size, for a few step counts. Tolerance 1e-6."""
    import numpy as np

    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    sched = pipe.scheduler
    for h, w in ((128, 128), (8, 6)):
        latents = torch.zeros(1, 16, h, w)
        for steps in (2, 5, 20):
            mu = calculate_shift((h // 2) * (w // 2), sched.config.base_image_seq_len, sched.config.max_image_seq_len,
                                 sched.config.base_shift, sched.config.max_shift)
            sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
            np.testing.assert_allclose(FAMILY.schedule.sample_sigmas(latents, steps), sched.sigmas.numpy(), atol=1e-6)
    assert abs(FAMILY.schedule.sample_shift_mu(torch.zeros(1, 16, 128, 128), 20) - 0.6935) < 1e-3  # facts §2.3: e^mu = 2.00


def test_engine_sampling_with_true_cfg_matches_pipeline(pipe, caption_embeds):
    """engine/sampling.sample_latents under the family's guidance (true CFG 4 with the per-token renormalisation,
    the empty prompt as the negative) gives QwenImagePipeline's latents from the same noise. 3 steps, 1e-4."""
    from diffusers import QwenImagePipeline

    from lowvram_lora.engine.sampling import sample_latents

    steps, seed, width, height = 3, 11, 48, 64
    rule = FAMILY.guidance(TINY)
    embeds, mask = _reference_embeds(pipe, CAPTIONS[:1])
    neg, neg_mask = _reference_embeds(pipe, [""])
    noise = torch.randn((1, *FAMILY.latent_shape(pipe.transformer, width, height)),
                        generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    with torch.no_grad():
        ours = sample_latents(pipe.transformer, FAMILY, _batch(embeds, mask), width, height, steps, seed, rule.scale,
                              torch.device("cpu"), torch.float32, rule=rule, negative=_batch(neg, neg_mask))
        ref = pipe(prompt_embeds=embeds, prompt_embeds_mask=mask, negative_prompt_embeds=neg,
                   negative_prompt_embeds_mask=neg_mask, true_cfg_scale=rule.scale, num_inference_steps=steps,
                   latents=QwenImagePipeline._pack_latents(noise, 1, 16, height // 8, width // 8), height=height,
                   width=width, output_type="latent").images
    torch.testing.assert_close(FAMILY.unpack_prediction(ref, ours), ours, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # guidance matters here: without it the result is far off
        plain = sample_latents(pipe.transformer, FAMILY, _batch(embeds, mask), width, height, steps, seed, 0.0,
                               torch.device("cpu"), torch.float32, rule=rule, negative=_batch(neg, neg_mask))
    assert (plain - ours).abs().max() > 1e-3


@pytest.mark.skipif(not __import__("os").environ.get("LOWVRAM_COMFYUI_DIR"),
                    reason="needs ComfyUI's bundled Qwen2.5 tokenizer (set LOWVRAM_COMFYUI_DIR)")
def test_the_real_tokenizer_makes_34_template_tokens():
    """With Qwen2.5's real tokenizer (the one ComfyUI bundles, comfy/text_encoders/qwen25_tokenizer), the system
    turn + "<|im_start|>user\\n" is exactly the 34 tokens the spec drops, and the suffix is the 5 tokens that stay
    (facts §2.4: [151645, 198, 151644, 77091, 198])."""
    import os
    from pathlib import Path

    from transformers import AutoTokenizer

    from lowvram_lora.engine.families.qwen_image.family import SUFFIX

    folder = Path(os.environ["LOWVRAM_COMFYUI_DIR"]) / "comfy" / "text_encoders" / "qwen25_tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    prefix = tokenizer(SYSTEM_PREFIX).input_ids
    assert len(prefix) == FAMILY.text_encoder_specs("qwen-image")[0].drop_tokens == 34
    assert prefix[-5:] == [151645, 198, 151644, 872, 198]
    assert tokenizer(SUFFIX).input_ids == [151645, 198, 151644, 77091, 198]
