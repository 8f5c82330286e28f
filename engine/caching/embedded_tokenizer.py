"""The tokenizer a ComfyUI single-file text encoder carries inside itself, as a transformers tokenizer.

ComfyUI's text-encoder files embed their tokenizer as a uint8 tensor (``comfy/sd.py`` puts it in
``tokenizer_data``): ``tekken_model`` (Mistral's tekken.json, Flux.2) and ``spiece_model`` (a SentencePiece
``.model``: umT5-XXL for Wan, Gemma-2 for Lumina 2). This module is the one place that turns such a tensor
into the tokenizer the family's pipeline uses:

- tekken: transformers' ``convert_tekken_tokenizer``, with Mistral's chat template, left padding;
- SentencePiece: transformers' own SentencePiece conversion
  (``SpmConverter.build_tokenizer_from_spm_proto``, which follows the model's normalizer, byte fallback and
  user-defined pieces so that it encodes like ``SentencePieceProcessor.encode``), given the model read here by
  a small protobuf reader: transformers' own reader needs the ``protobuf`` package, which neither ComfyUI nor
  this project requires. The special tokens added around a text and the padding side are the ones the
  pipeline's tokenizer uses (a ``SpieceLayout``, declared by the text-encoder kind whose files embed it:
  ``encoders/umt5.py`` as google/umt5-xxl's T5Tokenizer, ``encoders/decoder_lm.py`` for Gemma-2 as
  GemmaTokenizer), which are also what ComfyUI's ``SPieceTokenizer`` adds for these encoders.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from ..errors import ModelLoadError

TEKKEN, SPIECE = "tekken_model", "spiece_model"
#: Tensor names ComfyUI embeds tokenizers under, in the order they are looked for.
EMBEDDED_TENSORS = (TEKKEN, SPIECE)


@dataclass(frozen=True)
class SpieceLayout:
    """How the pipeline's tokenizer frames a SentencePiece encoding: BOS before, EOS after, and where padding
    goes."""

    bos: bool
    eos: bool
    padding_side: str = "right"
    name: str = ""  # for messages


#: Mistral's chat layout for a system + user turn without a generation prompt, as the Mistral-Small 3.x
#: processor renders it for Flux2Pipeline and as ComfyUI's Flux2 tokenizer writes it:
#: ``<s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]``. Content may be a string or text parts.
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set text = m['content'] if m['content'] is string else m['content'] | map(attribute='text') | join('') %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif m['role'] == 'user' %}[INST]{{ text }}[/INST]{% endif %}{% endfor %}"
)


def embedded_tensor(store, layout: SpieceLayout | None) -> str | None:
    """The name of the embedded tokenizer tensor in ``store`` (a TensorStore) that can serve a text encoder (a
    tekken one always: only Mistral's files carry it; a SentencePiece one when the encoder's ``layout`` is known),
    or None."""
    if TEKKEN in store:
        return TEKKEN
    if SPIECE in store and layout is not None:
        return SPIECE
    return None


def tokenizer_from_tensor(name: str, raw: bytes, layout: SpieceLayout | None):
    """The transformers tokenizer of the embedded tensor ``name`` (its bytes ``raw``), framed by ``layout`` (the
    encoder's, needed for a SentencePiece model)."""
    if name == TEKKEN:
        return _tekken(raw)
    if name != SPIECE or layout is None:
        raise ValueError(f"no conversion of an embedded {name!r} tensor without the encoder's SentencePiece layout")
    return spiece_tokenizer(raw, layout)


def _tekken(raw: bytes):
    """transformers' tekken converter, with Mistral's chat template."""
    import tempfile

    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    with tempfile.TemporaryDirectory(prefix="lowvram-tekken-") as tmp:
        (Path(tmp) / "tekken.json").write_bytes(raw)
        tokenizer = convert_tekken_tokenizer(str(Path(tmp) / "tekken.json"), chat_template=MISTRAL_CHAT_TEMPLATE)
    tokenizer.padding_side = "left"  # as transformers' Mistral tokenizer pads (and ComfyUI's Flux2 tokenizer)
    return tokenizer


# --- SentencePiece ---------------------------------------------------------------------------------------------


def spiece_tokenizer(raw: bytes, layout: SpieceLayout):
    """A transformers tokenizer (``TokenizersBackend``) from SentencePiece ``.model`` bytes: transformers'
    SentencePiece conversion, the model's own special pieces (unk, pad, bos, eos) as special tokens, and the
    layout's BOS / EOS / padding side."""
    from tokenizers import processors
    from transformers.convert_slow_tokenizer import SpmConverter
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    proto = read_spiece_model(raw)
    spec = proto.trainer_spec
    pieces = [(p.piece, p.score) for p in proto.pieces]
    if spec.model_type == 1:  # unigram: (piece, score) in id order
        vocab = pieces
    elif spec.model_type == 2:  # BPE: piece -> id; the merges are ranked by score in the converter
        vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
    else:
        raise ModelLoadError(f"the embedded SentencePiece model is of type {spec.model_type} (word / char); only "
                             f"unigram and BPE models can be converted")
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto=proto, vocab=vocab)

    def special(index: int) -> str | None:
        return proto.pieces[index].piece if 0 <= index < len(proto.pieces) else None

    tokens = {"unk_token": special(spec.unk_id), "pad_token": special(spec.pad_id),
              "bos_token": special(spec.bos_id), "eos_token": special(spec.eos_id)}
    for role, want in (("bos_token", layout.bos), ("eos_token", layout.eos)):
        if want and tokens[role] is None:
            raise ModelLoadError(f"the embedded SentencePiece model has no {role[:3].upper()} piece, which the "
                                 f"{layout.name} tokenizer adds")
    single = ([tokens["bos_token"]] if layout.bos else []) + ["$A"] + ([tokens["eos_token"]] if layout.eos else [])
    specials = [(tokens[r], getattr(spec, r[:3] + "_id")) for r, w in (("bos_token", layout.bos),
                                                                     ("eos_token", layout.eos)) if w]
    backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    tokenizer = TokenizersBackend(tokenizer_object=backend, **{k: v for k, v in tokens.items() if v is not None})
    # TokenizersBackend re-installs a post-processor from its add_bos/add_eos flags on some paths: keep ours.
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    tokenizer.padding_side = layout.padding_side
    return tokenizer


# A minimal reader of SentencePiece's ModelProto (sentencepiece_model.proto): the fields the conversion reads.
# Field numbers: ModelProto pieces 1, trainer_spec 2, normalizer_spec 3; SentencePiece piece 1, score 2, type 3;
# TrainerSpec model_type 3, byte_fallback 35, unk_id 40, bos_id 41, eos_id 42, pad_id 43, unk_piece 45;
# NormalizerSpec name 1, precompiled_charsmap 2, add_dummy_prefix 3, remove_extra_whitespaces 4,
# escape_whitespaces 5. Defaults are the proto's.


@dataclass
class _Piece:
    piece: str = ""
    score: float = 0.0
    type: int = 1  # NORMAL; 2 UNKNOWN, 3 CONTROL, 4 USER_DEFINED, 5 UNUSED, 6 BYTE


@dataclass
class _TrainerSpec:
    model_type: int = 1  # UNIGRAM
    byte_fallback: bool = False
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = -1
    unk_piece: str = "<unk>"


@dataclass
class _NormalizerSpec:
    name: str = ""
    precompiled_charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True


def _fields(buf: bytes):
    """(field number, value) of each field of one message: ints for varints, bytes for length-delimited,
    raw 4 / 8 bytes for fixed32 / fixed64."""
    pos, end = 0, len(buf)

    def varint() -> int:
        nonlocal pos
        shift = result = 0
        while True:
            if pos >= end:
                raise ValueError("truncated varint")
            b = buf[pos]
            pos += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7

    while pos < end:
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            value = varint()
        elif wire == 2:
            n = varint()
            value, pos = buf[pos:pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if pos > end:
            raise ValueError("truncated field")
        yield number, value


def _int32(v: int) -> int:
    """A varint as a signed int32 (negative ids such as pad_id = -1 are written as 10-byte varints)."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >> 63 else v


def read_spiece_model(raw: bytes) -> SimpleNamespace:
    """The pieces, trainer spec and normalizer spec of a SentencePiece ``.model`` (duck-typed like the protobuf
    ModelProto that transformers' converter reads)."""
    pieces: list[_Piece] = []
    trainer, normalizer = _TrainerSpec(), _NormalizerSpec()
    try:
        for number, value in _fields(raw):
            if number == 1:
                p = _Piece()
                for n, v in _fields(value):
                    if n == 1:
                        p.piece = v.decode("utf-8")
                    elif n == 2:
                        p.score = struct.unpack("<f", v)[0]
                    elif n == 3:
                        p.type = v
                pieces.append(p)
            elif number == 2:
                for n, v in _fields(value):
                    if n == 3:
                        trainer.model_type = v
                    elif n == 35:
                        trainer.byte_fallback = bool(v)
                    elif n in (40, 41, 42, 43):
                        setattr(trainer, {40: "unk_id", 41: "bos_id", 42: "eos_id", 43: "pad_id"}[n], _int32(v))
                    elif n == 45:
                        trainer.unk_piece = v.decode("utf-8")
            elif number == 3:
                for n, v in _fields(value):
                    if n == 1:
                        normalizer.name = v.decode("utf-8")
                    elif n == 2:
                        normalizer.precompiled_charsmap = bytes(v)
                    elif n in (3, 4, 5):
                        setattr(normalizer, {3: "add_dummy_prefix", 4: "remove_extra_whitespaces",
                                             5: "escape_whitespaces"}[n], bool(v))
    except (ValueError, UnicodeDecodeError, struct.error) as exc:
        raise ModelLoadError(f"the embedded '{SPIECE}' tensor is not a SentencePiece model ({exc})") from None
    if not pieces:
        raise ModelLoadError(f"the embedded '{SPIECE}' tensor is not a SentencePiece model (no pieces)")
    return SimpleNamespace(pieces=pieces, trainer_spec=trainer, normalizer_spec=normalizer)
