"""Tiny Flux.1 fixtures, built offline from configs, shared by the demo and the tests.

Everything here is a real diffusers/transformers object with small widths: a
pipeline folder (transformer, CLIP-L and T5 text encoders with working
tokenizers built from an in-memory vocabulary, VAE, scheduler), a single-file
checkpoint with BFL names written from it, and a small captioned image dataset.
Nothing is downloaded.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file

from .families import get_family, load_shipped_config
from .families.flux1_names import join_diffusers_tensors

COLORS = {
    "red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40),
    "purple": (140, 50, 170), "orange": (240, 140, 30), "white": (245, 245, 245), "black": (15, 15, 15),
}
SHAPES = ("circle", "square", "triangle")
WORDS = (
    "a", "an", "the", "photo", "of", "on", "in", "with", "and", "background", "picture", "image",
    "small", "large", "big", "little", "bright", "dark", "style", "drawing", "painting", "ohwx", "sks",
    "person", "dog", "cat", "shape", "object", "centered", "left", "right", "top", "bottom",
) + tuple(COLORS) + SHAPES


def _word_level_tokenizer(specials: list[str], bos: str | None, eos: str, pad: str, unk: str, max_length: int):
    """A real fast tokenizer over WORDS: lowercase, split on whitespace/punctuation."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(specials)}
    for w in WORDS + tuple(",.!?;:'-"):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token=unk))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()])
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A {eos}", special_tokens=[(bos, vocab[bos]), (eos, vocab[eos])]
        )
    else:
        tok.post_processor = processors.TemplateProcessing(single=f"$A {eos}", special_tokens=[(eos, vocab[eos])])
    kwargs = {"bos_token": bos} if bos else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, pad_token=pad, unk_token=unk, model_max_length=max_length, **kwargs
    ), len(vocab)


def build_tiny_flux1_pipeline(folder: str | Path, seed: int = 0) -> Path:
    """Write a complete tiny Flux.1 diffusers pipeline folder; returns its path."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    folder = Path(folder)
    torch.manual_seed(seed)
    family = get_family("flux1")
    config = load_shipped_config(family.variants["flux1-tiny"])
    transformer = family.transformer_class().from_config(config)
    _randomize_zero_inits(transformer, seed)

    clip_tok, clip_vocab = _word_level_tokenizer(
        ["<|endoftext|>", "<|startoftext|>", "<unk>"], "<|startoftext|>", "<|endoftext|>", "<|endoftext|>", "<unk>", 77
    )
    t5_tok, t5_vocab = _word_level_tokenizer(["<pad>", "</s>", "<unk>"], None, "</s>", "<pad>", "<unk>", 512)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=clip_vocab, hidden_size=config["pooled_projection_dim"], intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=77, projection_dim=32,
        bos_token_id=1, eos_token_id=0, pad_token_id=0,
    ))
    t5 = T5EncoderModel(T5Config(
        vocab_size=t5_vocab, d_model=config["joint_attention_dim"], d_kv=8, d_ff=64, num_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16), layers_per_block=1, latent_channels=config["in_channels"] // 4,
        norm_num_groups=4, sample_size=128, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tok,
        text_encoder_2=t5, tokenizer_2=t5_tok, transformer=transformer,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def _randomize_zero_inits(model: torch.nn.Module, seed: int) -> None:
    """diffusers zero-initialises some output layers; a random model with zeros there
    would ignore its inputs, which makes equality tests pass vacuously."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.abs().sum() == 0:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def write_bfl_single_file(pipeline_folder: str | Path, out_file: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write the pipeline's transformer as one safetensors file with original BFL names,
    the way ComfyUI users have Flux in models/diffusion_models/."""
    from safetensors.torch import load_file

    transformer_dir = Path(pipeline_folder) / "transformer"
    config = json.loads((transformer_dir / "config.json").read_text())
    state = {}
    for f in sorted(transformer_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    family = get_family("flux1")
    out = {}
    for param in family.param_table(config):
        tensor = join_diffusers_tensors(param, state)
        out[param.name] = (tensor.to(dtype) if dtype else tensor).contiguous()
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(out_file), metadata={"format": "pt"})
    return out_file


def make_tiny_dataset(folder: str | Path, count: int = 6, seed: int = 0, sizes=((128, 128), (160, 112), (112, 160))) -> Path:
    """Synthetic captioned images: a coloured shape on a coloured background, with a
    caption that says so, at a few aspect ratios (exercises the buckets)."""
    from PIL import Image, ImageDraw

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    names = list(COLORS)
    for i in range(count):
        w, h = sizes[i % len(sizes)]
        fg, bg = rng.sample(names, 2)
        shape = SHAPES[i % len(SHAPES)]
        img = Image.new("RGB", (w, h), COLORS[bg])
        draw = ImageDraw.Draw(img)
        r = min(w, h) // 3
        cx, cy = w // 2 + rng.randint(-8, 8), h // 2 + rng.randint(-8, 8)
        box = (cx - r, cy - r, cx + r, cy + r)
        if shape == "circle":
            draw.ellipse(box, fill=COLORS[fg])
        elif shape == "square":
            draw.rectangle(box, fill=COLORS[fg])
        else:
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLORS[fg])
        img.save(folder / f"img_{i:03d}.png")
        (folder / f"img_{i:03d}.txt").write_text(f"a {fg} {shape} on a {bg} background")
    return folder
