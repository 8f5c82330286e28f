"""Caching Flux.1 from the single files ComfyUI users have (clip_l, t5xxl, ae.safetensors), without a
diffusers pipeline folder: the cache equals the pipeline folder's."""
import pytest
import torch

from lowvram_lora.engine.caching import build_dataset_cache
from lowvram_lora.engine.config import DataConfig, ModelConfig
from lowvram_lora.engine.errors import ModelLoadError
from lowvram_lora.engine.testing import make_tiny_dataset, write_flux1_single_files


@pytest.fixture(scope="module")
def files(tiny_pipeline, tmp_path_factory):
    return write_flux1_single_files(tiny_pipeline, tmp_path_factory.mktemp("te") / "text_encoders")


def _cache(model_cfg, root, data):
    return build_dataset_cache(model_cfg, DataConfig(path=str(data), resolution=128, bucket_step=32), root)


def test_single_files_cache_equals_the_pipeline_folder(tiny_pipeline, tiny_single_file, files, tmp_path):
    data = make_tiny_dataset(tmp_path / "data", count=2)
    ref = _cache(ModelConfig(transformer_path=str(tiny_pipeline)), tmp_path / "c1", data)
    # the two text-encoder files in either order; the transformer a single file too
    got = _cache(ModelConfig(transformer_path=str(tiny_single_file), text_encoder_files=(str(files["t5xxl"]),
                                                                                          str(files["clip_l"])),
                             vae_file=str(files["vae"])), tmp_path / "c2", data)
    assert (got.family, got.variant) == ("flux1", "flux1-tiny")
    for a, b in zip(ref.items, got.items):
        (la, ea), (lb, eb) = ref.load_item(a), got.load_item(b)
        torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
        assert set(ea) == set(eb) == {"prompt_embeds", "pooled_prompt_embeds"}
        for k in ea:
            torch.testing.assert_close(eb[k], ea[k], rtol=1e-5, atol=1e-5)


def test_missing_tokenizer_names_both_places(tiny_pipeline, tiny_single_file, tmp_path):
    bare = write_flux1_single_files(tiny_pipeline, tmp_path / "bare", with_tokenizers=False)
    data = make_tiny_dataset(tmp_path / "data", count=1)
    with pytest.raises(ModelLoadError, match=r"no tokenizer for 'clip_l.safetensors'.*bare/clip_l/.*ComfyUI"):
        _cache(ModelConfig(transformer_path=str(tiny_single_file), text_encoder_files=(str(bare["clip_l"]),
                                                                                        str(bare["t5xxl"])),
                           vae_file=str(bare["vae"])), tmp_path / "c", data)
    # a fallback tokenizer folder (what the ComfyUI node passes: its bundled ones) is used when given
    cache = _cache(ModelConfig(transformer_path=str(tiny_single_file),
                               text_encoder_files=(str(bare["clip_l"]), str(bare["t5xxl"])), vae_file=str(bare["vae"]),
                               tokenizer_dirs={"clip_l": str(tiny_pipeline / "tokenizer"),
                                               "t5xxl": str(tiny_pipeline / "tokenizer_2")}),
                   tmp_path / "c3", data)
    # reference: the cache of the pipeline folder (its own tokenizers and encoders); same values, rtol/atol 1e-5
    ref = _cache(ModelConfig(transformer_path=str(tiny_pipeline)), tmp_path / "ref", data)
    assert len(cache.items) == len(ref.items) == 1
    (la, ea), (lb, eb) = ref.load_item(ref.items[0]), cache.load_item(cache.items[0])
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    assert set(eb) == set(ea) == {"prompt_embeds", "pooled_prompt_embeds"}
    for k in ea:
        torch.testing.assert_close(eb[k], ea[k], rtol=1e-5, atol=1e-5, msg=k)


def test_a_fallback_tokenizer_of_another_vocabulary_is_refused_by_name(tiny_pipeline, tmp_path):
    """A T5 file without its own tokenizer takes the fallback folder (inside ComfyUI its bundled t5_tokenizer, 32100
    tokens); one with more tokens than the file's embedding rows is another model's: a named error before encoding,
    not an index error mid-encode. The file's own tokenizer (same vocabulary) loads."""
    from transformers import AutoTokenizer

    from lowvram_lora.engine.caching.single_files import load_text_encoder_file

    bare = write_flux1_single_files(tiny_pipeline, tmp_path / "bare", with_tokenizers=False)
    bigger = AutoTokenizer.from_pretrained(tiny_pipeline / "tokenizer_2", local_files_only=True)
    bigger.add_tokens([f"extra{i}" for i in range(100)])
    bigger.save_pretrained(tmp_path / "bigger")
    rows = load_text_encoder_file(bare["t5xxl"], torch.float32, {"t5xxl": tiny_pipeline / "tokenizer_2"})[1] \
        .get_input_embeddings().num_embeddings
    with pytest.raises(ModelLoadError, match=rf"'t5xxl.safetensors' .*bigger' has {len(bigger)} tokens but the file's "
                                             rf"embedding table has {rows} rows.*bare/t5xxl/"):
        load_text_encoder_file(bare["t5xxl"], torch.float32, {"t5xxl": tmp_path / "bigger"})


def test_wrong_or_incomplete_files_are_named(tiny_single_file, files, tmp_path):
    data = make_tiny_dataset(tmp_path / "data", count=1)
    with pytest.raises(ModelLoadError, match="missing a T5-XXL file"):
        _cache(ModelConfig(transformer_path=str(tiny_single_file), text_encoder_files=(str(files["clip_l"]),),
                           vae_file=str(files["vae"])), tmp_path / "c", data)
    with pytest.raises(ModelLoadError, match="same kind"):
        _cache(ModelConfig(transformer_path=str(tiny_single_file),
                           text_encoder_files=(str(files["clip_l"]), str(files["clip_l"])),
                           vae_file=str(files["vae"])), tmp_path / "c", data)
    with pytest.raises(ModelLoadError, match=r"none of the text encoders known \(") as refused:
        _cache(ModelConfig(transformer_path=str(tiny_single_file),
                           text_encoder_files=(str(tiny_single_file), str(files["t5xxl"])),
                           vae_file=str(files["vae"])), tmp_path / "c", data)
    assert all(name in str(refused.value) for name in ("CLIP-L", "T5-XXL", "decoder LLM"))


def test_flux2_single_files_cache_equals_the_pipeline_folder(tiny_flux2, tmp_path):
    """Flux.2 from single files: the Mistral text encoder under ComfyUI's model.* names with a companion
    tokenizer folder, and the Flux.2 VAE with LDM names + bn.* (diffusers has no single-file loader for it)."""
    from lowvram_lora.engine.testing import write_flux2_single_file, write_flux2_text_and_vae_files

    files = write_flux2_text_and_vae_files(tiny_flux2, tmp_path / "files")
    transformer = write_flux2_single_file(tiny_flux2, tmp_path / "files" / "flux2_fp8mixed.safetensors", comfy_fp8=True)
    data = make_tiny_dataset(tmp_path / "data", count=2)
    ref = _cache(ModelConfig(transformer_path=str(tiny_flux2)), tmp_path / "c1", data)
    got = _cache(ModelConfig(transformer_path=str(transformer), text_encoder_files=(str(files["text_encoder"]),),
                             vae_file=str(files["vae"])), tmp_path / "c2", data)
    assert (got.family, got.variant) == ("flux2", "flux2-tiny")
    for a, b in zip(ref.items, got.items):
        (la, ea), (lb, eb) = ref.load_item(a), got.load_item(b)
        torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(eb["prompt_embeds"], ea["prompt_embeds"], rtol=1e-5, atol=1e-5)
    for f in files["text_encoder"].with_suffix("").iterdir():  # keep the config, drop the tokenizer files
        if f.name != "config.json":
            f.unlink()
    with pytest.raises(ModelLoadError, match=r"no tokenizer for 'text_encoder.safetensors'.*files/text_encoder/"):
        _cache(ModelConfig(transformer_path=str(transformer), text_encoder_files=(str(files["text_encoder"]),),
                           vae_file=str(files["vae"])), tmp_path / "c3", data)


def test_comfyui_mistral_file_with_its_embedded_tekken_tokenizer(tiny_flux2, tmp_path):
    """ComfyUI's Mistral file carries its tokenizer as a tekken_model tensor: it is converted with
    transformers' tekken converter, laid out as Mistral's chat format (<s>[SYSTEM_PROMPT]..[/SYSTEM_PROMPT]
    [INST]..[/INST], left-padded with <pad> = 11), and the layer-major result equals diffusers' own encode
    with that tokenizer and the full model."""
    import transformers
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

    from lowvram_lora.engine.caching.single_files import decoder_lm_source
    from lowvram_lora.engine.caching.stacked_text import encode_stacked
    from lowvram_lora.engine.families import get_family
    from lowvram_lora.engine.testing import write_comfy_mistral_file

    path = write_comfy_mistral_file(tmp_path / "text_encoders" / "mistral_tiny.safetensors")
    files, config, tokenizer = decoder_lm_source(path)
    assert not isinstance(tokenizer, type(path)) and tokenizer.pad_token_id == 11
    spec = get_family("flux2").text_encoder_specs("flux2-tiny")[0]
    prompts = ["a cat", "a red cat on a mat"]
    got = encode_stacked(tmp_path, spec, prompts, torch.device("cpu"), torch.float32, 16, source=(files, config, tokenizer))
    full = transformers.Mistral3ForConditionalGeneration.from_pretrained(tmp_path / "text_encoders" / "mistral_tiny-full",
                                                                          use_safetensors=True)
    ref = Flux2Pipeline._get_mistral_3_small_prompt_embeds(full, tokenizer, prompts, dtype=torch.float32,
                                                           max_sequence_length=16, hidden_states_layers=(1, 2, 3))
    torch.testing.assert_close(torch.stack(got), ref, rtol=1e-5, atol=1e-5)
    ids = tokenizer.apply_chat_template([[{"role": "system", "content": [{"type": "text", "text": "s"}]},
                                          {"role": "user", "content": [{"type": "text", "text": "a cat"}]}]],
                                        tokenize=True, return_dict=True, padding="max_length", max_length=12)
    tokens = tokenizer.convert_ids_to_tokens(ids["input_ids"][0])
    assert tokens[0] == "<pad>" and tokens[tokens.index("<s>") + 1] == "[SYSTEM_PROMPT]" and tokens[-1] == "[/INST]"
