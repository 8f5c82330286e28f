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
from .families.names import join_diffusers_tensors
from .families.tiny import (COLORS, SHAPES, TINY_MISTRAL_CHAT_TEMPLATE, TINY_QWEN3_CHAT_TEMPLATE, WORDS,  # noqa: F401
                            ldm_vae_key as _ldm_vae_key, randomize_zero_inits as _randomize_zero_inits,
                            tiny_decoder_lm as _tiny_decoder_lm, word_level_tokenizer as _word_level_tokenizer)

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


# --- Flux.2 -------------------------------------------------------------------------

def build_tiny_flux2_pipeline(folder: str | Path, text_encoder: str = "mistral3", seed: int = 0) -> Path:
    """Write a complete tiny Flux.2 diffusers pipeline folder (transformer, a tiny Mistral3 or
    Qwen3 text encoder with an offline tokenizer, the Flux.2 VAE with its BatchNorm, scheduler)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler

    folder = Path(folder)
    torch.manual_seed(seed)
    family = get_family("flux2")
    config = load_shipped_config(family.variants["flux2-tiny"])
    transformer = family.transformer_class().from_config(config)
    _randomize_zero_inits(transformer, seed)
    specials = ["<pad>", "<s>", "</s>", "[IMG]", "<unk>"]
    tokenizer, vocab = _word_level_tokenizer(specials, "<s>", "</s>", "<pad>", "<unk>", 512)
    tokenizer.chat_template = TINY_MISTRAL_CHAT_TEMPLATE if text_encoder == "mistral3" else TINY_QWEN3_CHAT_TEMPLATE
    tokenizer.padding_side = "left" if text_encoder == "mistral3" else "right"
    if text_encoder == "qwen3":  # Qwen's template adds no BOS and its tokenizer adds none either
        from tokenizers import processors

        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A")
    hidden = config["joint_attention_dim"] // 3  # three stacked hidden states per token
    lm = _tiny_decoder_lm(text_encoder, vocab, hidden, 4, seed)
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 16, 16, 16), layers_per_block=1, latent_channels=config["in_channels"] // 4,
        norm_num_groups=4, sample_size=128, use_quant_conv=False, use_post_quant_conv=False,
    )
    with torch.no_grad():  # BatchNorm statistics as a trained VAE has them (not 0 / 1)
        vae.bn.running_mean.copy_(torch.randn(vae.bn.running_mean.shape) * 0.1)
        vae.bn.running_var.copy_(torch.rand(vae.bn.running_var.shape) + 0.5)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in (("transformer", transformer), ("vae", vae), ("text_encoder", lm)):
        part.save_pretrained(folder / name, safe_serialization=True)
    tokenizer.save_pretrained(folder / "tokenizer")
    scheduler.save_pretrained(folder / "scheduler")
    pipeline_class = "Flux2Pipeline" if text_encoder == "mistral3" else "Flux2KleinPipeline"
    (folder / "model_index.json").write_text(json.dumps({
        "_class_name": pipeline_class, "_diffusers_version": "0.42.1",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", type(lm).__name__],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": ["diffusers", "Flux2Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLFlux2"],
    }, indent=2))
    return folder


def write_flux2_single_file(pipeline_folder: str | Path, out_file: str | Path, comfy_fp8: bool = False) -> Path:
    """The pipeline's Flux.2 transformer as one BFL-named file. ``comfy_fp8`` writes it the way
    ComfyUI ships ``flux2_dev_fp8mixed.safetensors``: ``model.diffusion_model.`` prefixes, block
    Linear weights as float8_e4m3fn with a per-tensor ``weight_scale`` and a ``comfy_quant`` tag."""
    from safetensors.torch import load_file

    transformer_dir = Path(pipeline_folder) / "transformer"
    config = json.loads((transformer_dir / "config.json").read_text())
    state = {}
    for f in sorted(transformer_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    out = {}
    for param in get_family("flux2").param_table(config):
        tensor = join_diffusers_tensors(param, state).contiguous()
        name = param.name
        if comfy_fp8 and name.endswith(".weight") and name.startswith(("double_blocks.", "single_blocks.")):
            scale = tensor.abs().max().float() / 448.0
            base = name[: -len(".weight")]
            out[f"model.diffusion_model.{name}"] = (tensor.float() / scale).to(torch.float8_e4m3fn)
            out[f"model.diffusion_model.{base}.weight_scale"] = scale.reshape(())
            out[f"model.diffusion_model.{base}.comfy_quant"] = torch.tensor(
                list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
        else:
            out[("model.diffusion_model." if comfy_fp8 else "") + name] = tensor.to(torch.bfloat16 if comfy_fp8 else tensor.dtype)
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(out_file), metadata={"format": "pt"})
    return out_file


def write_flux1_single_files(pipeline_folder: str | Path, folder: str | Path, with_tokenizers: bool = True) -> dict:
    """The tiny pipeline's text encoders and VAE as the single files ComfyUI users keep:
    ``clip_l.safetensors`` (``text_model.`` names), ``t5xxl.safetensors`` and ``ae.safetensors`` (BFL/LDM
    names), each with a companion folder holding its (tiny) config and, optionally, its tokenizer."""
    import shutil

    from safetensors.torch import load_file

    pipeline_folder, folder = Path(pipeline_folder), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, sub, tok, prefix in (("clip_l", "text_encoder", "tokenizer", "text_model."),
                                   ("t5xxl", "text_encoder_2", "tokenizer_2", "")):
        state = {}
        for f in sorted((pipeline_folder / sub).glob("*.safetensors")):
            state.update(load_file(str(f)))
        state = {(prefix + k if prefix and not k.startswith(prefix) else k): v.contiguous() for k, v in state.items()}
        save_file(state, str(folder / f"{name}.safetensors"))
        companion = folder / name
        companion.mkdir(exist_ok=True)
        shutil.copy(pipeline_folder / sub / "config.json", companion / "config.json")
        if with_tokenizers:
            for f in (pipeline_folder / tok).iterdir():
                shutil.copy(f, companion / f.name)
        out[name] = folder / f"{name}.safetensors"
    vae_config = json.loads((pipeline_folder / "vae" / "config.json").read_text())
    state = {}
    for f in sorted((pipeline_folder / "vae").glob("*.safetensors")):
        state.update(load_file(str(f)))
    ldm = {}
    for k, v in state.items():
        key = _ldm_vae_key(k, len(vae_config["block_out_channels"]))
        ldm[key] = (v[:, :, None, None] if ".mid.attn_1." in key and key.endswith(".weight") and v.ndim == 2
                    else v).contiguous()
    save_file(ldm, str(folder / "ae.safetensors"))
    (folder / "ae").mkdir(exist_ok=True)
    shutil.copy(pipeline_folder / "vae" / "config.json", folder / "ae" / "config.json")
    out["vae"] = folder / "ae.safetensors"
    return out


def write_flux2_text_and_vae_files(pipeline_folder: str | Path, folder: str | Path) -> dict:
    """The tiny Flux.2 pipeline's text encoder and VAE as single files in ComfyUI's layout: the decoder's
    weights under ``model.`` names (as ``mistral_3_small_flux2_bf16.safetensors`` has them; the vision tower
    and lm_head are not in such files), with a companion folder holding the tiny config and tokenizer; the
    VAE with BFL/LDM names plus ``bn.*``."""
    import shutil

    from safetensors.torch import load_file

    pipeline_folder, folder = Path(pipeline_folder), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for f in sorted((pipeline_folder / "text_encoder").glob("*.safetensors")):
        state.update(load_file(str(f)))
    lm = {}
    for k, v in state.items():
        for prefix in ("model.language_model.", "language_model.model.", "model."):
            if k.startswith(prefix) and "vision" not in k and "multi_modal" not in k:
                lm["model." + k[len(prefix):]] = v.contiguous()
                break
    save_file(lm, str(folder / "text_encoder.safetensors"))
    companion = folder / "text_encoder"
    shutil.copytree(pipeline_folder / "tokenizer", companion)
    shutil.copy(pipeline_folder / "text_encoder" / "config.json", companion / "config.json")
    vae_config = json.loads((pipeline_folder / "vae" / "config.json").read_text())
    vstate = {}
    for f in sorted((pipeline_folder / "vae").glob("*.safetensors")):
        vstate.update(load_file(str(f)))
    ldm = {}
    for k, v in vstate.items():
        key = _ldm_vae_key(k, len(vae_config["block_out_channels"]))
        ldm[key] = (v[:, :, None, None] if ".mid.attn_1." in key and key.endswith(".weight") and v.ndim == 2
                    else v).contiguous()
    save_file(ldm, str(folder / "flux2-vae.safetensors"))
    (folder / "flux2-vae").mkdir(exist_ok=True)  # the tiny VAE's exact config (e.g. its 128 px tile size)
    shutil.copy(pipeline_folder / "vae" / "config.json", folder / "flux2-vae" / "config.json")
    return {"text_encoder": folder / "text_encoder.safetensors", "vae": folder / "flux2-vae.safetensors"}


def tiny_tekken_json() -> bytes:
    """A tiny but well-formed tekken.json (Mistral's tokenizer format): the 256 byte tokens, three merges,
    and Mistral's special tokens in their real ranks (<pad> = 11, [SYSTEM_PROMPT] = 17)."""
    import base64

    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
                "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
    vocab = [{"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(), "token_str": None} for i in range(256)]
    for j, w in enumerate((b"a ", b"ca", b"cat")):
        vocab.append({"rank": 256 + j, "token_bytes": base64.b64encode(w).decode(), "token_str": None})
    pattern = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
               r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
    return json.dumps({"config": {"pattern": pattern, "default_vocab_size": len(vocab) + len(specials),
                                  "default_num_special_tokens": len(specials)},
                       "vocab": vocab,
                       "special_tokens": [{"rank": i, "token_str": t, "is_control": True}
                                          for i, t in enumerate(specials)]}).encode()


def write_comfy_mistral_file(out_file: str | Path, hidden: int = 16, layers: int = 4, seed: int = 0) -> Path:
    """A tiny Mistral text encoder as ComfyUI ships ``mistral_3_small_flux2_bf16.safetensors``: ``model.``
    names and the tekken tokenizer embedded as a uint8 ``tekken_model`` tensor; its tiny config in the
    companion folder (the real file needs none: the shipped Mistral-Small config fits it)."""
    lm = _tiny_decoder_lm("mistral3", 278, hidden, layers, seed)  # 278 = tiny tekken's vocabulary
    state = {}
    for k, v in lm.state_dict().items():
        if k.startswith("model.language_model."):
            state["model." + k[len("model.language_model."):]] = v.contiguous()
    state["tekken_model"] = torch.tensor(list(tiny_tekken_json()), dtype=torch.uint8)
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_file))
    companion = out_file.with_suffix("")
    companion.mkdir(exist_ok=True)
    (companion / "config.json").write_text(lm.config.to_json_string())
    lm.save_pretrained(companion.parent / (companion.name + "-full"), safe_serialization=True)  # the reference
    return out_file
