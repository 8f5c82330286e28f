"""Lumina 2 family (engine/families/lumina2): identity, single files, training forward, text, sampling.

Every number is checked against diffusers' own Lumina2Pipeline / Lumina2Transformer2DModel (0.42.1) on a
tiny random pipeline built offline (GQA transformer, 3-layer Gemma2Model, tiny Flux AE).

Engine paths used here that the redesign changes (tests marked "needs the lead's engine change" fail until
it lands, by design; nothing is skipped):
- (a) ``engine/checkpoint`` identify / open_checkpoint / load_model on native files. Real files carry the
  unused ``norm_final.weight``: the reader must drop ``family.unused_native_keys`` before matching variants.
- (c) ``engine/caching/stacked_text.encode_stacked`` for a ``variable`` spec with a plain prefix template,
  on Gemma2Model (its ``embed_tokens.embed_scale`` buffer must be rebuilt after the meta build).
- (d) ``engine/sampling.sample_latents`` honouring prediction, sample_shift_mu and CFG with renormalisation.
"""
import json

import pytest
import torch

from lowvram_lora.engine.families import family_fixtures, family_for_single_file, get_family
from lowvram_lora.engine.families.base import meta_model

FAMILY = get_family("lumina2")
CAPTIONS = ["a red circle", "a small blue square on a bright yellow background, centered"]


@pytest.fixture(scope="module")
def pipeline_folder(tmp_path_factory):
    return family_fixtures(FAMILY).build_tiny_pipeline(tmp_path_factory.mktemp("lumina2") / "pipe")


@pytest.fixture(scope="module")
def pipe(pipeline_folder):
    from diffusers import Lumina2Pipeline

    return Lumina2Pipeline.from_pretrained(pipeline_folder, use_safetensors=True)


# --- identity and names ------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["lumina2", "lumina2-tiny"])
def test_param_table_covers_the_diffusers_model_exactly(variant):
    config = FAMILY.load_config(variant)
    shapes = {k: tuple(v.shape) for k, v in meta_model(FAMILY, config).state_dict().items()}
    parts = [part for param in FAMILY.param_table(config) for part in param.parts]
    assert sorted(p.name for p in parts) == sorted(shapes)  # each diffusers tensor exactly once
    for part in parts:
        assert shapes[part.name][0] == part.rows, part
    assert FAMILY.variant_for_config(config) == variant


def test_real_config_is_lumina_image_2():
    config = FAMILY.load_config("lumina2")
    assert sum(p.numel() for p in meta_model(FAMILY, config).parameters()) == 2_609_769_152  # facts §4.2
    qkv = next(p for p in FAMILY.param_table(config) if p.name == "layers.0.attention.qkv.weight")
    assert [part.rows for part in qkv.parts] == [2304, 768, 768]  # GQA: q | k | v


def test_single_file_names_tell_lumina2_from_z_image(pipeline_folder, tmp_path):
    from safetensors import safe_open

    path = family_fixtures(FAMILY).write_single_file(pipeline_folder, tmp_path / "l2.safetensors")
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
    assert "norm_final.weight" in keys and FAMILY.looks_like_single_file(keys)
    assert family_for_single_file(keys) is FAMILY
    # Z-Image's NextDiT: modulation without the SiLU module (adaLN_modulation.0) and pad tokens.
    z_image = {k.replace("adaLN_modulation.1", "adaLN_modulation.0") for k in keys if not k.startswith("final_layer")}
    assert not FAMILY.looks_like_single_file(z_image | {"x_pad_token", "cap_pad_token"})
    assert not FAMILY.looks_like_single_file(keys | {"x_pad_token", "cap_pad_token"})


@pytest.mark.parametrize("prefix,norm_final", [("", True), ("model.diffusion_model.", True), ("", False)])
def test_native_single_file_loads_bit_for_bit(pipeline_folder, tmp_path, prefix, norm_final):
    """Needs the lead's engine change (engine/checkpoint on the family interface; unused_native_keys)."""
    from diffusers import Lumina2Transformer2DModel

    from lowvram_lora.engine.checkpoint import identify, open_checkpoint

    path = family_fixtures(FAMILY).write_single_file(pipeline_folder, tmp_path / "l2.safetensors", prefix=prefix,
                                               norm_final=norm_final)
    ident = identify(path)
    assert ident.kind == "single_file" and ident.family is FAMILY and ident.variant == FAMILY.tiny_variant
    model = open_checkpoint(path).load_model(torch.float32)
    reference = Lumina2Transformer2DModel.from_pretrained(pipeline_folder / "transformer", use_safetensors=True)
    got, expected = model.state_dict(), reference.state_dict()
    assert got.keys() == expected.keys()
    for k in expected:
        assert got[k].dtype == expected[k].dtype and torch.equal(got[k], expected[k]), k


def test_text_and_vae_files_hold_the_pipeline_weights(pipeline_folder, tmp_path):
    from safetensors.torch import load_file

    files = family_fixtures(FAMILY).write_text_and_vae_files(pipeline_folder, tmp_path)
    gemma = load_file(str(files["text_encoder"]))
    assert "model.embed_tokens.weight" in gemma and all(k.startswith("model.") for k in gemma)
    companion = files["text_encoder"].with_suffix("")
    assert json.loads((companion / "config.json").read_text())["model_type"] == "gemma2"
    assert (companion / "tokenizer.json").exists()
    assert "decoder.conv_in.weight" in load_file(str(files["vae"]))


# --- training forward --------------------------------------------------------------------------------


def _cached(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """What the text cache keeps of the pipeline's padded embeddings: each caption's valid rows."""
    return [e[m.bool()] for e, m in zip(embeds, mask)]


def _engine_batch(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """How the engine batches variable-length captions: zero-padded to the longest, with a mask (1 = real)."""
    length = max(r.shape[0] for r in rows)
    embeds = torch.zeros(len(rows), length, rows[0].shape[1])
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, r in enumerate(rows):
        embeds[i, : r.shape[0]], mask[i, : r.shape[0]] = r, 1
    return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}


@torch.no_grad()
def test_training_forward_equals_the_pipeline_prediction(pipe):
    """sign * unpack(model(**model_inputs)) is the velocity Lumina2Pipeline steps with: -transformer(latents,
    1 - t/1000, 256-padded embeds, mask), for two captions of different lengths in one batch (1e-5)."""
    embeds, mask, _, _ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False, device="cpu")
    lengths = mask.sum(dim=1).tolist()
    assert lengths[0] != lengths[1] and embeds.shape[1] == 256
    model = pipe.transformer
    latents = torch.randn(2, 16, 8, 6, generator=torch.Generator().manual_seed(3))
    sigmas = torch.tensor([0.3, 0.85])
    timestep = 1 - (sigmas * 1000) / pipe.scheduler.config.num_train_timesteps  # as the pipeline computes it
    reference = -model(hidden_states=latents, timestep=timestep, encoder_hidden_states=embeds,
                       encoder_attention_mask=mask, return_dict=False)[0]
    inputs = FAMILY.model_inputs(model, latents, _engine_batch(_cached(embeds, mask)), sigmas, 0.0)
    got = FAMILY.schedule.prediction.sign * FAMILY.unpack_prediction(model(**inputs)[0], latents)
    assert got.shape == latents.shape and got.shape[1:] == FAMILY.latent_shape(model, 48, 64)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
    # Each caption alone gives the same rows (padding in the batch changes nothing).
    for i in range(2):
        alone = FAMILY.model_inputs(model, latents[i:i + 1], _engine_batch(_cached(embeds, mask)[i:i + 1]),
                                    sigmas[i:i + 1], 0.0)
        torch.testing.assert_close(-model(**alone)[0][0], reference[i], rtol=1e-5, atol=1e-5)


def test_latent_shape_and_shifts():
    model = meta_model(FAMILY, FAMILY.load_config("lumina2"))
    assert FAMILY.latent_shape(model, 1024, 768) == (16, 96, 128)
    assert FAMILY.memory.image_tokens(1024, 1024) == 4096
    lat = torch.zeros(1, 16, 128, 128)
    assert FAMILY.schedule.train_shift_mu(lat) == pytest.approx(1.15)  # 4096 tokens: Flux's max_shift
    assert FAMILY.schedule.train_shift_mu(torch.zeros(1, 16, 32, 32)) == pytest.approx(0.5)  # 256 tokens
    assert torch.exp(torch.tensor(FAMILY.schedule.sample_shift_mu(lat, 25))).item() == pytest.approx(6.0)
    g = FAMILY.guidance("lumina2")
    assert (g.mode, g.scale, g.formula, g.renormalize) == ("cfg", 4.0, "standard", "last_axis")


def test_guidance_combine_is_the_pipelines():
    """Guidance.combine with Lumina's settings equals Lumina2Pipeline's CFG + cfg_normalization lines."""
    gen = torch.Generator().manual_seed(4)
    cond, uncond = torch.randn(2, 16, 8, 8, generator=gen), torch.randn(2, 16, 8, 8, generator=gen)
    pred = uncond + 4.0 * (cond - uncond)
    pred = pred * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(pred, dim=-1, keepdim=True))
    torch.testing.assert_close(FAMILY.guidance("lumina2").combine(cond, uncond, 4.0), pred, rtol=0, atol=0)


# --- text --------------------------------------------------------------------------------------------


def test_text_spec_matches_the_pipeline(pipe):
    (spec,) = FAMILY.text_encoder_specs("lumina2")
    ids, _ = spec.template.tokenize(pipe.tokenizer, ["a red circle"], 64, pad_to_max=False)
    ref = pipe.tokenizer([pipe.system_prompt + " <Prompt Start> a red circle"], return_tensors="pt").input_ids
    assert torch.equal(ids, ref)
    assert spec.hidden_layers == (25,) and spec.length == "variable" and spec.max_length == 256
    (tiny,) = FAMILY.text_encoder_specs(FAMILY.tiny_variant)
    assert tiny.hidden_layers == (pipe.text_encoder.config.num_hidden_layers - 1,)
    assert FAMILY.text_widths(dict(pipe.transformer.config)) == {"prompt_embeds": pipe.text_encoder.config.hidden_size}
    # The real encoder's config ships in the folder (configs/text/gemma2-2b.json) and builds a Gemma2Model.
    from transformers import AutoConfig

    import json

    from lowvram_lora.engine.families import text_architecture_config

    gemma = json.loads(text_architecture_config(FAMILY, spec.architecture).read_text())
    assert (gemma["num_hidden_layers"], gemma["hidden_size"]) == (26, FAMILY.load_config("lumina2")["cap_feat_dim"])
    assert type(AutoConfig.for_model(**gemma)).__name__ == "Gemma2Config"
    # The negative prompt is encoded without the system prompt (Lumina2Pipeline.encode_prompt).
    neg, _ = spec.negative_template.tokenize(pipe.tokenizer, [""], 64, pad_to_max=False)
    assert torch.equal(neg, pipe.tokenizer([""], return_tensors="pt").input_ids)


@torch.no_grad()
def test_layer_major_text_equals_the_pipeline(pipeline_folder, pipe):
    """Layer-major Gemma-2 (truncated to the layers needed, read from the file) equals the pipeline's
    encode_prompt at each caption's real tokens."""
    from lowvram_lora.engine.caching.stacked_text import encode_stacked

    (spec,) = FAMILY.text_encoder_specs(FAMILY.tiny_variant)
    got = encode_stacked(pipeline_folder, spec, CAPTIONS, torch.device("cpu"), torch.float32, spec.max_length)
    embeds, mask, _, _ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False, device="cpu",
                                            max_sequence_length=spec.max_length)
    for rows, expected in zip(got, _cached(embeds, mask)):
        assert rows.shape == expected.shape
        torch.testing.assert_close(rows, expected, rtol=1e-5, atol=1e-5)


# --- sampling ----------------------------------------------------------------------------------------


@torch.no_grad()
def test_sampling_equals_the_pipeline(pipe):
    """The engine's sampler under the family's guidance rule (CFG 4 against the empty prompt, which
    Lumina2Pipeline encodes WITHOUT the system prompt, renormalised) equals the pipeline's latents."""
    from lowvram_lora.engine.sampling import sample_latents

    steps, width, height, seed = 4, 64, 48, 7
    pos, pos_mask, neg, neg_mask = pipe.encode_prompt(CAPTIONS[0], do_classifier_free_guidance=True, device="cpu")
    positive = _engine_batch(_cached(pos, pos_mask))
    negative = _engine_batch(_cached(neg, neg_mask))
    got = sample_latents(pipe.transformer, FAMILY, positive, width, height, steps, seed, 4.0, torch.device("cpu"),
                         torch.float32, rule=FAMILY.guidance(FAMILY.tiny_variant), negative=negative)
    noise = torch.randn((1, *FAMILY.latent_shape(pipe.transformer, width, height)),
                        generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    expected = pipe(prompt=CAPTIONS[0], width=width, height=height, num_inference_steps=steps, guidance_scale=4.0,
                    latents=noise, cfg_trunc_ratio=1.0, cfg_normalization=True, output_type="latent").images
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
