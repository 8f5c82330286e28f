"""Tiny Flux.2 fixtures, built offline: a full diffusers pipeline folder (transformer, a tiny Mistral3 or
Qwen3 text encoder with an offline tokenizer, the Flux.2 VAE with its BatchNorm, scheduler), its
transformer as a BFL single file (optionally in ComfyUI's fp8-mixed form), its text encoder and VAE as
single files, and ComfyUI's Mistral file with its embedded tekken tokenizer. Nothing is downloaded."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..tiny import add_tiny_controls  # noqa: F401  (edit pairs: Kontext / Flux.2 references)
from ..tiny import (TINY_MISTRAL_CHAT_TEMPLATE, native_state, save_tensors,
                    tiny_decoder_lm, tiny_transformer, word_level_tokenizer, write_ldm_vae_file)
from . import FAMILY


#: Qwen3's chat template (Qwen/Qwen3-4B tokenizer_config.json), the part a one-turn prompt uses: each turn between
#: <|im_start|> and <|im_end|>, the assistant prompt, and the empty thinking block when enable_thinking is False.
#: The tiny Qwen3 tokenizer carries it, so that Flux2KleinPipeline's own encoding (apply_chat_template) is the
#: reference for klein's written-out template (family.QWEN3_TEMPLATE).
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is "
    "defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
_QWEN3_MARKERS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def build_tiny_pipeline(folder: str | Path, text_encoder: str | None = None, seed: int = 0,
                        variant: str | None = None) -> Path:
    """Write a complete tiny Flux.2 diffusers pipeline folder (transformer, a tiny Mistral3 or
    Qwen3 text encoder with an offline tokenizer, the Flux.2 VAE with its BatchNorm, scheduler).
    ``variant``: ``flux2-tiny`` (default; a Mistral3) or ``flux2-klein-tiny`` (no guidance embedding; a Qwen3)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler

    folder = Path(folder)
    variant = variant or FAMILY.tiny_variant
    text_encoder = text_encoder or ("qwen3" if variant == "flux2-klein-tiny" else "mistral3")
    transformer = tiny_transformer(FAMILY, seed, variant)
    config = dict(transformer.config)
    torch.manual_seed(seed)
    specials = ["<pad>", "<s>", "</s>", "[IMG]", "<unk>"]
    if text_encoder == "qwen3":  # the chat markers as Qwen's special tokens, the turn names as words
        specials += _QWEN3_MARKERS + ["user", "assistant"]
    tokenizer, vocab = word_level_tokenizer(specials, "<s>", "</s>", "<pad>", "<unk>", 512)
    tokenizer.chat_template = TINY_MISTRAL_CHAT_TEMPLATE if text_encoder == "mistral3" else QWEN3_CHAT_TEMPLATE
    tokenizer.padding_side = "left" if text_encoder == "mistral3" else "right"
    if text_encoder == "qwen3":  # Qwen's template adds no BOS and its tokenizer adds none either
        from tokenizers import processors

        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A")
        tokenizer.add_special_tokens({"additional_special_tokens": _QWEN3_MARKERS})  # already in the vocabulary
        assert len(tokenizer) == vocab
    hidden = config["joint_attention_dim"] // 3  # three stacked hidden states per token
    lm = tiny_decoder_lm(text_encoder, vocab, hidden, 4, seed)
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


def write_single_file(pipeline_folder: str | Path, out_file: str | Path, comfy_fp8: bool = False) -> Path:
    """The pipeline's Flux.2 transformer as one BFL-named file. ``comfy_fp8`` writes it the way
    ComfyUI ships ``flux2_dev_fp8mixed.safetensors``: ``model.diffusion_model.`` prefixes, block
    Linear weights as float8_e4m3fn with a per-tensor ``weight_scale`` and a ``comfy_quant`` tag."""
    _, native = native_state(FAMILY, pipeline_folder)
    out = {}
    for name, tensor in native.items():
        if comfy_fp8 and name.endswith(".weight") and name.startswith(("double_blocks.", "single_blocks.")):
            scale = tensor.abs().max().float() / 448.0
            base = name[: -len(".weight")]
            out[f"model.diffusion_model.{name}"] = (tensor.float() / scale).to(torch.float8_e4m3fn)
            out[f"model.diffusion_model.{base}.weight_scale"] = scale.reshape(())
            out[f"model.diffusion_model.{base}.comfy_quant"] = torch.tensor(
                list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
        else:
            out[("model.diffusion_model." if comfy_fp8 else "") + name] = tensor.to(torch.bfloat16 if comfy_fp8 else tensor.dtype)
    return save_tensors(out, out_file)


def write_text_and_vae_files(pipeline_folder: str | Path, folder: str | Path) -> dict:
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
    # LDM names + bn.*, and the tiny VAE's exact config beside it (e.g. its 128 px tile size)
    vae = write_ldm_vae_file(pipeline_folder / "vae", folder / "flux2-vae.safetensors")
    return {"text_encoder": folder / "text_encoder.safetensors", "vae": vae}


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
    lm = tiny_decoder_lm("mistral3", 278, hidden, layers, seed)  # 278 = tiny tekken's vocabulary
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


def comfyui_model(config: dict) -> tuple[str, dict]:
    """What ComfyUI builds for a Flux.2 transformer of this diffusers ``config``: the ``comfy.model_base`` class
    name and the part of its ``unet_config`` that ``comfy.lora.model_lora_keys_unet`` reads (via
    ``comfy.utils.flux_to_diffusers``), with the values ``comfy.model_detection`` derives from the file."""
    return "Flux2", {"depth": config["num_layers"], "depth_single_blocks": config["num_single_layers"],
                     "hidden_size": config["num_attention_heads"] * config["attention_head_dim"]}
