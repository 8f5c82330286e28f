"""Flux.2 end to end on tiny models: every file form, caching exactly as diffusers' pipelines,
training, both LoRA formats, slabs, and errors for wrong files."""
import pytest
import torch
from safetensors.torch import load_file

from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.errors import ModelLoadError
from lowvram_lora.engine.families import get_family
from lowvram_lora.engine.lora_io import load_lora, save_lora
from lowvram_lora.engine.models import load_transformer
from lowvram_lora.engine.testing import build_tiny_flux2_pipeline, write_flux2_single_file
from lowvram_lora.engine.train import train_lora

from helpers import eval_flow_loss, merged

FAMILY = get_family("flux2")


def _inputs(model, seed=0, h=8, w=8, length=16, sigma=0.4):
    g = torch.Generator().manual_seed(seed)
    lat = torch.randn(1, model.config.in_channels, h, w, generator=g)
    embeds = {"prompt_embeds": torch.randn(1, length, model.config.joint_attention_dim, generator=g)}
    return FAMILY.model_inputs(model, lat, embeds, torch.tensor([sigma]), 1.0)


def _out(model):
    with torch.no_grad():
        return model(**_inputs(model))[0]


@pytest.fixture(scope="module")
def single_files(tiny_flux2, tmp_path_factory):
    root = tmp_path_factory.mktemp("f2files")
    return {"bfl": write_flux2_single_file(tiny_flux2, root / "flux2-tiny.safetensors"),
            "comfy_fp8": write_flux2_single_file(tiny_flux2, root / "flux2_tiny_fp8mixed.safetensors", comfy_fp8=True)}


def test_every_file_form_loads_the_same_model(tiny_flux2, single_files):
    ref, family, source, variant = load_transformer(tiny_flux2, dtype=torch.float32)
    assert (family.id, source.kind, variant) == ("flux2", "diffusers", "flux2-tiny")
    bfl, _, source, variant = load_transformer(single_files["bfl"], dtype=torch.float32)
    assert (source.kind, variant) == ("single_file", "flux2-tiny")
    # the same weights, bit for bit; outputs agree to float32 rounding (a matmul's blocking can differ
    # between weights that are equal but laid out differently in memory)
    ref_sd, bfl_sd = ref.state_dict(), bfl.state_dict()
    assert ref_sd.keys() == bfl_sd.keys()
    for k in ref_sd:
        assert torch.equal(ref_sd[k], bfl_sd[k]), k
    torch.testing.assert_close(_out(bfl), _out(ref), rtol=1e-5, atol=1e-6)
    # ComfyUI's fp8-mixed layout: prefixed keys, fp8 block weights with weight_scale + comfy_quant tags
    fp8, _, _, variant = load_transformer(single_files["comfy_fp8"], dtype=torch.float32)
    assert variant == "flux2-tiny"
    rel = ((_out(fp8) - _out(ref)).norm() / _out(ref).norm()).item()
    assert rel < 0.05, rel


def test_wrong_files_get_clear_errors(tiny_flux2, tiny_single_file, tmp_path):
    with pytest.raises(ModelLoadError, match="not a Flux.2 checkpoint"):
        load_transformer(tiny_single_file, family_id="flux2")  # a Flux.1 file
    from safetensors.torch import save_file

    save_file({"double_stream_modulation_img.lin.weight": torch.zeros(4, 4)}, str(tmp_path / "broken.safetensors"))
    with pytest.raises(ModelLoadError, match="does not match any Flux.2 variant.*missing"):
        load_transformer(tmp_path / "broken.safetensors")


def test_nvfp4_layers_are_refused_by_name(single_files, tmp_path):
    from safetensors.torch import save_file

    sd = load_file(str(single_files["comfy_fp8"]))
    key = next(k for k in sd if k.endswith(".comfy_quant"))
    sd[key] = torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)
    save_file(sd, str(tmp_path / "nvfp4.safetensors"))
    with pytest.raises(ModelLoadError, match="nvfp4.*cannot dequantize"):
        load_transformer(tmp_path / "nvfp4.safetensors")


@pytest.mark.parametrize("kind", ["mistral3", "qwen3"])
def test_layer_major_text_equals_the_diffusers_pipeline(kind, tiny_flux2, tmp_path):
    """Cached embeddings equal diffusers' own encode (full forward, output_hidden_states, stack)."""
    import transformers
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline
    from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

    from lowvram_lora.engine.caching.stacked_text import encode_stacked, load_tokenizer

    folder = tiny_flux2 if kind == "mistral3" else build_tiny_flux2_pipeline(tmp_path / "q", text_encoder="qwen3")
    spec = FAMILY.text_encoder_specs("flux2-tiny")[0]
    if kind == "qwen3":
        from dataclasses import replace

        spec = replace(spec, template=FAMILY.text_encoder_specs("flux2-klein-4b")[0].template)
    prompts = ["a red circle on a blue background", "ohwx, a photo of a small dog", "a [IMG] big green square"]
    got = encode_stacked(folder, spec, prompts, torch.device("cpu"), torch.float32, 16)
    arch = "Mistral3ForConditionalGeneration" if kind == "mistral3" else "Qwen3ForCausalLM"
    full = getattr(transformers, arch).from_pretrained(folder / "text_encoder", use_safetensors=True)
    tok = load_tokenizer(folder / "tokenizer")
    if kind == "mistral3":
        ref = Flux2Pipeline._get_mistral_3_small_prompt_embeds(full, tok, prompts, dtype=torch.float32,
                                                               max_sequence_length=16, hidden_states_layers=(1, 2, 3))
    else:
        ref = Flux2KleinPipeline._get_qwen3_prompt_embeds(full, tok, prompts, dtype=torch.float32,
                                                          max_sequence_length=16, hidden_states_layers=(1, 2, 3))
    assert len(got) == 3 and got[0].shape == ref[0].shape == (16, 48)
    torch.testing.assert_close(torch.stack(got), ref, rtol=1e-5, atol=1e-5)


def test_layers_past_the_last_needed_are_never_read(tiny_flux2, monkeypatch):
    from lowvram_lora.engine.caching import stacked_text

    read = []
    original = stacked_text._ShardedWeights.read
    monkeypatch.setattr(stacked_text._ShardedWeights, "read",
                        lambda self, name, device, dtype: read.append(name) or original(self, name, device, dtype))
    spec = FAMILY.text_encoder_specs("flux2-tiny")[0]  # hidden states 1, 2, 3 of a 4-layer model
    stacked_text.encode_stacked(tiny_flux2, spec, ["a cat"], torch.device("cpu"), torch.float32, 16)
    layers = {int(n.split(".")[1]) for n in read if n.startswith("layers.")}
    assert layers == {0, 1, 2}  # layer 3 (the 4th) stays on disk; each needed layer read once
    assert sum(n == "layers.0.self_attn.q_proj.weight" for n in read) == 1


def test_vae_latents_are_patchified_and_normalised_like_the_pipeline(tiny_flux2):
    from diffusers import AutoencoderKLFlux2
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

    vae = AutoencoderKLFlux2.from_pretrained(tiny_flux2 / "vae", use_safetensors=True)
    image = torch.rand(1, 3, 64, 96) * 2 - 1
    with torch.no_grad():
        mean = vae.encode(image).latent_dist.mode()
        got = FAMILY.vae_for(None).to_model(vae, mean)
        x = Flux2Pipeline._patchify_latents(mean)
        bn_mean = vae.bn.running_mean.view(1, -1, 1, 1)
        bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    torch.testing.assert_close(got, (x - bn_mean) / bn_std)
    assert got.shape == (1, 16, 4, 6)
    from lowvram_lora.engine.families.flux2.family import patchify, unpatchify

    torch.testing.assert_close(unpatchify(patchify(mean)), mean)


def test_model_inputs_match_the_pipeline_ids():
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

    lat = torch.randn(2, 16, 3, 5)
    img_ids = Flux2Pipeline._prepare_latent_ids(lat)[0].float()
    txt_ids = Flux2Pipeline._prepare_text_ids(torch.zeros(2, 7, 8))[0].float()
    torch.testing.assert_close(FAMILY.image_ids(3, 5, "cpu", torch.float32), img_ids)
    torch.testing.assert_close(FAMILY.text_ids(7, "cpu", torch.float32), txt_ids)
    packed = Flux2Pipeline._pack_latents(lat)
    torch.testing.assert_close(FAMILY.unpack_prediction(packed, lat), lat)


def _eval_loss(model, dataset, n=16):
    return eval_flow_loss(model, get_family("flux2"), dataset, n)


@pytest.fixture(scope="module")
def trained(tiny_flux2, tiny_flux2_cache):
    return train_lora(ModelConfig(transformer_path=str(tiny_flux2)), tiny_flux2_cache, LoraSettings(rank=4, alpha=8),
                      TrainConfig(steps=60, learning_rate=1e-2, seed=0, device="cpu"))


def test_cache_holds_flux2_embeddings_and_latents(tiny_flux2_cache):
    assert (tiny_flux2_cache.family, tiny_flux2_cache.variant) == ("flux2", "flux2-tiny")
    lat, emb = tiny_flux2_cache.load_item(tiny_flux2_cache.items[0])
    assert lat.shape == (16, 8, 8) and set(emb) == {"prompt_embeds"} and emb["prompt_embeds"].shape == (16, 48)


def test_training_lowers_the_loss_and_targets_the_stated_modules(trained, tiny_flux2, tiny_flux2_cache):
    modules = {k.split(".lora_A.")[0] for k in trained.state_dict if ".lora_A." in k}
    assert len(modules) == 2 * 8 + 2 * 2
    assert "single_transformer_blocks.0.attn.to_qkv_mlp_proj" in modules
    assert "transformer_blocks.1.attn.add_k_proj" in modules and not any("proj_out" in m for m in modules)
    base = load_transformer(tiny_flux2, dtype=torch.float32)[0]
    base_loss = _eval_loss(base, tiny_flux2_cache)
    trained_loss = _eval_loss(merged(base, trained.state_dict, trained.scale), tiny_flux2_cache)
    assert trained_loss < 0.9 * base_loss, (base_loss, trained_loss)


def test_diffusers_file_reproduces_the_trained_output(trained, tiny_flux2, tmp_path):
    from diffusers import Flux2Transformer2DModel

    base = load_transformer(tiny_flux2, dtype=torch.float32)[0]
    ref = _out(merged(base, trained.state_dict, trained.scale))
    for fmt in ("diffusers", "comfyui"):
        path = save_lora(trained, tmp_path / f"{fmt}.safetensors", fmt=fmt, dtype="fp32")
        fresh = Flux2Transformer2DModel.from_pretrained(tiny_flux2 / "transformer", use_safetensors=True)
        fresh.load_lora_adapter(str(path), prefix="transformer", adapter_name="trained")
        torch.testing.assert_close(_out(fresh), ref, rtol=1e-4, atol=1e-5)
        loaded = load_lora(path)
        assert loaded.format == fmt and loaded.metadata["lowvram_lora.family"] == "flux2"


def test_comfyui_file_maps_every_key(trained, tmp_path):
    """Through the port of ComfyUI's loader (Flux.2 aliases to_qkv_mlp_proj -> linear1, to_out -> linear2)."""
    from comfyui_lora_reference import comfyui_check_flux_lora

    sd = load_file(str(save_lora(trained, tmp_path / "c.safetensors", fmt="comfyui", dtype="fp32")))
    from lowvram_lora.engine.checkpoint import expected_single_file_shapes

    shapes = expected_single_file_shapes(FAMILY, trained.model_config)
    model_keys = {f"diffusion_model.{k}": v for k, v in shapes.items()}
    patches, unmatched, not_loaded = comfyui_check_flux_lora(sd, model_keys)
    assert not unmatched and not not_loaded and len(patches) == 2 * 8 + 2 * 2


def test_int8_slab_round_trip_and_training_step(tiny_flux2, single_files, tiny_flux2_cache, tmp_path):
    from lowvram_lora.engine.slab import Int8Linear, build_slab
    from lowvram_lora.engine.slab.load import read_manifest

    slab = build_slab(single_files["bfl"], tmp_path / "slabs", progress=False)
    manifest = read_manifest(slab)
    # every block Linear, plus the global modulation and the text embedder (int8_extra_linears)
    assert manifest["family"] == "flux2" and manifest["summary"]["quantized_linears"] == 2 * 12 + 2 * 2 + 4
    model, family, source, variant = load_transformer(slab, dtype=torch.float32)
    assert source.kind == "slab" and isinstance(model.single_transformer_blocks[0].attn.to_out, Int8Linear)
    assert isinstance(model.double_stream_modulation_img.linear, Int8Linear)
    assert isinstance(model.context_embedder, Int8Linear) and not isinstance(model.proj_out, Int8Linear)
    ref = load_transformer(tiny_flux2, dtype=torch.float32)[0]
    rel = ((_out(model) - _out(ref)).norm() / _out(ref).norm()).item()
    assert rel < 0.02, rel
    result = train_lora(ModelConfig(transformer_path=str(slab)), tiny_flux2_cache, LoraSettings(rank=4),
                        TrainConfig(steps=3, learning_rate=1e-2, device="cpu"))
    assert result.steps == 3 and all(torch.isfinite(t).all() for t in result.state_dict.values())
