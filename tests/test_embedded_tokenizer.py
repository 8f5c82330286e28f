"""ComfyUI's single-file text encoders carry their SentencePiece tokenizer as a uint8 ``spiece_model`` tensor
(umT5-XXL for Wan, Gemma-2 for Lumina 2): the transformers tokenizer built from it tokenizes exactly like
(1) SentencePiece itself with the pipeline's BOS / EOS, (2) transformers' own T5Tokenizer / GemmaTokenizer of the
same .model, (3) ComfyUI's own tokenizers (run in ComfyUI's venv; set LOWVRAM_COMFYUI_DIR).

The real tokenizer files are not downloadable here: tiny SentencePiece models are trained from a few sentences
with the real ones' settings (umT5: unigram, NFKC, pad 0 / eos 1 / unk 2, no BOS, byte fallback; Gemma-2: BPE,
no normalisation, no dummy prefix, pad 0 / eos 1 / bos 2 / unk 3, user-defined pieces up to <end_of_turn> = 107,
byte fallback, split digits) and saved as ComfyUI embeds them."""
from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from lowvram_lora.engine.caching.embedded_tokenizer import read_spiece_model
from lowvram_lora.engine.caching.single_files import load_tokenizer_of, tokenizer_origin
from lowvram_lora.engine.errors import ModelLoadError

sentencepiece = pytest.importorskip("sentencepiece")

_CORPUS = ["A red cat sits on the mat.", "Two dogs run across a green field under the blue sky!",
           "A photo of a woman with long hair, wearing a hat", "The quick brown fox jumps over the lazy dog 12345",
           "Ein Hund läuft über die Straße", "一只猫坐在垫子上", "close-up, 4k, highly detailed, cinematic lighting"]
#: Captions: plain ones, repeated / edge spaces, digits, a tab and a newline, characters out of the tiny vocabulary
#: (byte fallback), NFKC-folded ones (ﬁ, ①), an empty caption, Gemma's <end_of_turn>.
TEXTS = ["a red cat", "A photo of a  woman,   wearing a hat", "dogs run 12345", "Straße 猫 😀 ñ",
         "  leading and trailing  ", "tab\tand\nnewline", "", "<end_of_turn> x", "ÀÉÎ ﬁ ①",
         "close-up of a cat, cinematic lighting"]
#: Text transformers' model-specific classes are compared on: their T5Tokenizer drops SentencePiece's byte fallback
#: (out-of-vocabulary characters become <unk>, where SentencePiece, ComfyUI and ours give bytes) and, built without
#: protobuf, has no NFKC table; these captions need neither.
PLAIN = ["a red cat", "A photo of a  woman,   wearing a hat", "dogs run 12345", "  leading and trailing  ",
         "close-up of a cat, cinematic lighting", ""]
GEMMA_USER = ["<mask>", "<2mass>", "[@BOS@]"] + [f"<unused{i}>" for i in range(99)] + ["<start_of_turn>",
                                                                                      "<end_of_turn>"]


def _train(encoder: str, byte_fallback: bool = True) -> bytes:
    buf = io.BytesIO()
    common = dict(sentence_iterator=iter(_CORPUS * 20), model_writer=buf, minloglevel=2, character_coverage=0.99,
                  hard_vocab_limit=False, byte_fallback=byte_fallback)
    if encoder == "umt5xxl":
        sentencepiece.SentencePieceTrainer.train(**common, vocab_size=400 if byte_fallback else 120,
                                                 model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
    else:
        sentencepiece.SentencePieceTrainer.train(
            **common, vocab_size=520, model_type="bpe", pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
            eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>", user_defined_symbols=GEMMA_USER,
            add_dummy_prefix=False, remove_extra_whitespaces=False, normalization_rule_name="identity",
            split_digits=True)
    return buf.getvalue()


MODELS = {"umt5": ("umt5xxl", True), "umt5-no-byte-fallback": ("umt5xxl", False), "gemma2": ("gemma2-2b", True)}


@pytest.fixture(scope="module")
def models():
    return {k: _train(*v) for k, v in MODELS.items()}


def comfy_file(path: Path, raw: bytes, extra: dict | None = None) -> Path:
    """A text-encoder file as ComfyUI has it: weights plus the tokenizer's .model bytes as a uint8 ``spiece_model``
    (what ``SPieceTokenizer.serialize_model`` gives: ``torch.ByteTensor(list(model_proto))``)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"spiece_model": torch.ByteTensor(list(raw)), **(extra or {"shared.weight": torch.zeros(4, 2)})},
              str(path))
    return path


def _spm_ids(raw: bytes, encoder: str, text: str) -> list[int]:
    """SentencePiece's ids framed as the pipelines' tokenizers frame them (stated here, not read from the code
    under test): umT5 (google/umt5-xxl's T5Tokenizer) appends </s> = 1; Gemma's tokenizer puts <bos> = 2 first."""
    ids = sentencepiece.SentencePieceProcessor(model_proto=raw).encode(text)
    return ids + [1] if encoder == "umt5xxl" else [2] + ids


@pytest.mark.parametrize("name", list(MODELS))
def test_encodes_like_sentencepiece_with_the_pipelines_special_tokens(models, name, tmp_path):
    """Ids equal SentencePiece's (umT5: EOS appended; Gemma-2: BOS first), pad 0 on the right, as WanPipeline's
    and Lumina2Pipeline's tokenizers pad. Exact."""
    encoder, _ = MODELS[name]
    raw = models[name]
    tok = load_tokenizer_of(comfy_file(tmp_path / "te.safetensors", raw), encoder)
    for text in TEXTS:
        assert tok(text).input_ids == _spm_ids(raw, encoder, text), text
    assert (tok.pad_token_id, tok.eos_token_id, tok.padding_side) == (0, 1, "right")
    assert tok.bos_token_id == (2 if encoder == "gemma2-2b" else None)
    batch = tok(["a red cat", "dogs"], padding="max_length", max_length=12, truncation=True, return_tensors="pt")
    short = _spm_ids(raw, encoder, "dogs")
    assert batch.input_ids[1].tolist() == short + [0] * (12 - len(short))
    assert batch.attention_mask[1].tolist() == [1] * len(short) + [0] * (12 - len(short))


def _transformers_reference(raw: bytes, encoder: str, folder: Path):
    """transformers' own tokenizer class of the same .model: from_pretrained on a folder holding it where protobuf
    (which transformers' SentencePiece reader needs) is installed, else the class built from SentencePiece's own
    pieces and scores."""
    from transformers import GemmaTokenizer, T5Tokenizer

    try:
        import google.protobuf  # noqa: F401
        folder.mkdir(parents=True, exist_ok=True)
        if encoder == "umt5xxl":
            (folder / "spiece.model").write_bytes(raw)
            return T5Tokenizer.from_pretrained(folder, extra_ids=0), True
        (folder / "tokenizer.model").write_bytes(raw)
        return GemmaTokenizer.from_pretrained(folder, add_bos_token=True), True
    except ImportError:
        from transformers.convert_slow_tokenizer import generate_merges

        sp = sentencepiece.SentencePieceProcessor(model_proto=raw)
        pieces = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
        if encoder == "umt5xxl":
            return T5Tokenizer(vocab=pieces, extra_ids=0), False
        vocab = {p: i for i, (p, _) in enumerate(pieces)}
        return GemmaTokenizer(vocab=vocab, merges=generate_merges(vocab, dict(pieces)), add_bos_token=True), False


@pytest.mark.parametrize("name", list(MODELS))
def test_encodes_like_transformers_own_tokenizer_of_the_same_model(models, name, tmp_path):
    """Against T5Tokenizer / GemmaTokenizer (add_bos_token, as Gemma's tokenizer_config has it) of the same .model:
    equal ids on plain captions; with protobuf (from_pretrained) the Gemma tokenizer also on every caption."""
    encoder, byte_fallback = MODELS[name]
    raw = models[name]
    ours = load_tokenizer_of(comfy_file(tmp_path / "te.safetensors", raw), encoder)
    ref, full = _transformers_reference(raw, encoder, tmp_path / "ref")
    texts = TEXTS if full and (encoder == "gemma2-2b" or not byte_fallback) else PLAIN
    for text in texts:
        assert ours(text).input_ids == ref(text).input_ids, text
    ref.padding_side = "right"  # Lumina2Pipeline sets it on Gemma's tokenizer (left by default); T5's already is
    assert ours(PLAIN, padding="longest").input_ids == ref(PLAIN, padding="longest").input_ids


def test_the_reader_reads_what_sentencepiece_reads(models):
    """The small protobuf reader (no protobuf package needed) against SentencePiece's own accessors."""
    for name, raw in models.items():
        proto, sp = read_spiece_model(raw), sentencepiece.SentencePieceProcessor(model_proto=raw)
        assert len(proto.pieces) == sp.get_piece_size()
        for i, p in enumerate(proto.pieces):
            assert p.piece == sp.id_to_piece(i) and p.score == pytest.approx(sp.get_score(i), abs=0), (name, i)
            assert (p.type == 3) == sp.is_control(i) and (p.type == 2) == sp.is_unknown(i), (name, i)
            assert (p.type == 6) == sp.is_byte(i), (name, i)
        spec = proto.trainer_spec
        assert (spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id) == (sp.unk_id(), sp.bos_id(), sp.eos_id(),
                                                                        sp.pad_id()), name
        assert spec.byte_fallback == MODELS[name][1]
        assert proto.normalizer_spec.add_dummy_prefix == (MODELS[name][0] == "umt5xxl")
    with pytest.raises(ModelLoadError, match="not a SentencePiece model"):
        read_spiece_model(b"\x0a\xff\xff")


def test_companion_folder_wins_then_the_embedded_one_then_errors_name_the_fix(models, tmp_path):
    """Order: a companion tokenizer folder, the embedded tensor, ComfyUI's bundled folder; nothing: an error
    naming the file, the tensors looked for and the fixes. An embedded SentencePiece model of an encoder whose
    framing is unknown (a Qwen3 file, say) is not guessed at."""
    f = comfy_file(tmp_path / "text_encoders" / "umt5_xxl_fp16.safetensors", models["umt5"])
    assert tokenizer_origin(f, "umt5xxl") == "spiece_model"
    bundled = tmp_path / "bundled"
    bundled.mkdir()
    assert tokenizer_origin(f, "umt5xxl", "umt5xxl", {"umt5xxl": bundled}) == "spiece_model"
    own = f.with_suffix("")
    own.mkdir()
    (own / "spiece.model").write_bytes(models["umt5"])
    assert tokenizer_origin(f, "umt5xxl") == own == tokenizer_origin(f, "qwen3-4b")
    (own / "spiece.model").unlink()
    with pytest.raises(ModelLoadError, match=r"no tokenizer for 'umt5_xxl_fp16.safetensors'.*'spiece_model'.*"
                                             r"text_encoders/umt5_xxl_fp16/"):
        tokenizer_origin(f, "qwen3-4b")
    bare = tmp_path / "text_encoders" / "gemma_2_2b_fp16.safetensors"
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(4, 2)}, str(bare))
    with pytest.raises(ModelLoadError) as err:
        tokenizer_origin(bare, "gemma2-2b")
    msg = str(err.value)
    assert "'gemma_2_2b_fp16.safetensors'" in msg and "'spiece_model'" in msg and "'tekken_model'" in msg
    assert "use ComfyUI's own file (gemma_2_2b_fp16.safetensors)" in msg
    assert f"'{bare.with_suffix('')}/'" in msg and "bundled" not in msg  # ComfyUI bundles no Gemma tokenizer


def _comfyui_python() -> Path | None:
    comfy = os.environ.get("LOWVRAM_COMFYUI_DIR")
    if not comfy:
        return None
    return Path(os.environ.get("LOWVRAM_COMFYUI_PYTHON", Path(comfy) / "venv" / "bin" / "python"))


_COMFY_PROBE = r"""
import json, sys
comfy_dir, path, texts_file, encoder = sys.argv[1:5]
sys.path.insert(0, comfy_dir)
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
from safetensors.torch import load_file
import comfy.text_encoders.lumina2 as lumina2
import comfy.text_encoders.wan as wan
from comfy.text_encoders.spiece_tokenizer import SPieceTokenizer

spiece = load_file(path)["spiece_model"]
texts = json.load(open(texts_file))
if encoder == "umt5xxl":
    family, raw = wan.WanT5Tokenizer(tokenizer_data={"spiece_model": spiece}), SPieceTokenizer(spiece, add_eos=True)
else:
    family = lumina2.LuminaTokenizer(tokenizer_data={"spiece_model": spiece})
    raw = SPieceTokenizer(spiece, add_bos=True, add_eos=False, special_tokens={"<end_of_turn>": 107})
out = {}
for t in texts:
    (batches,) = family.tokenize_with_weights(t).values()
    out[t] = {"family": [[int(x[0]) for x in b] for b in batches], "spiece": list(raw(t)["input_ids"])}
print("RESULT" + json.dumps(out))
"""


@pytest.mark.skipif(_comfyui_python() is None, reason="needs ComfyUI (set LOWVRAM_COMFYUI_DIR)")
@pytest.mark.parametrize("name", list(MODELS))
def test_encodes_like_comfyuis_own_tokenizers(models, name, tmp_path):
    """ComfyUI's SPieceTokenizer as its Wan / Lumina 2 tokenizers configure it, and those tokenizers whole
    (WanT5Tokenizer pads to 512 with 0; LuminaTokenizer adds BOS, no padding), run in ComfyUI's venv from the
    same file: equal ids, the umT5 ones padded to 512 as ours pad. Exact."""
    encoder, _ = MODELS[name]
    path = comfy_file(tmp_path / "te.safetensors", models[name])
    # ComfyUI parses (word:weight) (none of these use it); with "<end_of_turn>" in a caption its SPieceTokenizer
    # drops the BOS (the parts around a special token are encoded without it): left out.
    texts = [t for t in TEXTS if "(" not in t and "<end_of_turn>" not in t]
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    (tmp_path / "probe.py").write_text(_COMFY_PROBE)
    comfy = os.environ["LOWVRAM_COMFYUI_DIR"]
    proc = subprocess.run([str(_comfyui_python()), str(tmp_path / "probe.py"), comfy, str(path),
                           str(tmp_path / "texts.json"), encoder], capture_output=True, text=True, cwd=comfy,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.rsplit("RESULT", 1)[1])
    tok = load_tokenizer_of(path, encoder)
    for text in texts:
        ours = tok(text).input_ids
        assert ours == got[text]["spiece"], text
        if encoder == "umt5xxl":
            ours = tok(text, padding="max_length", max_length=512).input_ids
        assert [ours] == got[text]["family"], text


# --- through the families' single-file paths --------------------------------------------------------------------


def _companion_config(path: Path, model) -> None:
    """The tiny model's config.json alone in the companion folder (a real file takes the shipped config)."""
    own = path.with_suffix("")
    own.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(str(own / "config.json"))


@torch.no_grad()
def test_wan_umt5_file_with_its_embedded_tokenizer_encodes_as_wanpipeline(models, tmp_path):
    """A ComfyUI-style umT5 file (``shared`` + encoder, ``spiece_model``, no tokenizer folder) through
    ``load_text_encoder_file`` and ``encode_captions`` equals WanPipeline's ``_get_t5_prompt_embeds`` run on the
    same model with transformers' T5Tokenizer of the same .model (plain captions: see PLAIN). 1e-5."""
    from types import SimpleNamespace

    from diffusers import WanPipeline

    from lowvram_lora.engine.caching.single_files import load_text_encoder_file, text_encoder_kind
    from lowvram_lora.engine.caching.text_encoding import encode_captions
    from lowvram_lora.engine.families import get_family
    from lowvram_lora.engine.families.wan.fixtures import tiny_umt5

    raw = models["umt5"]
    model = tiny_umt5(sentencepiece.SentencePieceProcessor(model_proto=raw).get_piece_size(), 32, 0)
    weights = {k: v.clone() for k, v in model.state_dict().items() if "embed_tokens" not in k}
    f = comfy_file(tmp_path / "text_encoders" / "umt5_xxl_fp16.safetensors", raw, weights)
    _companion_config(f, model)
    assert text_encoder_kind(f) == "umt5xxl" and tokenizer_origin(f, "umt5xxl") == "spiece_model"
    spec = get_family("wan").text_encoder_specs("wan-tiny")[0]
    captions = [c for c in PLAIN if c.strip()]
    ours = encode_captions(None, spec, captions, torch.device("cpu"), torch.float32, spec.max_length,
                           loader=lambda: load_text_encoder_file(f, torch.float32, {}))
    ref_tok, _ = _transformers_reference(raw, "umt5xxl", tmp_path / "ref")
    pipe = SimpleNamespace(tokenizer=ref_tok, text_encoder=model)
    ref = WanPipeline._get_t5_prompt_embeds(pipe, captions, max_sequence_length=spec.max_length,
                                            device=torch.device("cpu"), dtype=torch.float32)
    torch.testing.assert_close(torch.stack(ours), ref, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_lumina2_gemma_file_with_its_embedded_tokenizer_encodes_as_lumina2pipeline(models, tmp_path):
    """A ComfyUI-style Gemma-2 file (``model.`` names, ``spiece_model``, no tokenizer folder) through
    ``decoder_lm_source`` and the family's template: ids are SentencePiece's with BOS of Lumina's
    ``system_prompt + " <Prompt Start> " + caption`` (the negative: BOS alone), and ``encode_stacked`` equals the
    Gemma2Model's output of layer 2 on those ids (Lumina2Pipeline's hidden_states[-2] of 3 layers). 1e-5."""
    from transformers import Gemma2Config, Gemma2Model

    from lowvram_lora.engine.caching.single_files import decoder_lm_source
    from lowvram_lora.engine.caching.stacked_text import encode_stacked
    from lowvram_lora.engine.families import get_family
    from lowvram_lora.engine.families.lumina2.family import SYSTEM_PROMPT
    from lowvram_lora.engine.families.lumina2.fixtures import TINY_GEMMA

    raw = models["gemma2"]
    sp = sentencepiece.SentencePieceProcessor(model_proto=raw)
    torch.manual_seed(0)
    model = Gemma2Model(Gemma2Config(vocab_size=sp.get_piece_size(), **TINY_GEMMA)).eval()
    f = comfy_file(tmp_path / "text_encoders" / "gemma_2_2b_fp16.safetensors", raw,
                   {f"model.{k}": v.clone() for k, v in model.state_dict().items()})
    _companion_config(f, model)
    family = get_family("lumina2")
    (spec,) = family.text_encoder_specs(family.tiny_variant)
    files, config, tok = decoder_lm_source(f, family, spec)
    captions = ["a red cat", "close-up of a cat, cinematic lighting"]
    ids, mask = spec.template.tokenize(tok, captions, 512, pad_to_max=False)
    for row, m, caption in zip(ids, mask, captions):
        assert row[m.bool()].tolist() == [2] + sp.encode(f"{SYSTEM_PROMPT} <Prompt Start> {caption}")
    neg, _ = spec.negative_template.tokenize(tok, [""], 512, pad_to_max=False)
    assert neg.tolist() == [[2]]
    got = encode_stacked(None, spec, captions, torch.device("cpu"), torch.float32, 512, source=(files, config, tok))
    for out, caption in zip(got, captions):
        ref_ids = torch.tensor([[2] + sp.encode(f"{SYSTEM_PROMPT} <Prompt Start> {caption}")])
        ref = model(input_ids=ref_ids, output_hidden_states=True).hidden_states[spec.hidden_layers[0]][0]
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
