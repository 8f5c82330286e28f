"""Tiny real models for fixtures: word-level tokenizers, small decoder LMs, the LDM VAE names.

Shared by every family's ``fixtures.py`` (tests and the demo build tiny pipelines offline, from
configs; nothing is downloaded).
"""
from __future__ import annotations

import torch

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


def word_level_tokenizer(specials: list[str], bos: str | None, eos: str, pad: str, unk: str, max_length: int):
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


def randomize_zero_inits(model: torch.nn.Module, seed: int) -> None:
    """diffusers zero-initialises some output layers; a random model with zeros there
    would ignore its inputs, which makes equality tests pass vacuously."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.abs().sum() == 0:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


#: A chat template in the shape Mistral's uses (system + user turns, content given as a list
#: of {"type": "text"} parts, as Flux2Pipeline passes it); the tiny vocabulary has no
#: [INST] tokens, so the turns are joined with plain words.
TINY_MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% for part in message['content'] %}"
    "{% if message['role'] == 'system' %}{{ part['text'] }} : {% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endfor %}"
)
#: Qwen3's shape: string content, an assistant prompt when asked for one.
TINY_QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %} .{% endif %}"
)


def tiny_decoder_lm(kind: str, vocab: int, hidden: int, layers: int, seed: int):
    """A tiny Mistral3ForConditionalGeneration (Flux.2-dev's text encoder class, with a tiny
    Pixtral tower) or Qwen3ForCausalLM (klein's)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=64,
                  rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if kind == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(**common))
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = Mistral3Config(
        text_config={"model_type": "mistral", **common},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "head_dim": 8, "image_size": 32, "patch_size": 8},
        image_token_index=3, spatial_merge_size=2, projector_hidden_act="gelu",
    )
    return Mistral3ForConditionalGeneration(config)


def ldm_vae_key(key: str, num_blocks: int) -> str:
    """diffusers AutoencoderKL name -> the BFL/LDM name in ae.safetensors (the inverse of diffusers'
    ``convert_ldm_vae_checkpoint``), for writing test files in the layout users have."""
    import re

    key = key.replace("conv_norm_out", "norm_out")
    rules = (
        (r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", lambda m: f"encoder.down.{m[1]}.block.{m[2]}.{m[3]}"),
        (r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)", lambda m: f"encoder.down.{m[1]}.downsample.conv.{m[2]}"),
        (r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)",
         lambda m: f"decoder.up.{num_blocks - 1 - int(m[1])}.block.{m[2]}.{m[3]}"),
        (r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.*)",
         lambda m: f"decoder.up.{num_blocks - 1 - int(m[1])}.upsample.conv.{m[2]}"),
        (r"(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.*)", lambda m: f"{m[1]}.mid.block_{int(m[2]) + 1}.{m[3]}"),
    )
    for pattern, fn in rules:
        m = re.fullmatch(pattern, key)
        if m:
            return fn(m).replace("conv_shortcut", "nin_shortcut")
    m = re.fullmatch(r"(encoder|decoder)\.mid_block\.attentions\.0\.(group_norm|to_q|to_k|to_v|to_out\.0)\.(.*)", key)
    if m:
        part = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}[m[2]]
        return f"{m[1]}.mid.attn_1.{part}.{m[3]}"
    return key




def folder_state(folder) -> dict:
    """Every tensor of a diffusers component folder's safetensors files (shards merged)."""
    from pathlib import Path

    from safetensors.torch import load_file

    state = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def native_state(family, pipeline_folder) -> tuple[dict, dict]:
    """(config, tensors under the family's native names) of a pipeline folder's transformer: what a native
    single file holds (``family.param_table``; fused tensors joined)."""
    import json
    from pathlib import Path

    from .names import join_diffusers_tensors

    transformer = Path(pipeline_folder) / "transformer"
    config = json.loads((transformer / "config.json").read_text())
    state = folder_state(transformer)
    return config, {p.name: join_diffusers_tensors(p, state).contiguous() for p in family.param_table(config)}


def save_tensors(tensors: dict, out_file):
    """A test file written as users have them (``format: pt`` metadata); returns its path."""
    from pathlib import Path

    from safetensors.torch import save_file

    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_file), metadata={"format": "pt"})
    return out_file


def write_decoder_lm_files(pipeline_folder, folder, name: str) -> dict:
    """A tiny pipeline's decoder-LLM text encoder and VAE as ComfyUI's single files: ``<name>.safetensors`` with
    ``model.`` names (as ``qwen_3_4b.safetensors`` / ``gemma_2_2b_fp16.safetensors``) with a companion folder
    ``<name>/`` (the tiny config and tokenizer, which a real file takes from the shipped configs and the user),
    and ``ae.safetensors`` with BFL/LDM names. Returns {"text_encoder": path, "vae": path}."""
    import shutil
    from pathlib import Path

    pipeline_folder, folder = Path(pipeline_folder), Path(folder)
    state = {("" if k.startswith("model.") else "model.") + k: v
             for k, v in folder_state(pipeline_folder / "text_encoder").items()}
    text_file = save_tensors(state, folder / f"{name}.safetensors")
    companion = folder / name
    shutil.copytree(pipeline_folder / "tokenizer", companion, dirs_exist_ok=True)
    shutil.copy(pipeline_folder / "text_encoder" / "config.json", companion / "config.json")
    return {"text_encoder": text_file, "vae": write_ldm_vae_file(pipeline_folder / "vae", folder / "ae.safetensors")}


def tiny_transformer(family, seed: int = 0, variant: str | None = None):
    """The family's tiny variant (or ``variant``) with random weights (none left at zero: see
    ``randomize_zero_inits``)."""
    torch.manual_seed(seed)
    model = family.transformer_class().from_config(family.load_config(variant or family.tiny_variant))
    randomize_zero_inits(model, seed)
    return model


def tiny_flux_ae(latent_channels: int = 16):
    """A tiny AutoencoderKL with the Flux.1 AE's layout and constants (Flux.1, Z-Image and Lumina 2 share it)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16), layers_per_block=1, latent_channels=latent_channels,
        norm_num_groups=4, sample_size=128, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False,
    )


def write_ldm_vae_file(vae_folder, out_file):
    """A diffusers AutoencoderKL folder as one file with BFL/LDM names (ComfyUI's ``ae.safetensors``), with a
    companion folder (the file name without ``.safetensors``) holding the tiny config."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    vae_folder, out_file = Path(vae_folder), Path(out_file)
    config = json.loads((vae_folder / "config.json").read_text())
    state = folder_state(vae_folder)
    ldm = {}
    for k, v in state.items():
        key = ldm_vae_key(k, len(config["block_out_channels"]))
        ldm[key] = (v[:, :, None, None] if ".mid.attn_1." in key and key.endswith(".weight") and v.ndim == 2
                    else v).contiguous()
    out_file.parent.mkdir(parents=True, exist_ok=True)
    save_file(ldm, str(out_file))
    companion = out_file.with_suffix("")
    companion.mkdir(exist_ok=True)
    shutil.copy(vae_folder / "config.json", companion / "config.json")
    return out_file


def wan_vae_original_key(key: str) -> str:
    """diffusers ``AutoencoderKLWan`` / ``AutoencoderKLQwenImage`` name -> the original Wan name ComfyUI's
    ``wan_2.1_vae.safetensors`` and ``qwen_image_vae.safetensors`` use (the inverse of diffusers'
    ``convert_wan_vae_to_diffusers``, for the Wan 2.1 layout: 2 residual blocks per level, 4 levels), for
    writing test files in the layout users have."""
    import re

    resnet = (("norm1.gamma", "residual.0.gamma"), ("conv1.", "residual.2."), ("norm2.gamma", "residual.3.gamma"),
              ("conv2.", "residual.6."), ("conv_shortcut.", "shortcut."))

    def res(rest: str) -> str:
        for a, b in resnet:
            if rest.startswith(a):
                return b + rest[len(a):]
        return rest

    fixed = {"quant_conv.": "conv1.", "post_quant_conv.": "conv2.", "encoder.conv_in.": "encoder.conv1.",
             "decoder.conv_in.": "decoder.conv1.", "encoder.norm_out.": "encoder.head.0.",
             "decoder.norm_out.": "decoder.head.0.", "encoder.conv_out.": "encoder.head.2.",
             "decoder.conv_out.": "decoder.head.2."}
    for a, b in fixed.items():
        if key.startswith(a):
            return b + key[len(a):]
    m = re.fullmatch(r"(encoder|decoder)\.mid_block\.resnets\.(\d)\.(.*)", key)
    if m:
        return f"{m[1]}.middle.{2 * int(m[2])}.{res(m[3])}"
    m = re.fullmatch(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.*)", key)
    if m:
        return f"{m[1]}.middle.1.{m[2]}"
    m = re.fullmatch(r"encoder\.down_blocks\.(\d+)\.(.*)", key)
    if m:
        return f"encoder.downsamples.{m[1]}.{res(m[2])}"
    m = re.fullmatch(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", key)
    if m:
        return f"decoder.upsamples.{4 * int(m[1]) + int(m[2])}.{res(m[3])}"
    m = re.fullmatch(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.*)", key)
    if m:
        return f"decoder.upsamples.{4 * int(m[1]) + 3}.{m[2]}"
    return key


def write_wan_vae_file(vae_folder, out_file):
    """A diffusers Wan-2.1-type VAE folder as one file with the original Wan names (ComfyUI's), with a companion
    folder (the file name without ``.safetensors``) holding the tiny config."""
    import shutil
    from pathlib import Path

    vae_folder, out_file = Path(vae_folder), Path(out_file)
    save_tensors({wan_vae_original_key(k): v for k, v in folder_state(vae_folder).items()}, out_file)
    companion = out_file.with_suffix("")
    companion.mkdir(exist_ok=True)
    shutil.copy(vae_folder / "config.json", companion / "config.json")
    return out_file


def add_tiny_controls(folder):
    """Turn a tiny captioned dataset (``engine.testing.make_tiny_dataset``) into a pairs dataset in the documented
    layout (``docs/edit_datasets.md``): its images are the targets, each caption becomes an instruction, and
    ``control/<stem>.png`` is the target with its colours inverted, at 3/4 size (so the reference latent has its own
    shape)."""
    from pathlib import Path

    from PIL import Image, ImageOps

    folder = Path(folder)
    control = folder / "control"
    control.mkdir(exist_ok=True)
    for target in sorted(folder.glob("*.png")):
        with Image.open(target) as img:
            ImageOps.invert(img.convert("RGB")).resize((img.width * 3 // 4, img.height * 3 // 4)).save(
                control / target.name)
        caption = target.with_suffix(".txt")
        caption.write_text("invert the colours: " + caption.read_text())
    return folder
