"""LTX-2.3 from ComfyUI's single files (comfy_files.py): Gemma from ``gemma_3_12B_it.safetensors`` (bf16) or
``_fp8_scaled``, the text connectors, the text projection and the video VAE from the all-in-one checkpoint
``ltx-2.3-22b-dev.safetensors``, on the tiny model, against the diffusers-folder path (itself checked against
``LTX2Pipeline`` in test_family.py) and diffusers' own converters. fp32 compute; tolerances stated per test."""
import io

import pytest
import torch
from safetensors.torch import load_file, save_file

from lowvram_lora.engine.families.ltx2 import FAMILY
from lowvram_lora.engine.families.ltx2.fixtures import (
    build_tiny_pipeline, fp8_scale, original_vae_state, write_comfy_gemma, write_single_file,
)

TINY = FAMILY.tiny_variant
SPEC = FAMILY.text_encoder_specs(TINY)[0]
CAPTIONS = ["a red circle", "  ohwx, a photo of a big blue dog on the left with a small yellow square  "]


def _on_the_files_grid(folder):
    """The folder's Gemma weights rounded to what both ComfyUI forms store exactly: bf16, and each layer's 2-D
    weights on the float8_e4m3fn grid times a power-of-two scale (which bf16 also holds exactly). Then the bf16 file
    and the fp8_scaled file decode to the folder's weights bit for bit, and any difference is the reading path's."""
    for f in sorted((folder / "text_encoder").glob("*.safetensors")):
        state = load_file(str(f))
        for k, v in state.items():
            v = v.to(torch.bfloat16).float()
            if ".layers." in k and "language_model" in k and k.endswith(".weight") and v.dim() == 2:
                s = fp8_scale(v)
                v = (v / s).to(torch.float8_e4m3fn).float() * s
            state[k] = v
        save_file(state, str(f), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return _on_the_files_grid(build_tiny_pipeline(tmp_path_factory.mktemp("ltx2c") / "ltx2-tiny"))


@pytest.fixture(scope="module")
def files(folder, tmp_path_factory):
    """ComfyUI's models/ folders: the all-in-one checkpoint and both Gemma forms."""
    root = tmp_path_factory.mktemp("comfy")
    return {"checkpoint": write_single_file(folder, root / "checkpoints" / "ltx-2.3-22b-dev.safetensors",
                                            prefix="model.diffusion_model.", bundle=True),
            "bf16": write_comfy_gemma(folder, root / "text_encoders" / "gemma_3_12B_it.safetensors",
                                      dtype=torch.bfloat16),
            "fp8_scaled": write_comfy_gemma(folder, root / "text_encoders" / "gemma_3_12B_it_fp8_scaled.safetensors",
                                            fp8_scaled=True)}


def _encode(pipeline, singles):
    from lowvram_lora.engine.caching.encoders import encoder_kind

    kind = encoder_kind(SPEC.kind)
    return kind.encode(pipeline, singles, FAMILY, SPEC, list(CAPTIONS), torch.device("cpu"), torch.float32,
                       kind.caption_length(SPEC, 999))


def _models(files, form):
    from lowvram_lora.engine.caching.model_sources import open_models
    from lowvram_lora.engine.config import ModelConfig

    return open_models(ModelConfig(transformer_path=str(files["checkpoint"]), text_encoder_files=(str(files[form]),),
                                   dtype="fp32"), device="cpu")


# --- text ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["bf16", "fp8_scaled"])
def test_cached_text_equals_the_folder_path(folder, files, form):
    """Cache Text Embeds' sources from the model's checkpoint and ComfyUI's Gemma file alone (no VAE file, no
    folder): the Gemma file is told apart by its tensors, the VAE and the connectors come from the checkpoint. The
    cached rows equal the diffusers-folder path's on the same weights (1e-6: the same operations)."""
    models = _models(files, form)
    assert models.pipeline is None and models.singles.checkpoint == files["checkpoint"]
    assert models.singles.vae == files["checkpoint"] and models.singles.text_encoders == {"text_encoder": files[form]}
    ours, ref = _encode(None, models.singles), _encode(folder, None)
    assert len(ours) == len(CAPTIONS)
    for a, b in zip(ours, ref):
        assert a.shape == (SPEC.max_length, 32 + 8)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_cache_key_follows_the_checkpoints_connectors(files, tmp_path):
    """The text key holds the checkpoint the connectors come from: another checkpoint, another key."""
    from lowvram_lora.engine.caching.keys import cache_keys

    other = tmp_path / "ltx-2.3-22b-dev.safetensors"
    state = load_file(str(files["checkpoint"]))
    key = next(k for k in state if k.endswith("video_embeddings_connector.learnable_registers"))
    state[key] = state[key] + 1
    save_file(state, str(other), metadata={"format": "pt"})
    same, changed = _models(files, "bf16"), _models({**files, "checkpoint": other}, "bf16")
    assert cache_keys(same).text == cache_keys(_models(files, "bf16")).text != cache_keys(changed).text


def test_caching_ram_counts_the_checkpoints_vae_and_connectors_only(files):
    """From the all-in-one checkpoint the RAM check counts its VAE's and connectors' tensors, never the transformer's
    (at full size 19B parameters the pass does not hold)."""
    from lowvram_lora.engine.caching.ram import _elements, caching_host_bytes

    ckpt = files["checkpoint"]
    parts = caching_host_bytes(_models(files, "bf16"))
    vae = _elements([ckpt], False, only=lambda n: n.startswith("vae."))
    conn = _elements([ckpt], False, only=lambda n: "embeddings_connector." in n or "text_embedding_projection." in n)
    layer = _elements([files["bf16"]], per_layer=True)
    assert parts["vae"] == 4 * vae and 0 < vae < _elements([ckpt], False)
    assert next(v for k, v in parts.items() if k.startswith("text_encoder")) == 4 * (layer + conn)


def test_refusals_name_the_missing_file(files):
    """Gemma without the checkpoint (a folder-loaded model) names the all-in-one file; LTX-2.5's text file is refused
    by name; a checkpoint without connectors (a bare transformer) says so."""
    from dataclasses import replace

    from lowvram_lora.engine.caching.single_files import SingleFileSources
    from lowvram_lora.engine.errors import ModelLoadError

    singles = SingleFileSources({"text_encoder": files["bf16"]}, None)
    with pytest.raises(ModelLoadError, match="ltx-2.3-22b-dev.safetensors.*Load Quantized Slab"):
        _encode(None, singles)
    with pytest.raises(ModelLoadError, match="LTX-2.5.*gemma4-12b-with-proj"):
        from lowvram_lora.engine.caching.encoders import encoder_kind

        encoder_kind(SPEC.kind).encode(None, singles, FAMILY, FAMILY.text_encoder_specs("ltx2.5")[0], ["x"],
                                       torch.device("cpu"), torch.float32, 32)
    state = {k: v for k, v in load_file(str(files["checkpoint"])).items() if "connector" not in k
             and "text_embedding_projection" not in k}
    path = files["checkpoint"].parent / "transformer_only.safetensors"
    save_file(state, str(path))
    with pytest.raises(ModelLoadError, match="no text connectors"):
        _encode(None, replace(singles, checkpoint=path))


def test_gemma3_files_are_told_from_gemma2_and_qwen3():
    """A Gemma 3 file (per-head q/k norms and Gemma's sandwich norms) is this kind; Gemma-2 (no q_norm) and Qwen3 (no
    pre_feedforward_layernorm) stay decoder LLMs."""
    from pathlib import Path

    from lowvram_lora.engine.caching.encoders import kind_of_file

    base = {"model.embed_tokens.weight": (8, 4), "model.layers.0.self_attn.q_proj.weight": (4, 4)}
    gemma2 = {**base, "model.layers.0.pre_feedforward_layernorm.weight": (4,)}
    qwen3 = {**base, "model.layers.0.self_attn.q_norm.weight": (4,)}
    gemma3 = {**gemma2, **qwen3}
    assert kind_of_file(Path("g3"), gemma3).kind == "gemma_connectors"
    assert kind_of_file(Path("g2"), gemma2).kind == kind_of_file(Path("q3"), qwen3).kind == "decoder_lm"


# --- the tokenizer -------------------------------------------------------------------------------------------


def _spiece() -> bytes:
    """A tiny SentencePiece model with Gemma's settings (BPE, no normalisation, no dummy prefix, pad 0 / eos 1 /
    bos 2 / unk 3, <start_of_turn> / <end_of_turn> user pieces, byte fallback, split digits)."""
    sentencepiece = pytest.importorskip("sentencepiece")
    buf = io.BytesIO()
    corpus = ["A red cat sits on the mat.", "Two dogs run across a green field!", "close-up, 4k, cinematic 12345"]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus * 20), model_writer=buf, minloglevel=2, character_coverage=1.0,
        hard_vocab_limit=False, byte_fallback=True, vocab_size=400, model_type="bpe", pad_id=0, eos_id=1, bos_id=2,
        unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], add_dummy_prefix=False,
        remove_extra_whitespaces=False, normalization_rule_name="identity", split_digits=True)
    return buf.getvalue()


def test_the_tokenizer_comfyuis_gemma_file_embeds(tmp_path):
    """ComfyUI's Gemma 3 file carries its tokenizer as a ``spiece_model`` tensor (``Gemma3_12BTokenizer`` reads it
    from ``tokenizer_data``): built from it, ids are SentencePiece's with <bos> first and no EOS, as Gemma's tokenizer
    (and ComfyUI's ``add_bos=True, add_eos=False``) frames them, padded on the left with <pad> 0 as LTX2Pipeline pads.
    Exact. Without it and without a companion folder, the error names ComfyUI's file and the folder to fill."""
    import sentencepiece

    from lowvram_lora.engine.caching.single_files import load_tokenizer_of
    from lowvram_lora.engine.errors import ModelLoadError

    raw = _spiece()
    sp = sentencepiece.SentencePieceProcessor(model_proto=raw)
    f = tmp_path / "gemma_3_12B_it.safetensors"
    save_file({"spiece_model": torch.ByteTensor(list(raw)), "model.embed_tokens.weight": torch.zeros(4, 2)}, str(f))
    tok = load_tokenizer_of(f, "gemma3-12b")
    for text in ["a red cat", "Two dogs, 12345 ñ", "", "<end_of_turn> x"]:
        assert tok(text).input_ids == [2] + sp.encode(text), text
    batch = tok(["a red cat", "dogs"], padding="max_length", max_length=12, truncation=True, return_tensors="pt")
    ids = [2] + sp.encode("dogs")
    assert batch.input_ids[1].tolist() == [0] * (12 - len(ids)) + ids
    assert batch.attention_mask[1].tolist() == [0] * (12 - len(ids)) + [1] * len(ids)
    bare = tmp_path / "bare" / "gemma_3_12B_it.safetensors"
    bare.parent.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(4, 2)}, str(bare))
    with pytest.raises(ModelLoadError, match=r"gemma_3_12B_it\.safetensors\), which embeds it.*bare/gemma_3_12B_it/"):
        load_tokenizer_of(bare, "gemma3-12b")


# --- the VAE -----------------------------------------------------------------------------------------------------


def test_vae_from_the_checkpoint_equals_the_folders(folder, files):
    """The video VAE read from the checkpoint's ``vae.*`` (Lightricks' names; the fixture's names map back through
    diffusers' own ``convert_ltx2_vae_to_diffusers``) holds the folder's tensors bit for bit and encodes a clip as
    the folder's ``AutoencoderKLLTX2Video`` does (exact)."""
    from diffusers import AutoencoderKLLTX2Video
    from diffusers.loaders.single_file_utils import convert_ltx2_vae_to_diffusers

    from lowvram_lora.engine.caching.single_files import load_vae_file
    from lowvram_lora.engine.families.tiny import folder_state

    want = folder_state(folder / "vae")
    bundled = {k: v for k, v in load_file(str(files["checkpoint"])).items() if k.startswith("vae.")}
    back = convert_ltx2_vae_to_diffusers(dict(bundled))
    assert set(back) == set(want) and all(torch.equal(back[k], want[k]) for k in want)
    ours = load_vae_file(files["checkpoint"], FAMILY, torch.float32, TINY)
    ref = AutoencoderKLLTX2Video.from_pretrained(folder / "vae", use_safetensors=True).eval()
    got = ours.state_dict()
    assert set(got) == set(ref.state_dict()) and all(torch.equal(got[k], v) for k, v in ref.state_dict().items())
    clip = torch.rand(1, 3, 9, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    vae = FAMILY.vae_for(TINY)
    with torch.no_grad():
        assert torch.equal(vae.encode(ours, clip), vae.encode(ref, clip))


def test_full_size_names_round_trip():
    """At LTX-2.3's full size (meta models of the shipped configs, no weights): every parameter of the 4-level
    ``AutoencoderKLLTX2Video`` written in Lightricks' layout (``original_vae_state``, from the levels) is renamed back
    by the reader's table (``diffusers_vae_state``: diffusers' 2.3 rules, up_blocks.7 / .8 included), and every
    connector parameter by ``connector_names``; the connectors are the 3,172,227,584 parameters of facts §2.2."""
    import json
    from importlib import resources

    from diffusers import AutoencoderKLLTX2Video
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    from lowvram_lora.engine.families.ltx2.comfy_files import connector_keys, connector_names, connectors_config
    from lowvram_lora.engine.families.ltx2.vae import diffusers_vae_state

    cfg = json.loads(resources.files("lowvram_lora.engine.families.ltx2").joinpath(
        "configs", "vae", "ltx2.3.json").read_text())
    with torch.device("meta"):
        vae = AutoencoderKLLTX2Video(**{k: v for k, v in cfg.items() if not k.startswith("_")})
        conn = LTX2TextConnectors(**connectors_config("ltx2.3"))
    names = {k: k for k in vae.state_dict()}
    original = original_vae_state(names)
    assert any(k.startswith("decoder.up_blocks.8.") for k in original)
    assert diffusers_vae_state(original) == {v: v for v in original.values()}
    state = conn.state_dict()
    assert sum(v.numel() for v in state.values()) == 3_172_227_584
    assert sorted(connector_names(connector_keys(state)).values()) == sorted(state)
