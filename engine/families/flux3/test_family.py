"""FLUX.3 Image Klein (engine/families/flux3/) on tiny models, against diffusers 0.42.1's own code as the reference: the
native names against ``convert_flux3_transformer_checkpoint_to_diffusers``, the text cache against
``Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds`` (its 80-token windows, padding kept at position 1), the training
forward against the transformer called as the modular pipeline calls it, previews (Base: CFG 3.5 under the static
shift 6.93; the flow map: target sigmas, no guidance) against ``Flux3CoreDenoiseStep`` /
``Flux3DistilledCoreDenoiseStep``, a saved LoRA through diffusers' ``Flux3LoraLoaderMixin``. fp32; tolerance 1e-5
unless said."""
import types

import pytest
import torch
from helpers import check_checkpoint_forms
from safetensors.torch import load_file, save_file

from lowvram_lora.engine.families import family_for_single_file, get_family, predict_velocity
from lowvram_lora.engine.families.flux3 import FAMILY
from lowvram_lora.engine.families.flux3.family import image_ids, text_ids
from lowvram_lora.engine.families.flux3.fixtures import (build_tiny_pipeline, write_single_file,
                                                         write_text_and_vae_files)

TINY = FAMILY.tiny_variant
SPEC = FAMILY.text_encoder_specs(TINY)[0]
#: Two captions in the first 80-token window and one in the second (its template + 77 words).
CAPTIONS = ["a red circle", "a photo of a big blue dog on the left with a small yellow square",
            " ".join(["a big red dog and a small blue cat"] * 10)]


@pytest.fixture(scope="module")
def pipeline_folder(tmp_path_factory):
    return build_tiny_pipeline(tmp_path_factory.mktemp("flux3") / "flux3-tiny")


@pytest.fixture(scope="module")
def distilled_folder(tmp_path_factory):
    return build_tiny_pipeline(tmp_path_factory.mktemp("flux3d") / "flux3-tiny-distilled",
                               variant="flux3-tiny-distilled")


@pytest.fixture(scope="module")
def encoder(pipeline_folder):
    """The pipeline's text encoder and its tokenizer as ``Flux3TextEncoderStep`` uses them (an AutoProcessor: the
    chat template and ``.tokenizer``)."""
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(pipeline_folder / "tokenizer")
    model = Qwen3VLForConditionalGeneration.from_pretrained(pipeline_folder / "text_encoder", use_safetensors=True)
    return model.eval(), types.SimpleNamespace(apply_chat_template=tok.apply_chat_template, tokenizer=tok)


def _reference(encoder, prompt):
    """``Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds`` (1, L_window, K * D) with the tiny taps."""
    from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

    with torch.no_grad():
        return Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds(encoder[0], encoder[1], prompt, torch.device("cpu"),
                                                               hidden_states_layers=SPEC.hidden_layers)


@pytest.fixture(scope="module")
def cached(pipeline_folder):
    from lowvram_lora.engine.caching.stacked_text import encode_stacked

    return encode_stacked(pipeline_folder, SPEC, list(CAPTIONS), torch.device("cpu"), torch.float32, SPEC.max_length)


# --- identity and names ------------------------------------------------------------------------------------


def test_registry_variants_and_detection(pipeline_folder, distilled_folder, tmp_path):
    """The real configs are FLUX.3's (5.54 B; 43 blocks of 122.7 M; the flow map 5.55 B); a native file (with ComfyUI's
    prefix) is detected as FLUX.3, Base or the flow map by its tensors."""
    from lowvram_lora.engine.checkpoint import identify
    from lowvram_lora.engine.families import meta_model

    assert get_family("flux3") is FAMILY
    base, flow = FAMILY.load_config("flux3-klein-base"), FAMILY.load_config("flux3-klein")
    assert sum(p.numel() for p in meta_model(FAMILY, base).parameters()) == 5_538_458_368
    assert sum(p.numel() for p in meta_model(FAMILY, flow).parameters()) == 5_548_681_984
    assert FAMILY.text_widths(base) == {"prompt_embeds": 8 * 2560}
    assert [FAMILY.variant_for_config(c) for c in (base, flow)] == ["flux3-klein-base", "flux3-klein"]
    for folder, variant in ((pipeline_folder, TINY), (distilled_folder, "flux3-tiny-distilled")):
        single = write_single_file(folder, tmp_path / f"{variant}.safetensors", prefix="model.diffusion_model.")
        keys = {k.removeprefix("model.diffusion_model.") for k in load_file(str(single))}
        assert family_for_single_file(keys) is FAMILY
        assert identify(single).variant == variant
    assert ("ref_time_in.in_layer.weight" in keys) and FAMILY.guidance("flux3-klein").target_sigma


def test_native_names_are_the_diffusers_converter_inverted(distilled_folder, tmp_path):
    """Our native file, read back by diffusers' own ``convert_flux3_transformer_checkpoint_to_diffusers``, is the
    flow map's transformer bit for bit (the swapped final modulation and the target-timestep embedder included)."""
    from diffusers.loaders.single_file_utils import convert_flux3_transformer_checkpoint_to_diffusers

    ref = load_file(str(distilled_folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    native = load_file(str(write_single_file(distilled_folder, tmp_path / "k.safetensors")))
    assert {"early_stream_modulations.image.lin.weight", "content_mode_blocks.image.0.q_proj.weight",
            "single_blocks.1.norm.query_norm.scale", "ref_time_in.out_layer.weight"} <= set(native)
    converted = convert_flux3_transformer_checkpoint_to_diffusers(dict(native))
    assert sorted(converted) == sorted(ref)
    assert all(torch.equal(converted[k], v) for k, v in ref.items())


def test_engine_checkpoint_reads_every_form(pipeline_folder, tmp_path):
    """The native file (bf16; with ComfyUI's full-checkpoint prefix; fp8 e4m3fn within e4m3's 3 mantissa bits) and the
    diffusers folder load as diffusers' from_pretrained gives, bit for bit after the same cast."""
    check_checkpoint_forms(FAMILY, pipeline_folder, tmp_path, fp8_bound=1 / 16)


def test_fp8_scaled_reads_and_int8_convrot_is_refused(pipeline_folder, tmp_path):
    """ComfyUI's ``*_fp8_scaled`` form (per-tensor ``weight_scale`` + ``comfy_quant``) reads as ``fp8 * scale``; the
    ``int8_convrot`` form (rotated int8) is refused by name, saying what to use instead."""
    import json

    from lowvram_lora.engine.checkpoint import identify, open_checkpoint
    from lowvram_lora.engine.errors import ModelLoadError

    native = load_file(str(write_single_file(pipeline_folder, tmp_path / "k.safetensors")))
    layer = "single_blocks.0.q_proj"
    w = native[f"{layer}.weight"]

    def quantized(fmt, q, scale, extra=None):
        out = {f"model.diffusion_model.{k}": v for k, v in native.items() if k != f"{layer}.weight"}
        p = f"model.diffusion_model.{layer}"
        out[f"{p}.weight"], out[f"{p}.weight_scale"] = q, scale
        out[f"{p}.comfy_quant"] = torch.tensor(list(json.dumps({"format": fmt, **(extra or {})}).encode()),
                                               dtype=torch.uint8)
        return out

    scale = w.abs().max() / 448.0
    fp8 = (w / scale).to(torch.float8_e4m3fn)
    save_file(quantized("float8_e4m3fn", fp8, scale.reshape(())), str(tmp_path / "flux3_fp8_scaled.safetensors"))
    got = open_checkpoint(identify(tmp_path / "flux3_fp8_scaled.safetensors")).load_model(torch.float32)
    torch.testing.assert_close(got.single_transformer_blocks[0].attn.to_q.weight, fp8.float() * scale, atol=0, rtol=0)
    s8 = w.abs().max() / 127.0
    save_file(quantized("int8_tensorwise", (w / s8).round().to(torch.int8), s8.reshape(()), {"convrot": True}),
              str(tmp_path / "flux3_int8_convrot.safetensors"))
    with pytest.raises(ModelLoadError, match=r"(?s)single_blocks\.0\.q_proj.*int8_tensorwise.*bf16 or fp8"):
        open_checkpoint(identify(tmp_path / "flux3_int8_convrot.safetensors")).load_model(torch.float32)


# --- text ------------------------------------------------------------------------------------------------


def test_cache_rows_equal_the_pipelines_windows(encoder, cached):
    """Each cached caption is exactly the pipeline's prompt embedding: its 80-token window (two captions in the first,
    one in the second), the padding rows included (pad positions 1), layer-major in tap order; one group of three
    padded to the longest window gives each caption's own rows."""
    assert [c.shape[0] for c in cached] == [80, 80, 160]
    for caption, row in zip(CAPTIONS, cached):
        ref = _reference(encoder, caption)[0]
        assert row.shape == ref.shape
        torch.testing.assert_close(row, ref, atol=1e-5, rtol=1e-5)
    # the padding rows are not zeros or copies: the model reads them, so the cache must hold them as they are
    assert cached[0][-1].abs().sum() > 0 and not torch.equal(cached[0][-1], cached[1][-1])


def test_single_text_file_encodes_as_the_folder(pipeline_folder, cached, tmp_path):
    """ComfyUI's ``qwen3vl_4b_bf16.safetensors`` layout through the decoder_lm kind gives the folder's rows."""
    from lowvram_lora.engine.caching.encoders import encoder_kind, kind_of_file
    from lowvram_lora.engine.caching.single_files import SingleFileSources
    from lowvram_lora.engine.checkpoint.tensors import TensorStore, open_files

    f = write_text_and_vae_files(pipeline_folder, tmp_path)["text_encoder"]
    shapes = TensorStore(open_files([f], "t")).shapes()
    assert "model.visual.deepstack_merger_list.0.norm.weight" in shapes
    assert kind_of_file(f, shapes).kind == "decoder_lm"
    singles = SingleFileSources(text_encoders={"text_encoder": f}, vae=None, tokenizer_dirs={})
    ours = encoder_kind("decoder_lm").encode(None, singles, FAMILY, SPEC, list(CAPTIONS), torch.device("cpu"),
                                             torch.float32, SPEC.max_length)
    for o, c in zip(ours, cached):
        torch.testing.assert_close(o, c, atol=1e-6, rtol=1e-6)


# --- the forward -----------------------------------------------------------------------------------------


def _transformer(folder):
    return FAMILY.transformer_class().from_pretrained(folder / "transformer", use_safetensors=True).eval()


def test_training_forward_equals_the_pipelines_call(pipeline_folder, encoder, cached):
    """``model_inputs`` on a batch of two cached captions of one window gives the velocity the transformer gives each
    caption as the modular pipeline calls it (its packed tokens, ``_prepare_image_ids`` with the 0.5 RoPE scale,
    ``_prepare_text_ids``, sigma)."""
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep, _prepare_image_ids

    model = _transformer(pipeline_folder)
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(2, 16, 4, 3, generator=g)
    sigmas = torch.tensor([0.3, 0.85])
    with torch.no_grad():
        ours = predict_velocity(FAMILY, model, latents, {"prompt_embeds": torch.stack(cached[:2])}, sigmas, 0.0)
        refs = []
        for i in range(2):
            embeds = _reference(encoder, CAPTIONS[i])
            out = model(hidden_states=latents[i:i + 1].flatten(2).transpose(1, 2), encoder_hidden_states=embeds,
                        timestep=sigmas[i:i + 1], img_ids=_prepare_image_ids(4, 3, 0.5),
                        txt_ids=Flux3TextRoPEInputsStep._prepare_text_ids(embeds), return_dict=False)[0]
            refs.append(out.transpose(1, 2).reshape(1, 16, 4, 3))
    torch.testing.assert_close(ours, torch.cat(refs), atol=1e-5, rtol=1e-5)
    assert torch.equal(image_ids(4, 3, "cpu"), _prepare_image_ids(4, 3, 0.5))
    assert torch.equal(text_ids(80, "cpu"), Flux3TextRoPEInputsStep._prepare_text_ids(cached[0][None]))


def test_flow_map_trains_refused_by_name(distilled_folder):
    """The flow map has no training target without the sigma a step jumps to: training on it is refused, naming Base."""
    from lowvram_lora.engine.errors import ConfigError

    model = _transformer(distilled_folder)
    with pytest.raises(ConfigError, match="Train the LoRA on FLUX 3 Image Klein Base"):
        FAMILY.model_inputs(model, torch.zeros(1, 16, 2, 2), {"prompt_embeds": torch.zeros(1, 80, 96)},
                            torch.tensor([0.5]), 0.0)


def test_lora_targets_and_gradients(pipeline_folder, cached):
    """The default targets are q, k, v and out of every block text-to-image runs (152 Linears at full size); one
    flow-matching step gives each a gradient, the reference-image blocks none."""
    from peft import LoraConfig

    model = _transformer(pipeline_folder)
    targets = FAMILY.lora.target_modules(model)
    assert len(targets) == 4 * (2 + 2 + 2) and not any("image_cond" in t for t in targets)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=targets))
    g = torch.Generator().manual_seed(5)
    x0, noise = torch.randn(2, 16, 4, 4, generator=g), torch.randn(2, 16, 4, 4, generator=g)
    s = torch.tensor([0.2, 0.7])
    noisy = (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * noise
    embeds = {"prompt_embeds": torch.stack(cached[:2])}
    torch.nn.functional.mse_loss(predict_velocity(FAMILY, model, noisy, embeds, s, 0.0), noise - x0).backward()
    modules = dict(model.named_modules())
    missing = [t for t in targets if modules[f"{t}.lora_B.default"].weight.grad is None
               or modules[f"{t}.lora_B.default"].weight.grad.abs().sum() == 0]
    assert not missing, missing[:3]


def test_outer_linears_are_every_large_linear_outside_the_blocks(pipeline_folder):
    """Every Linear the slab quantizes outside the streamed blocks exists in the real model (the six per-token
    modulation heads, the text projection, the 30 Linears of the reference-image blocks), and with the streamed blocks'
    they are every Linear but the small embedders and the output projection."""
    from lowvram_lora.engine.families import meta_model

    model = meta_model(FAMILY, FAMILY.load_config("flux3-klein-base"))
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    outer = set(FAMILY.memory.int8_extra_linears)
    assert outer <= linears and len(outer) == 7 + 5 * 6
    streamed = {n for n in linears if n.startswith(("txt_mode_blocks.", "mode_blocks.image.", "single_transformer"))}
    assert linears - outer - streamed == {"x_embedders.image", "x_embedders.image_cond", "timestep_embedder.linear_1",
                                          "timestep_embedder.linear_2", "norm_out.linear", "proj_out"}


# --- sampling --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("distilled", [False, True])
def test_engine_sampling_matches_the_pipeline(pipeline_folder, distilled_folder, encoder, distilled):
    """engine/sampling under the variant's guidance gives the modular pipeline's latents from the same noise: Base
    with ``ClassifierFreeGuidance`` (3.5, against the empty prompt's window) under the static shift 6.93
    (``Flux3CoreDenoiseStep``); the flow map unguided, each step told its target sigma
    (``Flux3DistilledCoreDenoiseStep``). 4 steps at 96x64."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.modular_pipelines.flux3.modular_blocks_flux3 import Flux3CoreDenoiseStep
    from diffusers.modular_pipelines.flux3.modular_blocks_flux3_distilled import Flux3DistilledCoreDenoiseStep

    from lowvram_lora.engine.sampling import sample_latents

    folder = distilled_folder if distilled else pipeline_folder
    rule = FAMILY.guidance("flux3-tiny-distilled" if distilled else TINY)
    model = _transformer(folder)
    steps, seed, width, height = 4, 11, 96, 64
    noise = torch.randn((1, *FAMILY.latent_shape(model, width, height)), generator=torch.Generator().manual_seed(seed))
    pos, neg = _reference(encoder, CAPTIONS[1]), _reference(encoder, "")
    pipe = (Flux3DistilledCoreDenoiseStep() if distilled else Flux3CoreDenoiseStep()).init_pipeline()
    pipe.update_components(transformer=model, scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(
        folder / "scheduler"))
    with torch.no_grad():
        ours = sample_latents(model, FAMILY, {"prompt_embeds": pos}, width, height, steps, seed, rule.scale,
                              torch.device("cpu"), torch.float32, rule=rule, negative={"prompt_embeds": neg})
        kwargs = {} if distilled else {"negative_prompt_embeds": neg}
        ref = pipe(prompt_embeds=pos, latents=noise.clone(), height=height, width=width, num_inference_steps=steps,
                   output="latents", **kwargs)
    assert (rule.mode, rule.steps) == (("none", 16) if distilled else ("cfg", 50))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


# --- LoRA files ------------------------------------------------------------------------------------------


def test_saved_lora_loads_in_diffusers_flux3_loader(pipeline_folder, cached, tmp_path):
    """A LoRA trained by the engine and saved in its ComfyUI form (``diffusion_model.`` + BFL's native module names,
    ``lora_A`` / ``lora_B`` with the scale folded in, no ``.alpha``) loads through diffusers'
    ``Flux3LoraLoaderMixin.load_lora_weights`` with every module placed, and the transformer then predicts what our
    merge of the same LoRA predicts (1e-4 relative); every key names a native Linear of the file; the engine reads it
    back exactly."""
    import sys
    from pathlib import Path

    from diffusers.modular_pipelines.flux3.modular_blocks_flux3 import Flux3CoreDenoiseStep

    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.config import DataConfig, LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.lora_io import load_lora, save_lora
    from lowvram_lora.engine.testing import make_tiny_dataset
    from lowvram_lora.engine.train import train_lora

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
    from helpers import merged

    data = make_tiny_dataset(tmp_path / "data", count=1)
    cache = build_dataset_cache(ModelConfig(transformer_path=str(pipeline_folder)),
                                DataConfig(path=str(data), resolution=64, bucket_step=32), tmp_path / "cache")
    lora = train_lora(ModelConfig(transformer_path=str(pipeline_folder)), cache, LoraSettings(rank=4, alpha=8),
                      TrainConfig(steps=3, learning_rate=2e-2, device="cpu"))
    path = save_lora(lora, tmp_path / "flux3_lora.safetensors", fmt="comfyui", dtype="fp32")
    sd = load_file(str(path))
    native = {p.name.removesuffix(".weight") for p in FAMILY.param_table(lora.model_config)}
    assert sd and all(k.startswith("diffusion_model.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in sd)
    assert {k.removeprefix("diffusion_model.").rsplit(".lora_", 1)[0] for k in sd} <= native
    back = load_lora(path)
    assert all(torch.allclose(back.state_dict[k].float(), v.float() * (lora.scale if ".lora_B." in k else 1.0))
               for k, v in lora.state_dict.items())
    ours_model = merged(_transformer(pipeline_folder), lora.state_dict, lora.scale)
    pipe = Flux3CoreDenoiseStep().init_pipeline()
    pipe.update_components(transformer=_transformer(pipeline_folder))
    pipe.load_lora_weights(str(path), adapter_name="ours")
    peft_modules = {n.rsplit(".lora_A", 1)[0] for n, _ in pipe.transformer.named_modules() if n.endswith(".lora_A")}
    assert len(peft_modules) == len(FAMILY.lora.target_modules(pipe.transformer))
    latents = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(2))
    s, embeds = torch.tensor([0.5]), {"prompt_embeds": cached[0][None]}
    with torch.no_grad():
        want = predict_velocity(FAMILY, ours_model, latents, embeds, s, 0.0)
        got = predict_velocity(FAMILY, pipe.transformer, latents, embeds, s, 0.0)
        base = predict_velocity(FAMILY, _transformer(pipeline_folder), latents, embeds, s, 0.0)
    assert ((got - want).norm() / (want - base).norm()).item() < 1e-4
    assert (want - base).abs().max() > 1e-5  # the LoRA changed the prediction


# --- GPU ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_int8_slab_streamed_and_compiled_training_matches_resident_on_gpu(pipeline_folder, tmp_path):
    """The tiny FLUX.3's int8 slab, streamed (activation offload) with inductor-compiled blocks, trains as the same slab
    resident and eager: losses within 1e-3 relative and the learned lora_B within 1e-2 (fp32 compute)."""
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.config import DataConfig, LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.offload import OffloadConfig
    from lowvram_lora.engine.slab import build_slab
    from lowvram_lora.engine.testing import make_tiny_dataset
    from lowvram_lora.engine.train import train_lora

    slab = build_slab(write_single_file(pipeline_folder, tmp_path / "flux3_base_bf16.safetensors"), tmp_path / "slab")
    data = make_tiny_dataset(tmp_path / "data", count=2)
    cache = build_dataset_cache(ModelConfig(transformer_path=str(pipeline_folder)),
                                DataConfig(path=str(data), resolution=64, bucket_step=32), tmp_path / "cache")

    def run(**offload):
        return train_lora(ModelConfig(transformer_path=str(slab), dtype="fp32"), cache, LoraSettings(rank=4),
                          TrainConfig(steps=4, device="cuda", learning_rate=1e-3), offload=OffloadConfig(**offload))

    eager = run(mode="resident", compile="off")
    streamed = run(mode="stream", activation_offload=True, compile="blocks")
    assert streamed.settings["compile"]["graphs"] > 0
    assert streamed.loss_history == pytest.approx(eager.loss_history, rel=1e-3)
    for k, v in eager.state_dict.items():
        if "lora_B" in k:
            err = float((streamed.state_dict[k].float() - v.float()).norm() / v.float().norm().clamp_min(1e-12))
            assert err < 1e-2, (k, err)
