"""LTX-2 (engine/families/ltx2/) on tiny models, against diffusers 0.42.1's own code as the reference: the native names
against ``convert_ltx2_transformer_to_diffusers`` and ``from_pretrained``, the text cache against ``LTX2Pipeline``'s
``encode_prompt`` + ``connectors``, the training forward against the transformer called as the pipeline calls it,
the LoRA's targets and gradients (video only), the saved LoRA's ComfyUI names. fp32; tolerance exact unless said."""
import pytest
import torch
from safetensors.torch import load_file

from lowvram_lora.engine.families import predict_velocity
from lowvram_lora.engine.families.ltx2 import FAMILY
from lowvram_lora.engine.families.ltx2.family import VIDEO_TARGETS, audio_noise, audio_tokens
from lowvram_lora.engine.families.ltx2.fixtures import build_tiny_pipeline, write_comfy_gemma, write_single_file

TINY = FAMILY.tiny_variant
SPEC = FAMILY.text_encoder_specs(TINY)[0]
CAPTIONS = ["a red circle", "  ohwx, a photo of a big blue dog on the left with a small yellow square  "]


@pytest.fixture(scope="module")
def pipeline_folder(tmp_path_factory):
    return build_tiny_pipeline(tmp_path_factory.mktemp("ltx2") / "ltx2-tiny")


@pytest.fixture(scope="module")
def pipe(pipeline_folder):
    from diffusers import LTX2Pipeline

    return LTX2Pipeline.from_pretrained(pipeline_folder, use_safetensors=True)


@pytest.fixture(scope="module")
def cached(pipeline_folder):
    from lowvram_lora.engine.caching.encoders import encoder_kind

    kind = encoder_kind(SPEC.kind)
    return kind.encode(pipeline_folder, None, FAMILY, SPEC, list(CAPTIONS), torch.device("cpu"), torch.float32,
                       kind.caption_length(SPEC, 999))


def _reference_text(pipe, prompts):
    """The pipeline's Gemma stack and mask (left-padded), then its connectors: (video, audio, mask)."""
    with torch.no_grad():
        embeds, mask, _, _ = pipe.encode_prompt(list(prompts), do_classifier_free_guidance=False,
                                                max_sequence_length=SPEC.max_length, device="cpu")
        return pipe.connectors(embeds, mask, padding_side="left")


# --- files -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["bare", "all_in_one"])
def test_single_file_loads_as_the_folder(pipeline_folder, tmp_path, form):
    """The native file, bare or in ComfyUI's all-in-one layout (``model.diffusion_model.`` with the connectors, the
    text projection and the VAE beside the transformer), loads bit for bit as diffusers' ``from_pretrained``; the
    bundled models are ignored (``unused_native_keys``)."""
    from diffusers import LTX2VideoTransformer3DModel

    from lowvram_lora.engine.checkpoint import identify, open_checkpoint

    extra = dict(prefix="model.diffusion_model.", bundle=True) if form == "all_in_one" else {}
    path = write_single_file(pipeline_folder, tmp_path / "ltx-2.3-22b-dev.safetensors", **extra)
    keys = set(load_file(str(path)))
    assert form == "bare" or {"vae.per_channel_statistics.mean-of-means",
                              "model.diffusion_model.video_embeddings_connector.learnable_registers",
                              "text_embedding_projection.video_aggregate_embed.weight"} <= keys
    ident = identify(path)
    assert ident.family is FAMILY and ident.variant == TINY
    got = open_checkpoint(ident).load_model(torch.float32).state_dict()
    ref = LTX2VideoTransformer3DModel.from_pretrained(pipeline_folder / "transformer", use_safetensors=True).state_dict()
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_native_names_are_diffusers_converters(pipeline_folder, tmp_path):
    """diffusers' own ``convert_ltx2_transformer_to_diffusers`` maps the native file onto the diffusers state dict,
    every key and exact tensor, but LTX-2.3's prompt AdaLN: ComfyUI's ``prompt_adaln_single`` (which the converter,
    written for LTX-2.0, has no rule for) is diffusers' ``prompt_adaln``."""
    from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers

    from lowvram_lora.engine.families.tiny import folder_state

    native = load_file(str(write_single_file(pipeline_folder, tmp_path / "n.safetensors",
                                             prefix="model.diffusion_model.")))
    converted = convert_ltx2_transformer_to_diffusers(dict(native))
    ref = folder_state(pipeline_folder / "transformer")
    renamed = {k.replace("prompt_adaln_single.", "prompt_adaln."): v for k, v in converted.items()}
    assert renamed.keys() == ref.keys()
    assert all(torch.equal(renamed[k], ref[k]) for k in ref)
    assert {k for k in converted if k not in ref} == {k for k in converted if "prompt_adaln_single." in k} != set()


def test_full_size_variants_are_told_apart_by_shape():
    """LTX-2.3 and 2.5 have their own shapes (2.5: no video FFN biases, a keyframe embedding); the family's
    single-file test is ComfyUI's (``adaln_single`` + the audio-video flag)."""
    from lowvram_lora.engine.checkpoint import expected_single_file_shapes

    # One block of each (the 48 are alike): meta models of the full configs take seconds each.
    s23 = expected_single_file_shapes(FAMILY, {**FAMILY.load_config("ltx2.3"), "num_layers": 1})
    s25 = expected_single_file_shapes(FAMILY, {**FAMILY.load_config("ltx2.5"), "num_layers": 1})
    assert "transformer_blocks.0.ff.net.0.proj.bias" in s23 and "transformer_blocks.0.ff.net.0.proj.bias" not in s25
    assert "keyframes_abs_pos_embedding" in s25 and "keyframes_abs_pos_embedding" not in s23
    assert s23["transformer_blocks.0.attn1.to_gate_logits.weight"] == (32, 4096)
    assert FAMILY.looks_like_single_file(set(s23)) and FAMILY.looks_like_single_file(set(s25))
    assert FAMILY.variant_for_config(FAMILY.load_config("ltx2.5")) == "ltx2.5"


# --- text ------------------------------------------------------------------------------------------------


def test_cache_rows_equal_the_pipelines_connector_output(pipe, cached):
    """Each cached row is the connectors' video then audio output for the caption (1024 rows at full size, the
    tiny model's 32), as LTX2Pipeline computes it from Gemma's left-padded stack (ours: Gemma layer-major, the
    projection folded layer by layer: equal up to the order of the sums, 1e-5). The connectors' mask is all ones
    (registers fill the padding), so nothing else needs caching."""
    video, audio, mask = _reference_text(pipe, CAPTIONS)
    assert mask.bool().all()
    for row, v, a in zip(cached, video, audio):
        assert row.shape == (SPEC.max_length, v.shape[-1] + a.shape[-1])
        torch.testing.assert_close(row, torch.cat([v, a], dim=-1), atol=1e-5, rtol=1e-5)
    assert FAMILY.text_widths(dict(pipe.transformer.config)) == {"prompt_embeds": cached[0].shape[-1]}


# --- the forward -----------------------------------------------------------------------------------------


def _pipeline_call(pipe, latents, video, audio_text, sigmas, audio):
    """The transformer called as LTX2Pipeline calls it (its packing, timestep = sigma = 1000 sigma, fps 24,
    ``audio_num_frames`` from the clip's duration, ``use_cross_timestep``), the audio stream at sigma 1."""
    b, _, f, h, w = latents.shape
    t = sigmas * 1000
    ones = torch.ones(b, video.shape[1])
    out = pipe.transformer(hidden_states=pipe._pack_latents(latents), audio_hidden_states=audio,
                           encoder_hidden_states=video, audio_encoder_hidden_states=audio_text, timestep=t, sigma=t,
                           audio_timestep=torch.full((b,), 1000.0), audio_sigma=torch.full((b,), 1000.0),
                           encoder_attention_mask=ones, audio_encoder_attention_mask=ones, num_frames=f, height=h,
                           width=w, fps=24.0, audio_num_frames=round(((f - 1) * 8 + 1) / 24.0 * 25),
                           use_cross_timestep=True, return_dict=False)[0]
    return pipe._unpack_latents(out, f, h, w)


def test_training_forward_equals_the_transformer_as_the_pipeline_calls_it(pipe, cached):
    """``model_inputs`` on the cache's batch gives the video velocity the transformer gives the pipeline's inputs
    (exact); the audio stream is live: other audio noise changes the video's velocity."""
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(2, 8, 3, 2, 3, generator=g)  # 17 frames at 96x64
    sigmas = torch.tensor([0.3, 0.85])
    text = torch.stack(cached)
    width = pipe.transformer.config.cross_attention_dim
    video, audio_text = text[..., :width], text[..., width:]
    length = audio_tokens(3)
    assert length == round(17 / 24 * 25)
    noise = audio_noise(sigmas, length, 8, "cpu", torch.float32)
    with torch.no_grad():
        ours = predict_velocity(FAMILY, pipe.transformer, latents, {"prompt_embeds": text}, sigmas, 0.0)
        ref = _pipeline_call(pipe, latents, video, audio_text, sigmas, noise)
        other = _pipeline_call(pipe, latents, video, audio_text, sigmas, torch.randn(noise.shape, generator=g))
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)
    assert (other - ref).abs().max() > 1e-4
    assert not torch.equal(noise[0], noise[1])  # each sample's own draw


def test_frames_must_be_8k_plus_1(pipe):
    from lowvram_lora.engine.errors import ConfigError

    assert FAMILY.latent_shape(pipe.transformer, 960, 544, 89) == (8, 12, 17, 30)
    with pytest.raises(ConfigError, match="8k\\+1"):
        FAMILY.latent_shape(pipe.transformer, 64, 64, 33 + 4)


def test_video_lora_targets_and_gradients(pipeline_folder, cached):
    """The default LoRA sits on every block's video self-attention, text cross-attention and FFN (10 Linears); one
    flow-matching step gives each a gradient, and no audio or audio<->video module gets a LoRA."""
    from peft import LoraConfig

    model = FAMILY.transformer_class().from_pretrained(pipeline_folder / "transformer", use_safetensors=True)
    targets = FAMILY.lora.target_modules(model)
    assert len(targets) == len(VIDEO_TARGETS) * len(model.transformer_blocks)
    assert not any("audio" in t for t in targets)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=targets))
    g = torch.Generator().manual_seed(5)
    x0, noise = torch.randn(2, 8, 2, 2, 2, generator=g), torch.randn(2, 8, 2, 2, 2, generator=g)
    s = torch.tensor([0.2, 0.7])
    noisy = (1 - s.view(-1, 1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1, 1) * noise
    pred = predict_velocity(FAMILY, model, noisy, {"prompt_embeds": torch.stack(cached)}, s, 0.0)
    torch.nn.functional.mse_loss(pred, noise - x0).backward()
    modules = dict(model.named_modules())
    missing = [t for t in targets if modules[f"{t}.lora_B.default"].weight.grad is None
               or modules[f"{t}.lora_B.default"].weight.grad.abs().sum() == 0]
    assert not missing, missing[:3]
    assert not [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]


# --- LoRA files ------------------------------------------------------------------------------------------


def test_template_trains_the_tiny_model_and_saves_comfyuis_names(tmp_path, capsys):
    """``ltx23_lora`` as shipped (sizes and steps reduced) through ``lowvram-lora run`` on the tiny model under the
    template's names: the all-in-one checkpoint in models/checkpoints (an int8 slab is built from it; Cache Text Embeds
    reads the connectors and the VAE from the file the slab was built from), ComfyUI's Gemma file in
    models/text_encoders (the tiny one's tokenizer and config in its companion folder), 9-frame clips. The slab's forward is diffusers' (0.02); the saved LoRA carries
    ``diffusion_model.`` + the native block names (ComfyUI's LTXAV key map: ``diffusion_model.<key>`` and the bare
    key; a ``transformer.`` prefix is not mapped), one down / up / alpha per target, each a Linear of the native file;
    merged into diffusers' model it lowers the flow loss on the cached clip; the preview clip is saved beside it."""
    import argparse
    import sys
    from pathlib import Path

    from lowvram_lora.engine.caching.cache import open_dataset_cache
    from lowvram_lora.engine.lora_io import load_lora
    from lowvram_lora.engine.slab import load_slab_transformer
    from lowvram_lora.engine.testing import make_tiny_video_dataset
    from lowvram_lora.host.run_command import run_workflow_command
    from lowvram_lora.host.templates import WORKFLOWS_DIR
    from lowvram_lora.nodes import NODE_CLASS_MAPPINGS
    from lowvram_lora.nodes.paths import configure_standalone_dirs

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
    from helpers import eval_flow_loss, family_inputs, merged

    root = tmp_path / "root"
    pipe = build_tiny_pipeline(tmp_path / "pipe", seed=5)
    write_single_file(pipe, root / "models" / "checkpoints" / "ltx-2.3-22b-dev-fp8.safetensors",
                      prefix="model.diffusion_model.", bundle=True)
    write_comfy_gemma(pipe, root / "models" / "text_encoders" / "gemma_3_12B_it.safetensors", dtype=torch.bfloat16)
    make_tiny_video_dataset(root / "input" / "my_clips", count=1, frames=9)
    overrides = ["2.resolution=64", "2.sample_prompts=ohwx, a red circle", "2.video_frames=9", "4.steps=8",
                 "4.learning_rate=0.01", "4.warmup_steps=0", "4.sample_every=4", "4.sample_resolution=64",
                 "4.sample_steps=2", "4.sample_frames=9"]
    args = argparse.Namespace(workflow=str(WORKFLOWS_DIR / "ltx23_lora.json"), models_dir=str(root / "models"),
                              output_dir=str(root / "output"), no_progress=True, traceback=True, overrides=overrides)
    code = run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "sampled 1 prompt(s) at step 8" in out
    saved = sorted((root / "output" / "loras").glob("ltx23_lora_*_.safetensors"))
    assert len(saved) == 1 and saved[0].with_name(saved[0].stem + "_samples_p00.webp").exists()

    keys = set(load_file(str(saved[0])))
    modules = {k.rsplit(".", 2)[0] if ".lora_" in k else k.rsplit(".", 1)[0] for k in keys}
    native = set(load_file(str(write_single_file(pipe, tmp_path / "base.safetensors"))))
    assert len(keys) == 3 * len(modules) == 3 * len(VIDEO_TARGETS) * 2
    assert all(m.startswith("diffusion_model.transformer_blocks.") for m in modules)
    assert {m[len("diffusion_model."):] + ".weight" for m in modules} <= native

    ref = FAMILY.transformer_class().from_pretrained(pipe / "transformer", use_safetensors=True)
    slab = next((root / "models" / "slabs").glob("ltx-2.3-22b-dev-fp8-*.slab.safetensors"))
    latents, embeds, sigma = family_inputs(ref, FAMILY)
    with torch.no_grad():
        want = predict_velocity(FAMILY, ref, latents, embeds, sigma, 1.0)
        got = predict_velocity(FAMILY, load_slab_transformer(slab, torch.float32)[0], latents, embeds, sigma, 1.0)
    assert ((got - want).norm() / want.norm()).item() < 0.02
    lora = load_lora(saved[0])
    cache = open_dataset_cache(next((root / "output" / "lowvram_cache").rglob("datasets/*.json")))
    before, after = eval_flow_loss(ref, FAMILY, cache), eval_flow_loss(merged(ref, lora.state_dict, 1.0), FAMILY, cache)
    assert after < before, (before, after)


# --- previews --------------------------------------------------------------------------------------------


def test_engine_sampling_matches_the_pipeline(pipeline_folder, pipe, cached):
    """engine/sampling gives LTX2Pipeline's video latents from the same noise (a 9-frame clip at 96x64, 4 steps):
    CFG 3 on the video and 7 on the audio against the empty prompt, the audio stream denoised beside the video from
    the seed's noise (``Guidance.joint``), the token-dependent shift with the terminal stretch; the pipeline without
    STG, modality isolation and rescale (what previews leave out). 1e-4 (the pipeline steps through x0)."""
    from lowvram_lora.engine.caching.encoders import encoder_kind
    from lowvram_lora.engine.families.ltx2.family import audio_shape
    from lowvram_lora.engine.families.ltx2.vae import LTX2_VAE
    from lowvram_lora.engine.sampling import sample_latents

    rule = FAMILY.guidance("ltx2.3")
    steps, seed, width, height, frames = 4, 11, 96, 64, 9
    neg = encoder_kind(SPEC.kind).encode(pipeline_folder, None, FAMILY, SPEC, [""], torch.device("cpu"),
                                         torch.float32, SPEC.max_length)
    shape = (1, *FAMILY.latent_shape(pipe.transformer, width, height, frames))
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    audio = torch.randn((1, *audio_shape(pipe.transformer, shape[1:])), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours = sample_latents(pipe.transformer, FAMILY, {"prompt_embeds": cached[0][None]}, width, height, steps, seed,
                              rule.scale, torch.device("cpu"), torch.float32, rule=rule,
                              negative={"prompt_embeds": neg[0][None]}, noise=noise, frames=frames)
        video, _ = pipe(prompt=CAPTIONS[0], negative_prompt="", width=width, height=height, num_frames=frames,
                        num_inference_steps=steps, max_sequence_length=SPEC.max_length, guidance_scale=rule.scale, audio_guidance_scale=rule.joint.scale,
                        stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0,
                        guidance_rescale=0.0, audio_guidance_rescale=0.0, spatio_temporal_guidance_blocks=None,
                        latents=pipe._pack_latents(noise), audio_latents=audio, output_type="latent",
                        return_dict=False)
    assert pipe.audio_vae.latents_mean.abs().max() == 0 and (pipe.audio_vae.latents_std == 1).all()  # no renorm
    torch.testing.assert_close(LTX2_VAE.to_vae(pipe.vae, ours), video, atol=1e-4, rtol=1e-4)
    assert (ours - noise).abs().max() > 0.1


@pytest.mark.parametrize("name", ["ltx23_lora", "ltx23_i2v_lora"])
def test_full_size_template_without_its_files_names_them(tmp_path, name):
    """``ltx23_lora`` (and its image-to-video twin) with its files absent: refused before anything runs, naming the checkpoint (the first input
    the graph checks) and where it is looked up."""
    from lowvram_lora.host.templates import WORKFLOWS_DIR
    from lowvram_lora.host.workflow import WorkflowError, load_workflow, to_api_graph
    from lowvram_lora.nodes import NODE_CLASS_MAPPINGS
    from lowvram_lora.nodes.paths import configure_standalone_dirs

    configure_standalone_dirs(str(tmp_path / "empty"), str(tmp_path / "out"))
    with pytest.raises(WorkflowError) as e:
        to_api_graph(load_workflow(WORKFLOWS_DIR / f"{name}.json"), NODE_CLASS_MAPPINGS)
    assert "ltx-2.3-22b-dev-fp8.safetensors" in str(e.value) and "not available" in str(e.value), str(e.value)


def test_caching_ram_counts_one_gemma_layer_and_the_connectors(pipeline_folder):
    """The caching pass's RAM check counts Gemma one layer at a time (it runs layer-major) plus the connectors,
    which it holds whole."""
    from lowvram_lora.engine.caching.model_sources import CacheModels
    from lowvram_lora.engine.caching.ram import _elements, _files, caching_host_bytes

    models = CacheModels(family=FAMILY, variant=TINY, pipeline=pipeline_folder, singles=None,
                         device=torch.device("cpu"), dtype=torch.float32)
    parts = caching_host_bytes(models)
    text = next(v for k, v in parts.items() if k.startswith("text_encoder"))
    layer = _elements(_files(pipeline_folder / "text_encoder"), per_layer=True)
    connectors = _elements(_files(pipeline_folder / "connectors"), per_layer=False)
    assert text == 4 * (layer + connectors) and 0 < layer < _elements(_files(pipeline_folder / "text_encoder"), False)
