"""Z-Image (Tongyi-MAI, 6B single-stream DiT) on diffusers' ``ZImageTransformer2DModel`` (diffusers >= 0.36).

Facts (../../../shared/reference/new-families-facts.md §1; checked against diffusers 0.42.1
``transformer_z_image.py``, ``pipeline_z_image.py``, ``train_dreambooth_lora_z_image.py``):

- The model takes lists: ``x`` = per-sample latents (16, 1, H/8, W/8), ``cap_feats`` = per-sample caption
  features (L_i, 2560) of each caption's own length, ``t`` = 1 - sigma (the model multiplies by 1000). It
  answers a list of (16, 1, H/8, W/8) holding ``x0 - noise`` (the pipeline and the training script negate it).
- Inside: 2x2 patches, image and caption each padded to a multiple of 32 with learned pad tokens;
  ``noise_refiner`` (2 blocks, image tokens, t-modulated) runs first, then ``context_refiner`` (2 blocks,
  caption tokens, unmodulated), then the 30 ``layers`` on the joint [image, caption] sequence.
- Text: Qwen3-4B ``hidden_states[-2]`` (the raw output of 35 of its 36 layers) over the chat template with
  ``enable_thinking=True`` (which adds no ``<think>`` block), up to 512 tokens, padding dropped.
- VAE: the Flux.1 AE, ``(z - 0.1159) * 0.3611``; sampling: static shift 3 (``FlowMatchEulerDiscreteScheduler
  (shift=3.0, use_dynamic_shifting=False)``) over ``linspace(1, 1/N, N)``.

Variants. Turbo (``Tongyi-MAI/Z-Image-Turbo``, ComfyUI ``z_image_turbo_bf16.safetensors``) and Base
(``Tongyi-MAI/Z-Image``, ``z_image_bf16.safetensors``) have one transformer config: no shape tells them apart,
so both variant ids name the same shipped config and identification (the first match) says
``z-image-turbo``, the default: it is the file most users have. They differ only in how they sample:

- ``z-image-turbo``: distilled, no CFG (``guidance_scale=0.0`` in diffusers, ``cfg 1`` + zeroed negative in
  ComfyUI's template), 8 steps;
- ``z-image-base``: CFG with the pipeline's form ``pos + g (pos - neg)``, ``g = 4`` (the model card's
  ``guidance_scale=4``; diffusers' ``__call__`` default is 5), 50 steps officially (previews: 30).

Which one a file is comes from its name (``variant_from_name``): "turbo" in the file or folder name
(``z_image_turbo_bf16.safetensors``, ``Z-Image-Turbo/``) is Turbo, any other name Base
(``z_image_bf16.safetensors``, ``Z-Image/``, a fine-tune of Base).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..base import ModelFamily, image_only
from ..specs import (Guidance, LoraForm, MemoryProfile, NoiseSchedule, Prediction, PromptTemplate, StepConstants,
                     TextEncoderSpec)
from ..names import NativeParam
from .names import z_image_param_table

#: Every ``ZImageTransformerBlock``'s attention projections: diffusers' training script
#: (``target_modules=["to_k", "to_q", "to_v", "to_out.0"]``, matched by suffix) trains exactly these in all
#: 34 blocks, refiners included. Peers: DiffSynth adds the SwiGLU ``w1/w2/w3``; musubi-tuner trains attention
#: + feed-forward of the 30 main ``layers`` only (no refiners, no adaLN); ai-toolkit every Linear.
ATTENTION_TARGETS = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0")

#: diffusers' ``SEQ_MULTI_OF``: each sample's image and caption tokens are padded to a multiple of it.
SEQ_MULTI_OF = 32

#: The static timestep shift of Z-Image's scheduler (Turbo's ``scheduler_config.json``; ComfyUI's
#: ``supported_models.ZImage`` ``sampling_settings``, used for Base as well; see the report on Base's shift).
SHIFT = 3.0

_TEMPLATE = PromptTemplate(style="chat", enable_thinking=True)  # ZImagePipeline._encode_prompt


class ZImageFamily(ModelFamily):
    id = "z_image"
    display_name = "Z-Image"
    diffusers_class_name = "ZImageTransformer2DModel"
    variants = {
        "z-image-turbo": "z-image.json",  # first: what identification returns for the shared config
        "z-image-base": "z-image.json",
        # Tiny random model for tests and the demo (same architecture, width 64, 2 refiner + 2 main layers).
        "z-image-tiny": "z-image-tiny.json",
    }
    tiny_variant = "z-image-tiny"
    structural_keys = ("dim", "n_layers", "n_refiner_layers", "n_heads", "n_kv_heads", "cap_feat_dim",
                       "in_channels", "all_patch_size", "all_f_patch_size")

    # The model takes t = 1 - sigma and answers x0 - noise. Training: the static shift 3 at every resolution
    # (diffusers' script draws timesteps uniformly from the scheduler's shift-3 table, as DiffSynth and ai-toolkit
    # do; musubi's example uses 2). Sampling: ZImagePipeline computes a dynamic ``mu`` but its scheduler ignores it
    # (``use_dynamic_shifting`` false): the static shift 3 over ``linspace(1, 1/N, N)``, at every step count.
    schedule = NoiseSchedule(Prediction(timestep="one_minus_sigma", sign=-1.0), train_shift=SHIFT, sample_shift=SHIFT)
    memory = MemoryProfile(
        block_lists=("noise_refiner", "context_refiner", "layers"),  # forward order (ZImageTransformer2DModel)
        # Which rows the block Linears multiply (MemoryProfile.linear_tokens: the step-time model's FLOPs).
        block_list_tokens={"context_refiner": "text", "noise_refiner": "image"},
        modulation_linears=("adaLN_modulation.",),
        # The planner's Flux.1-fitted activation constants fit Z-Image as they are. GPU rows, 2026-11-25 (H200,
        # 1024², r16, activation offload, bench/logs/issue23_zimage_*): bf16 eager 2.45 GB measured / 2.31 GB
        # predicted (+6%), bf16 compiled 2.32 / 2.31, int8 slab compiled 2.49 / 2.49.
        activation_scale=1.0,
        width_keys=("dim",),
        # 2x2 patches of the /8 latents, padded to a multiple of 32 as the transformer runs them (1024²: 4096, no
        # padding). Caption tokens (<= 512 + padding) come on top in the joint ``layers``.
        token_multiple=SEQ_MULTI_OF,
        # The time embedding and the modulation it feeds: adaLN_modulation = (Linear) on it in the image refiner and
        # the joint layers (the caption refiner has none), (SiLU, Linear) in the final layer.
        step_constants=StepConstants(source="t_embedder", modules={
            "noise_refiner.*.adaLN_modulation.0": "same", "layers.*.adaLN_modulation.0": "same",
            "all_final_layer.*.adaLN_modulation.1": "silu"}),
    )
    lora = LoraForm(
        targets={  # in forward execution order (ZImageTransformer2DModel.forward)
            "noise_refiner": ATTENTION_TARGETS,
            "context_refiner": ATTENTION_TARGETS,
            "layers": ATTENTION_TARGETS,
        },
        architecture="z_image/lora",
        # ComfyUI maps diffusers-named Z-Image LoRAs (``transformer.layers.N.attention.to_q``) onto its fused qkv
        # (comfy/lora.py model_lora_keys_unet, model_base.Lumina2 branch, through z_image_to_diffusers).
        comfyui_form="diffusers_names",
    )
    file_help = {
        "checkpoint": "z_image_turbo_bf16.safetensors or z_image_bf16.safetensors (Base; ComfyUI's NextDiT names)",
        "pipeline": "text_encoder (Qwen3-4B; layers 0-34 are read), tokenizer, vae (the Flux.1 AE)",
        "single_files": "qwen_3_4b.safetensors (tokenizer files with Qwen3's chat template in a folder named like "
                        "it) and ae.safetensors",
    }

    # --- identity --------------------------------------------------------------------------------

    def looks_like_single_file(self, keys: set[str]) -> bool:
        """ComfyUI's NextDiT names with Z-Image's block modulation. Lumina 2 has the same layout but its
        blocks modulate through ``adaLN_modulation.1`` (SiLU first) and its files carry no pad tokens; Z-Image
        blocks have ``adaLN_modulation.0`` (no SiLU). The pad tokens are not required here, so a file
        without them is named as Z-Image and then refused with the missing tensor's name."""
        return ("layers.0.attention.qkv.weight" in keys and "layers.0.adaLN_modulation.0.weight" in keys
                and "cap_embedder.1.weight" in keys)

    def param_table(self, config: dict[str, Any]) -> list[NativeParam]:
        return z_image_param_table(config)

    # --- text ------------------------------------------------------------------------------------

    def text_encoder_specs(self, variant: str) -> tuple[TextEncoderSpec, ...]:
        """Qwen3-4B's ``hidden_states[-2]``: the output of n - 1 of its n decoder layers, no final norm,
        each caption at its own length (the pipeline drops the padding: ``prompt_embeds[i][mask[i]]``)."""
        if variant == self.tiny_variant:  # the fixtures' tiny Qwen3 has 3 layers; 32 tokens keep tests fast
            return (TextEncoderSpec("text_encoder", "tokenizer", "decoder_lm", 32, "prompt_embeds",
                                    hidden_layers=(2,), length="variable", template=_TEMPLATE),)
        return (TextEncoderSpec("text_encoder", "tokenizer", "decoder_lm", 512, "prompt_embeds",
                                hidden_layers=(35,), length="variable", template=_TEMPLATE,
                                architecture="qwen3-4b"),)

    def text_widths(self, config: dict[str, Any]) -> dict[str, int]:
        return {"prompt_embeds": int(config["cap_feat_dim"])}

    # --- latents ---------------------------------------------------------------------------------

    def latent_shape(self, model: nn.Module, width: int, height: int, frames: int = 1) -> tuple[int, ...]:
        """The Flux.1 AE's (16, H/8, W/8); the 2x2 patches are made inside the transformer."""
        image_only(self, frames)
        return (int(model.config.in_channels), height // 8, width // 8)

    def variant_from_name(self, variant: str, name: str, keys: frozenset[str] | set[str] = frozenset()) -> str:
        if variant not in ("z-image-turbo", "z-image-base"):
            return variant  # the tiny model, or a custom config
        return "z-image-turbo" if "turbo" in name.lower() else "z-image-base"

    # --- training --------------------------------------------------------------------------------

    def model_inputs(self, model: nn.Module, latents: torch.Tensor, embeds: dict[str, torch.Tensor],
                     sigmas: torch.Tensor, guidance: float) -> dict[str, Any]:
        """Keyword arguments of ``ZImageTransformer2DModel.forward`` for latents (B, 16, h, w).

        ``embeds["prompt_embeds"]`` (B, L, D) is a zero-padded batch of captions and
        ``embeds["prompt_embeds_mask"]`` (B, L) marks the real tokens; each sample gets only its real rows, as
        the pipeline passes them (the transformer pads them again with its learned ``cap_pad_token``). Without
        a mask every row is real. ``t`` is ``1 - sigma`` in fp32 (the pipeline's ``(1000 - t) / 1000``).
        ``guidance`` is unused: Z-Image has no guidance embedding."""
        prompt = embeds["prompt_embeds"]
        mask = embeds.get("prompt_embeds_mask")  # TextEncoderSpec("prompt_embeds").mask_key
        if prompt.shape[0] != latents.shape[0]:
            raise ValueError(f"Z-Image batch mismatch: {latents.shape[0]} latents, {prompt.shape[0]} captions")
        caps = []
        for i in range(prompt.shape[0]):
            rows = prompt[i] if mask is None else prompt[i][mask[i].to(prompt.device).bool()]
            caps.append(rows.to(latents.dtype))
        return {
            "x": list(latents.unsqueeze(2).unbind(0)),
            "t": self.schedule.prediction.model_timestep(sigmas.to(latents.device, torch.float32)),
            "cap_feats": caps,
            "return_dict": False,
        }

    def unpack_prediction(self, output: Any, latents: torch.Tensor) -> torch.Tensor:
        """The forward's list of (16, 1, h, w) -> (B, 16, h, w), still ``x0 - noise`` (``schedule.prediction.sign``)."""
        return torch.stack([o.squeeze(1) for o in output], dim=0)

    def guidance(self, variant: str) -> Guidance:
        if variant == "z-image-base":
            return Guidance(mode="cfg", scale=4.0, steps=30, formula="z_image")
        return Guidance(mode="none", scale=0.0, steps=8, formula="z_image")  # Turbo (and the tiny model)
