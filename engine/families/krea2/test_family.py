"""Krea 2 (engine/families/krea2/) on tiny models, against diffusers 0.42.1's own code as the reference: the native
names against ``convert_krea2_transformer_checkpoint_to_diffusers``, the text cache against
``Krea2Pipeline.get_text_hidden_states`` (its middle padding and skipped positions), the training forward against the
pipeline's fixed-length call, previews (Raw: CFG 4.5 under the dynamic shift; Turbo: mu 1.15, no guidance) against
the pipeline's latents, a saved LoRA through diffusers' ``Krea2LoraLoaderMixin``. fp32; tolerance 1e-5 unless said."""
import pytest
import torch
from helpers import check_checkpoint_forms
from safetensors.torch import load_file, save_file

from lowvram_lora.engine.families import family_for_single_file, get_family, predict_velocity
from lowvram_lora.engine.families.krea2 import FAMILY
from lowvram_lora.engine.families.krea2.fixtures import (build_tiny_pipeline, comfyui_model, write_single_file,
                                                         write_text_and_vae_files)

TINY = FAMILY.tiny_variant
SPEC = FAMILY.text_encoder_specs(TINY)[0]
CAPTIONS = ["a red circle", "a photo of a big blue dog on the left with a small yellow square"]
#: The tiny tokenizer's count of the pipeline's assistant suffix ("<|im_end|>", "<|im_start|>", "assistant").
TINY_SUFFIX_TOKENS = 3


@pytest.fixture(scope="module")
def pipeline_folder(tmp_path_factory):
    return build_tiny_pipeline(tmp_path_factory.mktemp("krea2") / "krea2-tiny")


def _pipe(folder, distilled=False):
    from diffusers import Krea2Pipeline

    pipe = Krea2Pipeline.from_pretrained(folder, use_safetensors=True, is_distilled=distilled)
    # The tiny tokenizer's counts of the same template pieces (the pipeline's 34 and 5 are Qwen's).
    pipe.prompt_template_encode_start_idx = SPEC.drop_tokens
    pipe.prompt_template_encode_num_suffix_tokens = TINY_SUFFIX_TOKENS
    return pipe


@pytest.fixture(scope="module")
def pipe(pipeline_folder):
    return _pipe(pipeline_folder)


def _reference(pipe, prompts, length=SPEC.max_length):
    """The pipeline's fixed-length (B, L, K, D) stack and bool mask ([prompt | PAD | suffix] after the drop)."""
    with torch.no_grad():
        return pipe.get_text_hidden_states(list(prompts), max_sequence_length=length, device=torch.device("cpu"))


def _padded(rows):
    """Rows of (L_i, K * D) -> a zero-padded batch and its mask, as the dataset loader batches them."""
    n = max(r.shape[0] for r in rows)
    out = torch.zeros(len(rows), n, rows[0].shape[1])
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]], mask[i, : r.shape[0]] = r, 1
    return {"prompt_embeds": out, "prompt_embeds_mask": mask}


@pytest.fixture(scope="module")
def cached(pipeline_folder):
    from lowvram_lora.engine.caching.stacked_text import encode_stacked

    return encode_stacked(pipeline_folder, SPEC, list(CAPTIONS), torch.device("cpu"), torch.float32, SPEC.max_length)


# --- identity and names ------------------------------------------------------------------------------------


def test_registry_variants_and_detection(pipeline_folder, tmp_path):
    """The real config is Krea 2's (6144 wide, 28 blocks, GQA 48/12); a native file (with ComfyUI's prefix) is
    detected as Krea 2 and named Raw or Turbo by its file name, as ComfyUI's files are."""
    from lowvram_lora.engine.checkpoint import identify

    assert get_family("krea2") is FAMILY
    real = FAMILY.load_config("krea2-raw")
    assert FAMILY.memory.hidden_size(real) == 6144 and real["num_layers"] == 28 and real["num_key_value_heads"] == 12
    assert FAMILY.text_widths(real) == {"prompt_embeds": 12 * 2560}
    assert FAMILY.variant_for_config(real) == "krea2-raw"
    single = write_single_file(pipeline_folder, tmp_path / "krea2_raw_bf16.safetensors",
                               prefix="model.diffusion_model.")
    keys = {k.removeprefix("model.diffusion_model.") for k in load_file(str(single))}
    assert family_for_single_file(keys) is FAMILY
    assert all(f is FAMILY or not f.looks_like_single_file(keys) for f in (get_family("qwen_image"),
                                                                            get_family("z_image")))
    assert identify(single).variant == TINY
    assert FAMILY.variant_from_name("krea2-raw", "krea2_turbo_fp8_scaled.safetensors") == "krea2-turbo"
    assert FAMILY.variant_from_name("krea2-raw", "krea2_raw_bf16.safetensors") == "krea2-raw"
    assert FAMILY.variant_from_name(TINY, "krea2_turbo_bf16.safetensors") == TINY


def test_native_names_are_the_diffusers_converter_inverted(pipeline_folder, tmp_path):
    """Our native file, read back by diffusers' own ``convert_krea2_transformer_checkpoint_to_diffusers``, is the
    pipeline's transformer bit for bit (the flattened block modulation included); ComfyUI's detection keys are there."""
    from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers

    ref = load_file(str(pipeline_folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    native = load_file(str(write_single_file(pipeline_folder, tmp_path / "k.safetensors",
                                             prefix="model.diffusion_model.")))
    assert native["model.diffusion_model.blocks.0.mod.lin"].shape == (6 * 64,)
    assert {"model.diffusion_model.txtfusion.projector.weight", "model.diffusion_model.first.weight",
            "model.diffusion_model.txtfusion.layerwise_blocks.0.prenorm.scale"} <= set(native)
    converted = convert_krea2_transformer_checkpoint_to_diffusers(dict(native))
    assert sorted(converted) == sorted(ref)
    assert all(torch.equal(converted[k], v) for k, v in ref.items())


def test_engine_checkpoint_reads_every_form(pipeline_folder, tmp_path):
    """The native file (bf16; with ComfyUI's full-checkpoint prefix; fp8 e4m3fn within e4m3's 3 mantissa bits) and the
    diffusers folder load as diffusers' from_pretrained gives, bit for bit after the same cast."""
    check_checkpoint_forms(FAMILY, pipeline_folder, tmp_path, fp8_bound=1 / 16)


def test_fp8_scaled_and_int8_convrot_files(pipeline_folder, tmp_path):
    """ComfyUI's ``*_fp8_scaled`` form (per-tensor ``weight_scale`` + ``comfy_quant`` tags on the block Linears) reads
    as ``fp8 * scale``; its ``*_int8_convrot`` form (``int8_tensorwise`` with ``convrot``: rotated int8 weights) is
    refused by name, saying what to use instead."""
    import json

    from lowvram_lora.engine.checkpoint import identify, open_checkpoint
    from lowvram_lora.engine.errors import ModelLoadError

    native = load_file(str(write_single_file(pipeline_folder, tmp_path / "k.safetensors")))
    layer = "blocks.0.attn.wq"
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
    save_file(quantized("float8_e4m3fn", fp8, scale.reshape(())), str(tmp_path / "krea2_raw_fp8_scaled.safetensors"))
    got = open_checkpoint(identify(tmp_path / "krea2_raw_fp8_scaled.safetensors")).load_model(torch.float32)
    torch.testing.assert_close(got.transformer_blocks[0].attn.to_q.weight, fp8.float() * scale, atol=0, rtol=0)
    s8 = w.abs().max() / 127.0
    save_file(quantized("int8_tensorwise", (w / s8).round().to(torch.int8), s8.reshape(()), {"convrot": True}),
              str(tmp_path / "krea2_raw_int8_convrot.safetensors"))
    with pytest.raises(ModelLoadError, match=r"(?s)blocks\.0\.attn\.wq.*int8_tensorwise.*bf16 or fp8"):
        open_checkpoint(identify(tmp_path / "krea2_raw_int8_convrot.safetensors")).load_model(torch.float32)


# --- text ------------------------------------------------------------------------------------------------


def test_cache_rows_equal_the_pipelines_valid_rows(pipe, cached):
    """The layer-major cache ([prefix | caption | suffix], no padding, the drop cut off) holds exactly the rows the
    pipeline's mask marks valid in its [prompt | PAD | suffix] block (positions that skip the padding), layer-major
    flattened ((L, K * D) in tap order); the pipeline's padding rows are not in the cache."""
    ref, mask = _reference(pipe, CAPTIONS)
    assert ref.shape[2] == len(SPEC.hidden_layers) and not mask.all()
    for row, r, m in zip(cached, ref, mask):
        valid = r[m]  # (n, K, D): prompt then suffix
        assert row.shape == (valid.shape[0], valid.shape[1] * valid.shape[2])
        torch.testing.assert_close(row, valid.flatten(1), atol=1e-5, rtol=1e-5)
    assert cached[0].shape[0] < cached[1].shape[0] < SPEC.max_length


def test_single_text_file_encodes_as_the_folder(pipeline_folder, cached, tmp_path):
    """ComfyUI's ``qwen3vl_4b_bf16.safetensors`` layout (``model.language_model.``, ``model.visual.``) through the
    decoder_lm kind gives the folder's rows."""
    from lowvram_lora.engine.caching.encoders import encoder_kind, kind_of_file
    from lowvram_lora.engine.caching.single_files import SingleFileSources
    from lowvram_lora.engine.checkpoint.tensors import TensorStore, open_files

    f = write_text_and_vae_files(pipeline_folder, tmp_path)["text_encoder"]
    shapes = TensorStore(open_files([f], "t")).shapes()
    assert "model.visual.deepstack_merger_list.0.norm.weight" in shapes  # what ComfyUI detects Qwen3-VL by
    assert kind_of_file(f, shapes).kind == "decoder_lm"
    singles = SingleFileSources(text_encoders={"text_encoder": f}, vae=None, tokenizer_dirs={})
    ours = encoder_kind("decoder_lm").encode(None, singles, FAMILY, SPEC, list(CAPTIONS), torch.device("cpu"),
                                             torch.float32, SPEC.max_length)
    for o, c in zip(ours, cached):
        torch.testing.assert_close(o, c, atol=1e-6, rtol=1e-6)


# --- the forward -----------------------------------------------------------------------------------------


def test_training_forward_equals_the_pipelines_call(pipe, cached):
    """``model_inputs`` on the cache's batch (each caption at its own length, padded at the end) gives the velocity
    the transformer gives the pipeline's fixed-length block (padding in the middle, its mask), sample by sample:
    text rows sit at position 0 and padded keys are masked, so the layout of the padding changes nothing."""
    model = pipe.transformer
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(2, 16, 8, 6, generator=g)
    sigmas = torch.tensor([0.3, 0.85])
    ref_embeds, ref_mask = _reference(pipe, CAPTIONS)
    with torch.no_grad():
        ours = predict_velocity(FAMILY, model, latents, _padded(cached), sigmas, 0.0)
        ids = pipe.prepare_position_ids(ref_embeds.shape[1], 4, 3, torch.device("cpu"))
        out = model(hidden_states=pipe._pack_latents(latents, 2, 16, 8, 6), encoder_hidden_states=ref_embeds,
                    timestep=sigmas, position_ids=ids, encoder_attention_mask=ref_mask, return_dict=False)[0]
        ref = FAMILY.unpack_prediction(out, latents)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the mask matters: without it the padding rows leak in
        unmasked = {"prompt_embeds": _padded(cached)["prompt_embeds"]}
        leaky = predict_velocity(FAMILY, model, latents, unmasked, sigmas, 0.0)
    assert (leaky[0] - ours[0]).abs().max() > 1e-4


def test_lora_targets_and_gradients(pipeline_folder, cached):
    """The default targets are every main block's q, k, v, out and gate (140 Linears at full size); one flow-matching
    step gives each a gradient, and the text-fusion stage (frozen, no LoRA) none."""
    from peft import LoraConfig

    model = FAMILY.transformer_class().from_pretrained(pipeline_folder / "transformer", use_safetensors=True)
    targets = FAMILY.lora.target_modules(model)
    assert len(targets) == 5 * len(model.transformer_blocks)
    real = get_family("krea2").lora.targets["transformer_blocks"]
    assert real == ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.to_gate")
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=targets))
    g = torch.Generator().manual_seed(5)
    x0, noise = torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 16, 8, 8, generator=g)
    s = torch.tensor([0.2, 0.7])
    noisy = (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * noise
    loss = torch.nn.functional.mse_loss(predict_velocity(FAMILY, model, noisy, _padded(cached), s, 0.0), noise - x0)
    loss.backward()
    modules = dict(model.named_modules())
    missing = [t for t in targets if modules[f"{t}.lora_B.default"].weight.grad is None
               or modules[f"{t}.lora_B.default"].weight.grad.abs().sum() == 0]
    assert not missing, missing[:3]


def test_outer_linears_exist_and_are_outside_the_blocks(pipe):
    """Every Linear the slab quantizes outside the blocks exists (global modulation, text projection, the 32 Linears
    of the fusion stage), and with the blocks' they are every Linear of the model."""
    model = pipe.transformer
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    outer = set(FAMILY.memory.int8_extra_linears)
    assert outer <= linears and len(outer) == 3 + 4 * 8
    rest = {n for n in linears - outer if not n.startswith("transformer_blocks.")}
    assert rest == {"img_in", "time_embed.linear_1", "time_embed.linear_2", "final_layer.linear",
                    "text_fusion.projector"}


# --- sampling --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["krea2-raw", "krea2-turbo"])
def test_engine_sampling_matches_the_pipeline(pipeline_folder, pipe, cached, variant):
    """engine/sampling under the variant's guidance gives Krea2Pipeline's latents from the same noise: Raw with Krea's
    CFG ``cond + 4.5 (cond - uncond)`` against the empty prompt under the resolution-aware shift; Turbo
    (``is_distilled``) unguided under mu 1.15. 4 steps at 96x64 (24 image tokens: Raw's mu is far from 1.15)."""
    from lowvram_lora.engine.caching.stacked_text import encode_stacked
    from lowvram_lora.engine.sampling import sample_latents

    rule = FAMILY.guidance(variant)
    p = pipe if variant == "krea2-raw" else _pipe(pipeline_folder, distilled=True)
    steps, seed, width, height = 4, 11, 96, 64
    neg = encode_stacked(pipeline_folder, SPEC, [""], torch.device("cpu"), torch.float32, SPEC.max_length)
    shape = (1, *FAMILY.latent_shape(p.transformer, width, height))
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    embeds, neg_embeds = _reference(p, CAPTIONS[:1]), _reference(p, [""])
    with torch.no_grad():
        ours = sample_latents(p.transformer, FAMILY, _padded(cached[:1]), width, height, steps, seed, rule.scale,
                              torch.device("cpu"), torch.float32, rule=rule, negative=_padded(neg))
        packed = p(prompt_embeds=embeds[0], prompt_embeds_mask=embeds[1], negative_prompt_embeds=neg_embeds[0],
                   negative_prompt_embeds_mask=neg_embeds[1], guidance_scale=rule.scale, num_inference_steps=steps,
                   latents=p._pack_latents(noise.clone(), 1, 16, 8, 12), height=height, width=width,
                   output_type="latent").images
    ref = FAMILY.unpack_prediction(packed, noise)
    assert (rule.mode == "cfg") == (variant == "krea2-raw") and rule.steps == (28 if variant == "krea2-raw" else 8)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


# --- LoRA files ------------------------------------------------------------------------------------------


def test_saved_lora_loads_in_diffusers_krea2_loader(pipeline_folder, pipe, cached, tmp_path):
    """A LoRA trained by the engine and saved in the diffusers form (``transformer.`` names, alpha/rank folded into B)
    loads through diffusers' ``Krea2LoraLoaderMixin.load_lora_weights`` with every module placed, and the pipeline's
    transformer then predicts what our merge of the same LoRA predicts (1e-4 relative). (The ComfyUI form's ``.alpha``
    tensors are refused by that loader: "all LoRA param names contain 'lora'"; tests/comfyui checks it in ComfyUI.)"""
    import sys
    from pathlib import Path

    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.config import DataConfig, LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.lora_io import save_lora
    from lowvram_lora.engine.models import load_transformer
    from lowvram_lora.engine.testing import make_tiny_dataset
    from lowvram_lora.engine.train import train_lora

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
    from helpers import merged

    data = make_tiny_dataset(tmp_path / "data", count=1)
    cache = build_dataset_cache(ModelConfig(transformer_path=str(pipeline_folder)),
                                DataConfig(path=str(data), resolution=64, bucket_step=32), tmp_path / "cache")
    lora = train_lora(ModelConfig(transformer_path=str(pipeline_folder)), cache, LoraSettings(rank=4, alpha=8),
                      TrainConfig(steps=3, learning_rate=2e-2, device="cpu"))
    path = save_lora(lora, tmp_path / "krea2_lora.safetensors", fmt="diffusers", dtype="fp32")
    model = load_transformer(pipeline_folder, dtype=torch.float32)[0]
    ours_model = merged(model, lora.state_dict, lora.scale)
    p = _pipe(pipeline_folder)
    p.load_lora_weights(str(path), adapter_name="ours")
    peft_modules = {n.rsplit(".lora_A", 1)[0] for n, _ in p.transformer.named_modules() if n.endswith(".lora_A")}
    assert len(peft_modules) == len(FAMILY.lora.target_modules(p.transformer))
    latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(2))
    s = torch.tensor([0.5])
    with torch.no_grad():
        want = predict_velocity(FAMILY, ours_model, latents, _padded(cached[:1]), s, 0.0)
        got = predict_velocity(FAMILY, p.transformer, latents, _padded(cached[:1]), s, 0.0)
        base = predict_velocity(FAMILY, _pipe(pipeline_folder).transformer, latents, _padded(cached[:1]), s, 0.0)
    assert ((got - want).norm() / (want - base).norm()).item() < 1e-4
    assert (want - base).abs().max() > 1e-5  # the LoRA changed the prediction
    assert comfyui_model(lora.model_config)[0] == "Krea2"


# --- GPU ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_int8_slab_streamed_and_compiled_training_matches_resident_on_gpu(pipeline_folder, tmp_path):
    """The Krea 2 tiny model's int8 slab, streamed (activation offload) with inductor-compiled blocks, trains as the
    same slab resident and eager: losses within 1e-3 relative and the learned lora_B within 1e-2 (fp32 compute)."""
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.config import DataConfig, LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.offload import OffloadConfig
    from lowvram_lora.engine.slab import build_slab
    from lowvram_lora.engine.testing import make_tiny_dataset
    from lowvram_lora.engine.train import train_lora

    slab = build_slab(write_single_file(pipeline_folder, tmp_path / "krea2_raw_bf16.safetensors"), tmp_path / "slab")
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
