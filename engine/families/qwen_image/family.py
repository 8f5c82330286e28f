"""Qwen-Image (20B MMDiT) on diffusers' ``QwenImageTransformer2DModel`` (diffusers >= 0.39 forward).

Facts (../../../shared/reference/new-families-facts.md §2; checked against diffusers 0.42.1
``transformer_qwenimage.py``, ``pipeline_qwenimage.py``, ``train_dreambooth_lora_qwen_image.py``):

- 60 double-stream ``transformer_blocks`` (680 MB bf16 / 340 MB int8 each, modulation inside every block),
  joint attention over [text, image]; every Linear has a bias.
- The forward takes 2x2-packed latents (B, N, 64) (Flux.1's packing), the raw Qwen2.5-VL states (B, L, 3584)
  with ``encoder_hidden_states_mask`` (B, L), ``timestep`` = sigma (scaled by 1000 inside) and ``img_shapes``
  = one ``(1, h/2, w/2)`` per sample. It answers the velocity ``noise - x0``.
- Text: Qwen2.5-VL-7B's language model, ``hidden_states[-1]`` (all 28 layers and the final norm) over the
  pipeline's system template, the first 34 template tokens dropped, each caption at its own length.
- VAE: the Wan 2.1 causal 3-D VAE (``AutoencoderKLQwenImage``), one frame, per-channel mean/std.
- Sampling: true CFG ``neg + s (cond - neg)`` rescaled per packed token to the conditional norm, s = 4; sigmas
  ``linspace(1, 1/N, N)`` under the dynamic shift mu = 0.5 at 256 tokens .. 0.9 at 8192, stretched so the last
  one is 0.02 (the hub scheduler config: ``shift_terminal``).
- Training: diffusers' script draws sigmas without shift (its scheduler config has dynamic shifting, so the
  table is unshifted); mu = 0 here.

Qwen-Image-Edit (Edit, Edit-2509, Edit-2511) has the same transformer shape and conditions on control images twice
(diffusers 0.42.1 ``QwenImageEditPipeline`` / ``QwenImageEditPlusPipeline``):
- the prompt: the control images go through Qwen2.5-VL's vision tower into the prompt (``edit_text.py``);
- reference latents: each control image VAE-encoded (``controls.py``), packed 2x2 and appended to the noisy target's
  tokens; ``img_shapes`` lists the target then each control (the RoPE frame index tells them apart); the prediction
  is cut back to the target's tokens. 2511 (``zero_cond_t``) modulates the reference tokens with timestep 0 (inside
  the transformer, from ``img_shapes``). The cached control latents reach ``model_inputs`` in ``embeds`` under
  ``control_latents_0``, ``control_latents_1``, ... (``CONTROL_KEY``), each (B, 16, h_k, w_k) like a target latent.
Which one a file is: its name ("edit", "2509", "2511") or, for 2511, the ``__index_timestep_zero__`` flag tensor
ComfyUI's 2511 file carries (``variant_from_name`` with the file's keys).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from ..base import ModelFamily, image_only
from ..specs import (ControlImages, Guidance, LoraForm, MemoryProfile, NoiseSchedule, PromptTemplate, StepConstants,
                     TextEncoderSpec, VaeSpec, sigma_schedule)
from ..names import NativeParam
from ..patches import linear_mu, pack_2x2, unpack_2x2
from ..wan_vae import WanVaeSpec
from ..specs.controls import check_control_batch, control_latents
from .names import qwen_image_param_table

#: Both streams' attention projections in every block: what DiffSynth's and musubi-tuner's Qwen-Image LoRAs
#: train (musubi adds the MLPs, DiffSynth the modulation too; diffusers' script trains the image stream only).
#: 8 Linears of 3072x3072 in 60 blocks, less the 2 whose output nothing reads (``QwenImageLora.target_modules``):
#: 478 modules, 47.0 M parameters at rank 16.
ATTENTION_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                     "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
#: The MLPs of both streams (musubi-tuner's set adds these): +59.0 M parameters at rank 16.
MLP_TARGETS = ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")

#: QwenImagePipeline.prompt_template_encode, written out as text (the pipeline formats it; no chat template).
SYSTEM_PREFIX = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                 "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
#: ``prompt_template_encode_start_idx``: the system turn and "<|im_start|>user\n" are 34 Qwen2 tokens.
DROP = 34
#: The tiny fixtures' word-level tokenizer cuts the same prefix into this many tokens (test_family checks it).
TINY_DROP = 31

#: The hub scheduler config (Qwen/Qwen-Image scheduler_config.json, as embedded in ai-toolkit):
#: dynamic shift between these token counts and shifts, then the terminal stretch.
BASE_SEQ, MAX_SEQ, BASE_SHIFT, MAX_SHIFT, SHIFT_TERMINAL = 256, 8192, 0.5, 0.9, 0.02

_TEMPLATE = PromptTemplate(style="plain", prefix=SYSTEM_PREFIX, suffix=SUFFIX)

#: How each variant conditions on control images: "" (text-to-image), "edit" (QwenImageEditPipeline: one control
#: image at the target's 1024² area, also the VL prompt image) or "plus" (QwenImageEditPlusPipeline: 1..n control
#: images, the VL prompt at 384², the references at 1024²; 2509 and 2511).
EDIT_MODE = {"qwen-image": "", "qwen-image-tiny": "", "qwen-image-edit": "edit", "qwen-image-edit-2509": "plus",
             "qwen-image-edit-2511": "plus", "qwen-image-edit-tiny": "plus", "qwen-image-edit-2511-tiny": "plus"}
#: The flag tensor ComfyUI's 2511 file carries (comfy/model_detection.py: ``default_ref_method="index_timestep_zero"``).
INDEX_TIMESTEP_ZERO = "__index_timestep_zero__"


class QwenImageMemory(MemoryProfile):
    """Qwen-Image's token-wise parts: both streams' MLPs."""

    def install_chunked_recompute(self, model: nn.Module, chunks: int, undo) -> None:
        """Every block's feed-forward (``img_mlp``, ``txt_mlp``: token-wise, the widest intermediates of a block) in
        checkpointed token chunks."""
        from ..recompute import chunk_token_wise

        for block in model.transformer_blocks:
            chunk_token_wise(block.img_mlp, chunks, undo)
            chunk_token_wise(block.txt_mlp, chunks, undo)


class QwenImageStepConstants(StepConstants):
    """2511 (``zero_cond_t``) embeds the timesteps of a doubled batch (the sample's, then 0 for the reference tokens):
    the image modulation reads both halves, the text modulation and ``norm_out`` the first (as the forward chunks it)."""

    def module_input(self, name: str, form: str, vector: torch.Tensor, config: dict) -> torch.Tensor:
        if config.get("zero_cond_t") and (".txt_mod." in name or name.startswith("norm_out.")):
            vector = torch.chunk(vector, 2, dim=0)[0]
        return super().module_input(name, form, vector, config)


class QwenImageSchedule(NoiseSchedule):
    """The hub scheduler's dynamic shift and terminal stretch when sampling (training: no shift)."""

    def sample_shift_mu(self, latents: torch.Tensor, steps: int) -> float:
        """QwenImagePipeline's ``calculate_shift`` over the image tokens, with the hub scheduler's constants."""
        return linear_mu((latents.shape[-2] // 2) * (latents.shape[-1] // 2), BASE_SEQ, MAX_SEQ, BASE_SHIFT, MAX_SHIFT)

    def sample_sigmas(self, latents: torch.Tensor, steps: int) -> list[float]:
        """The shifted schedule stretched so its last sigma is ``SHIFT_TERMINAL`` (FlowMatchEulerDiscreteScheduler
        ``stretch_shift_to_terminal``), then 0."""
        shifted = sigma_schedule(steps, self.sample_shift_mu(latents, steps))[:-1]
        scale = (1.0 - shifted[-1]) / (1.0 - SHIFT_TERMINAL)
        if scale <= 0:  # one step: sigma 1 cannot be stretched (the scheduler would divide by zero)
            return shifted + [0.0]
        return [1.0 - (1.0 - s) / scale for s in shifted] + [0.0]


class QwenImageLora(LoraForm):
    """Qwen-Image's targets less the last block's dead text-stream outputs."""

    def target_modules(self, model: nn.Module) -> list[str]:
        """``targets`` in every block, less the last block's text-query and text-output projections
        (``attn.add_q_proj``, ``attn.to_add_out``) and text MLP: the model's output is the image stream alone,
        so the last block's text-stream results feed nothing and a LoRA there could never learn (its gradient is
        zero, and ComfyUI would still patch it)."""
        last = f"transformer_blocks.{len(model.transformer_blocks) - 1}."
        dead = tuple(last + t for t in ("attn.add_q_proj", "attn.to_add_out", "txt_mlp."))
        return [m for m in super().target_modules(model) if not m.startswith(dead)]


#: The Wan 2.1 causal 3-D VAE as Qwen-Image ships it, one frame.
QWEN_IMAGE_VAE = WanVaeSpec(class_name="AutoencoderKLQwenImage", config_package=__package__,
                            single_file_config="qwen_image")


class QwenImageFamily(ModelFamily):
    id = "qwen_image"
    display_name = "Qwen-Image"
    diffusers_class_name = "QwenImageTransformer2DModel"
    variants = {
        "qwen-image": "qwen-image.json",  # Qwen-Image and Qwen-Image-2512 (same shapes)
        "qwen-image-tiny": "qwen-image-tiny.json",  # tests and the demo (width 32, 2 blocks)
        # Edit variants: the same shapes (only 2511's zero_cond_t differs), told apart by name (variant_from_name).
        "qwen-image-edit": "qwen-image.json",
        "qwen-image-edit-2509": "qwen-image.json",
        "qwen-image-edit-2511": "qwen-image-edit-2511.json",  # zero_cond_t: reference tokens modulated at t = 0
        "qwen-image-edit-tiny": "qwen-image-tiny.json",  # tests: EditPlus on the tiny transformer
        "qwen-image-edit-2511-tiny": "qwen-image-edit-2511-tiny.json",
    }
    tiny_variant = "qwen-image-tiny"
    structural_keys = ("num_layers", "attention_head_dim", "num_attention_heads", "joint_attention_dim",
                       "in_channels", "out_channels", "patch_size", "zero_cond_t", "use_additional_t_cond")
    unused_native_keys = ("__index_timestep_zero__",)

    # Training draws sigmas without shift (diffusers' script: its scheduler config has dynamic shifting, so the
    # table is unshifted): shift 1, mu = 0. The model answers the velocity at timestep sigma (the default prediction).
    schedule = QwenImageSchedule(train_shift=1.0)
    memory = QwenImageMemory(
        block_lists=("transformer_blocks",),
        # Which rows the block Linears multiply (MemoryProfile.linear_tokens: the step-time model's FLOPs).
        modulation_linears=("img_mod.", "txt_mod."),
        text_linears=("attn.add_", "attn.to_add_out", "txt_mlp."),
        dual_stream_lists=("transformer_blocks",),
        chunked_recompute=True,  # install_chunked_recompute: both streams' MLPs in token chunks
        # The time embedding and the AdaLN modulation it feeds: (SiLU, Linear) per stream in every block, norm_out's.
        step_constants=QwenImageStepConstants(source="time_text_embed", modules={
            "transformer_blocks.*.img_mod.1": "silu", "transformer_blocks.*.txt_mod.1": "silu", "norm_out.linear": "silu"}),
    )
    lora = QwenImageLora(
        targets={"transformer_blocks": ATTENTION_TARGETS},
        architecture="qwen_image/lora",
        # ComfyUI maps diffusers-named Qwen-Image LoRAs as they are (comfy/lora.py, QwenImage branch:
        # ``transformer.<name>`` and the bare name).
        comfyui_form="diffusers_names",
    )
    file_help = {
        "checkpoint": "qwen_image_bf16.safetensors, qwen_image_fp8_e4m3fn.safetensors or the 2512 release "
                      "(diffusers names)",
        "pipeline": "text_encoder (Qwen2.5-VL-7B; its 28 language-model layers are read), tokenizer, vae "
                    "(AutoencoderKLQwenImage)",
        "single_files": "qwen_2.5_vl_7b_fp8_scaled.safetensors (or qwen_2.5_vl_7b.safetensors; inside ComfyUI its "
                        "bundled Qwen2.5 tokenizer is used) and qwen_image_vae.safetensors",
    }

    # --- identity --------------------------------------------------------------------------------

    def looks_like_single_file(self, keys: set[str]) -> bool:
        """ComfyUI's own test (model_detection: ``txt_norm.weight``) plus the double-stream block modulation."""
        return "txt_norm.weight" in keys and "transformer_blocks.0.img_mod.1.weight" in keys

    def param_table(self, config: dict[str, Any]) -> list[NativeParam]:
        return qwen_image_param_table(self, config)

    def variant_from_name(self, variant: str, name: str, keys: frozenset[str] | set[str] = frozenset()) -> str:
        """Edit, 2509 and 2511 share Qwen-Image's shapes; the file or folder name tells them apart, as ComfyUI's
        names do (``qwen_image_edit_fp8_e4m3fn``, ``qwen_image_edit_2509_*``, ``qwen_image_edit_2511_bf16``; the hub's
        ``Qwen-Image-Edit-2509``). A config with ``zero_cond_t`` is 2511 whatever its name, and so is a single file
        with ComfyUI's flag tensor ``__index_timestep_zero__`` (in ``keys``), even when renamed."""
        tiny = variant in (self.tiny_variant, "qwen-image-edit-tiny", "qwen-image-edit-2511-tiny")
        if INDEX_TIMESTEP_ZERO in keys:
            return "qwen-image-edit-2511-tiny" if tiny else "qwen-image-edit-2511"
        lowered = name.lower()
        if variant in ("qwen-image-edit-2511", "qwen-image-edit-2511-tiny") or "2511" in lowered and "edit" in lowered:
            return "qwen-image-edit-2511-tiny" if tiny else "qwen-image-edit-2511"
        if "edit" not in lowered:
            return variant
        if tiny:
            return "qwen-image-edit-tiny"
        return "qwen-image-edit-2509" if "2509" in lowered else "qwen-image-edit"

    def edit_mode(self, variant: str) -> str:
        """"" (text-to-image), "edit" or "plus" (``EDIT_MODE``): which Edit pipeline ``variant`` follows."""
        if variant not in EDIT_MODE:
            raise ConfigError(f"unknown Qwen-Image variant {variant!r}; known: {', '.join(EDIT_MODE)}")
        return EDIT_MODE[variant]

    def control_images(self, variant: str) -> ControlImages | None:
        """Edit variants: the control images through ``edit_text.encode_edit_prompts`` (Edit: one image; EditPlus:
        any number) and ``controls.encode_controls`` at ``edit_areas``; text-to-image variants take none."""
        mode = EDIT_MODE.get(variant, "")
        if not mode:
            return None
        from .controls import control_embeds, control_size, encode_controls
        from .edit_text import encode_edit_prompts

        areas = self.edit_areas(variant)

        def encode_prompts(captions, images, processor, parts, drop, dtype):
            return encode_edit_prompts(captions, images, mode, processor, parts.visual, parts.embed_tokens,
                                       parts.config, parts.language_model, drop=drop, dtype=dtype, **areas)

        return ControlImages(
            max_count=1 if mode == "edit" else None,
            ident=(mode, areas["condition_area"], areas["vae_area"]),
            size=lambda width, height: control_size(width, height, areas["vae_area"]),
            encode_prompts=encode_prompts,
            encode_latents=lambda vae, images: control_embeds(encode_controls(vae, images, area=areas["vae_area"])))

    def edit_areas(self, variant: str) -> dict[str, int]:
        """The pixel areas an Edit variant sees its control images at: ``condition_area`` (EditPlus's VL prompt image,
        384²) and ``vae_area`` (the reference latents, and Edit's VL image: 1024²), as ``edit_text.prompt_images`` and
        ``controls.encode_controls`` take them. The tiny test variants use 64² and 96² (the stand-ins test_edit.py
        patches into the pipelines), so CPU tests stay seconds long."""
        from .edit_text import CONDITION_AREA, VAE_AREA

        if not self.edit_mode(variant):
            raise ConfigError(f"{variant} is not an Edit variant; it takes no control images")
        if variant.endswith("-tiny"):
            return {"condition_area": 64 * 64, "vae_area": 96 * 96}
        return {"condition_area": CONDITION_AREA, "vae_area": VAE_AREA}

    # --- text ------------------------------------------------------------------------------------

    def text_encoder_specs(self, variant: str) -> tuple[TextEncoderSpec, ...]:
        """Qwen2.5-VL-7B's ``hidden_states[-1]`` (28 layers + the final norm), the template's first 34 tokens
        dropped, each caption at its own length (the pipeline's ``_get_qwen_prompt_embeds``)."""
        if self.edit_mode(variant):
            return (self._edit_text_spec(variant),)
        if variant == self.tiny_variant:  # the fixtures' tiny Qwen2.5-VL has 2 layers
            return (TextEncoderSpec("text_encoder", "tokenizer", "decoder_lm", 32, "prompt_embeds", hidden_layers=(2,),
                                    length="variable", template=_TEMPLATE, final_norm=True, drop_tokens=TINY_DROP),)
        return (TextEncoderSpec("text_encoder", "tokenizer", "decoder_lm", 512, "prompt_embeds", hidden_layers=(28,),
                                length="variable", template=_TEMPLATE, architecture="qwen2.5-vl-7b",
                                final_norm=True, drop_tokens=DROP, comfyui_tokenizer="qwen25_tokenizer"),)

    def _edit_text_spec(self, variant: str) -> TextEncoderSpec:
        """Edit: the Edit system turn (64 tokens dropped), the control images in the prompt (``control_images``: the
        cache encodes it with ``edit_text.encode_edit_prompts`` over ``caching/vl_text`` parts, not text alone). The
        pipelines do not truncate the multimodal prompt; ``max_length`` only bounds the instruction's own tokens."""
        from .edit_text import EDIT_DROP, EDIT_SYSTEM, SUFFIX as EDIT_SUFFIX

        template = PromptTemplate(style="plain", prefix=EDIT_SYSTEM, suffix=EDIT_SUFFIX)
        tiny = variant.endswith("-tiny")
        return TextEncoderSpec("text_encoder", "tokenizer", "decoder_lm", 32 if tiny else 1024, "prompt_embeds",
                               hidden_layers=(2,) if tiny else (28,), length="variable", template=template,
                               architecture="" if tiny else "qwen2.5-vl-7b", final_norm=True, drop_tokens=EDIT_DROP,
                               comfyui_tokenizer="" if tiny else "qwen25_tokenizer", control_images=True)

    def text_widths(self, config: dict[str, Any]) -> dict[str, int]:
        return {"prompt_embeds": int(config["joint_attention_dim"])}

    # --- latents ---------------------------------------------------------------------------------

    def vae_for(self, variant: str | None) -> VaeSpec:
        return QWEN_IMAGE_VAE

    def latent_shape(self, model: nn.Module, width: int, height: int, frames: int = 1) -> tuple[int, ...]:
        """(16, H/8, W/8): one frame of the VAE, the frame axis dropped (packed 2x2 in ``model_inputs``)."""
        image_only(self, frames)
        return (int(model.config.in_channels) // 4, height // 8, width // 8)

    # --- training --------------------------------------------------------------------------------

    def model_inputs(self, model: nn.Module, latents: torch.Tensor, embeds: dict[str, torch.Tensor],
                     sigmas: torch.Tensor, guidance: float) -> dict[str, Any]:
        """Keyword arguments of ``QwenImageTransformer2DModel.forward`` for latents (B, 16, h, w): packed 2x2,
        the zero-padded captions with their mask (all real without one), sigma, one image shape per sample.
        ``guidance`` is unused (``guidance_embeds`` is false).

        Edit: the control latents in ``embeds`` (``control_latents_0``, ``_1``, ...) are packed and appended to the
        target's tokens and listed after it in ``img_shapes``, as QwenImageEditPlusPipeline (and Edit, with one)
        does; ``unpack_prediction`` keeps the target's tokens."""
        b, _, h, w = latents.shape
        controls = control_latents(embeds)
        prompt = embeds["prompt_embeds"].to(latents.dtype)
        if prompt.shape[0] != b:
            raise ValueError(f"Qwen-Image batch mismatch: {b} latents, {prompt.shape[0]} captions")
        mask = embeds.get("prompt_embeds_mask")  # TextEncoderSpec("prompt_embeds").mask_key
        if mask is None:
            mask = torch.ones(prompt.shape[:2], dtype=torch.long)
        check_control_batch("Qwen-Image-Edit", controls, latents)
        hidden = torch.cat([pack_2x2(latents)] + [pack_2x2(c.to(latents.device, latents.dtype)) for c in controls],
                           dim=1)
        shapes = [(1, h // 2, w // 2)] + [(1, c.shape[-2] // 2, c.shape[-1] // 2) for c in controls]
        return {
            "hidden_states": hidden,
            "encoder_hidden_states": prompt,
            "encoder_hidden_states_mask": mask.to(latents.device),
            "timestep": self.schedule.prediction.model_timestep(sigmas.to(latents.device)).to(latents.dtype),
            "img_shapes": [list(shapes)] * b,
            "return_dict": False,
        }

    def unpack_prediction(self, output: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The target's tokens (the first h/2 * w/2; an Edit forward also answers for the control tokens) unpacked."""
        h, w = latents.shape[-2], latents.shape[-1]
        return unpack_2x2(output[:, : (h // 2) * (w // 2)], h, w)

    def guidance(self, variant: str) -> Guidance:
        """True CFG 4 (the pipeline's ``true_cfg_scale`` default) against the negative prompt, rescaled per
        packed token to the conditional prediction's norm; 20 preview steps (ComfyUI's template: 20)."""
        return Guidance(mode="cfg", scale=4.0, steps=20, formula="standard", renormalize="patch_tokens")

