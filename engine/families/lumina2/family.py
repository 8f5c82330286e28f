"""Lumina 2 (Alpha-VLLM Lumina-Image-2.0, 2.6B) on diffusers' ``Lumina2Transformer2DModel``.

Facts used here (new-families-facts §0 and §4; checked against diffusers 0.42.1
``transformer_lumina2.py`` and ``pipelines/lumina2/pipeline_lumina2.py``):

- 26 main blocks (``layers``) plus 2 ``context_refiner`` (caption only, unmodulated) and 2
  ``noise_refiner`` (image only) blocks at width 2304, GQA (24 query heads, 8 KV heads of 96);
  the forward runs context_refiner, then noise_refiner, then layers on the joint [caption, image]
  sequence.
- Text: Gemma-2-2B, ``hidden_states[-2]`` (the output of 25 of its 26 layers, before the final norm),
  of ``system_prompt + " <Prompt Start> " + caption`` with the tokenizer's BOS, right-padded to 256 with
  a mask; the transformer reads only the valid rows (a caption is cached at its own length).
- Latents: the Flux.1 AE, ``(z - 0.1159) * 0.3611``, (16, H/8, W/8), patchified 2x2 inside the model.
- The model is given ``t = 1 - sigma`` in [0, 1] (no x1000: its timestep embedding takes t as is) and
  answers ``x0 - noise`` (the pipeline negates it before the Euler step).
- Sampling: CFG 4 on the empty negative prompt, rescaled to the conditional prediction's norm
  (``cfg_normalization``), static shift 6 (ComfyUI's ``sampling_settings``, the official sample.sh).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..base import ModelFamily, image_only
from ..specs import (Guidance, LoraForm, MemoryProfile, NoiseSchedule, Prediction, PromptTemplate, StepConstants,
                     TextEncoderSpec)
from ..names import NativeParam
from .names import UNUSED_NATIVE_KEYS, lumina2_param_table

#: Lumina2Pipeline.system_prompt (diffusers 0.42.1), the one its encode_prompt uses by default.
SYSTEM_PROMPT = ("You are an assistant designed to generate superior images with the superior degree of "
                 "image-text alignment based on textual prompts or user prompts.")
#: Lumina2Pipeline.encode_prompt: ``system_prompt + " <Prompt Start> " + prompt``.
TEMPLATE = PromptTemplate(style="plain", prefix=SYSTEM_PROMPT + " <Prompt Start> ")

#: Attention projections, diffusers' default set for Lumina 2 (train_dreambooth_lora_lumina2.py:
#: to_k, to_q, to_v, to_out.0 in every block, refiners included). Peers: diffusion-pipe trains every
#: Linear of every JointTransformerBlock (qkv, out, w1-3, adaLN, refiners too); ai-toolkit whole
#: transformer classes. In ComfyUI's layout q/k/v are one fused ``attention.qkv`` Linear.
ATTENTION = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")


def _gemma(max_length: int, last_layer: int) -> TextEncoderSpec:
    return TextEncoderSpec(
        "text_encoder", "tokenizer", "decoder_lm", max_length, "prompt_embeds",
        hidden_layers=(last_layer,),  # hidden_states[-2] of an n-layer Gemma2Model = the output of n - 1 layers
        length="variable", template=TEMPLATE, architecture="gemma2-2b",
        # Lumina2Pipeline.encode_prompt puts the system prompt before the positive prompts only: the empty
        # negative is encoded as is (Gemma: the BOS token alone).
        negative_template=PromptTemplate(),
    )


class Lumina2Memory(MemoryProfile):
    """Lumina 2's refiners checkpointed like its main blocks."""

    def checkpoint_every_block(self, model: nn.Module, undo) -> None:
        """diffusers' forward checkpoints the 26 ``layers`` only: swap in the same forward with the four
        refiner blocks checkpointed too (``parts.py``), so they stream and recompute like the rest."""
        import types

        from .parts import forward_checkpointing_every_block

        undo.set_forward(model, types.MethodType(forward_checkpointing_every_block, model))


class Lumina2Schedule(NoiseSchedule):
    """Training on Flux's resolution-linear shift, sampling at the static shift 6."""

    def train_shift_mu(self, latents: torch.Tensor) -> float:
        """Flux's resolution-linear mu (0.5 at 256 image tokens to 1.15 at 4096) on sigma.

        Why this and not the sampling shift 6 (mu 1.79): it is what Lumina's own fine-tuning applies
        (Alpha-VLLM transport.py ``do_shift``: base_shift 0.5, max_shift 1.15) and what diffusion-pipe's
        ``lumina_shift`` does (``time_shift(lin(256->0.5, 4096->1.15)((h/2)(w/2)), 1, t)`` on the noise
        fraction t, target x0 - noise, model given 1 - t); a LoRA learns the model's training
        distribution rather than the sampler's."""
        seq_len = (latents.shape[-2] // 2) * (latents.shape[-1] // 2)
        base_len, max_len, base_shift, max_shift = 256, 4096, 0.5, 1.15
        slope = (max_shift - base_shift) / (max_len - base_len)
        return seq_len * slope + (base_shift - slope * base_len)


class Lumina2Family(ModelFamily):
    id = "lumina2"
    display_name = "Lumina 2"
    diffusers_class_name = "Lumina2Transformer2DModel"
    variants = {
        "lumina2": "lumina2.json",
        # Tiny random model for the tests (GQA, 1 refiner + 2 main blocks; text: a 3-layer Gemma2Model).
        "lumina2-tiny": "lumina2-tiny.json",
    }
    tiny_variant = "lumina2-tiny"
    structural_keys = ("hidden_size", "num_layers", "num_refiner_layers", "num_attention_heads", "num_kv_heads",
                       "cap_feat_dim", "patch_size", "in_channels")

    # Lumina's model takes 1 - sigma WITHOUT x1000 and answers x0 - noise (new-families-facts §4.3). Sampling:
    # static shift 6 at every resolution (ComfyUI's Lumina2 ``sampling_settings``, Alpha-VLLM sample.sh
    # ``time_shifting_factor=6``).
    schedule = Lumina2Schedule(Prediction(timestep="one_minus_sigma", sign=-1.0), sample_shift=6.0)
    memory = Lumina2Memory(
        # Forward execution order (Lumina2Transformer2DModel.forward): captions, then image, then joint.
        block_lists=("context_refiner", "noise_refiner", "layers"),
        # Which rows the block Linears multiply (MemoryProfile.linear_tokens: the step-time model's FLOPs).
        block_list_tokens={"context_refiner": "text", "noise_refiner": "image"},
        modulation_linears=("norm1.linear",),
        # Fitted on the GPU rows of 2026-11-25 (H200, 1024², r16, every block checkpointed; bench/logs/
        # issue23_lumina2_h200_2.log): each row alone would want 1.42 (eager, activation offload: 1.69 GB measured /
        # 1.40 predicted), 0.83 (compiled, activation offload: 1.28 / 1.40) and 0.84 (compiled, no offload: 3.30 /
        # 3.41); 1.0 fits the three best (within +21% / -9% / -3%), and the 0.5 GB headroom covers the eager case.
        activation_scale=1.0,
        width_keys=("hidden_size",),
        # The time embedding (the caption embedder beside it runs on tokens) and the RMSNormZero modulation it feeds in
        # the image refiner and the joint layers (the caption refiner has none), and norm_out's.
        step_constants=StepConstants(source="time_caption_embed.timestep_embedder", modules={
            "noise_refiner.*.norm1.linear": "silu", "layers.*.norm1.linear": "silu", "norm_out.linear_1": "silu"}),
    )
    lora = LoraForm(
        targets={"context_refiner": ATTENTION, "noise_refiner": ATTENTION, "layers": ATTENTION},
        architecture="lumina2/lora",
        # ComfyUI maps diffusers-named Lumina 2 LoRAs nowhere (its Lumina2 branch uses Z-Image's names and
        # MHA offsets); native names on the fused qkv load through its generic ``diffusion_model.`` map.
        comfyui_form="native_fused",
    )
    file_help = {
        "checkpoint": "lumina_2_model_bf16.safetensors (ComfyUI's NextDiT names; the all-in-one lumina_2.safetensors "
                      "is not read)",
        "pipeline": "text_encoder (Gemma-2-2B; layers 0-24 are read), tokenizer, vae (the Flux.1 AE)",
        "single_files": "gemma_2_2b_fp16.safetensors (the tokenizer it embeds is used) and ae.safetensors",
    }
    #: ``norm_final.weight``: in real files, unused by the model (names.py).
    unused_native_keys = UNUSED_NATIVE_KEYS

    # --- identity --------------------------------------------------------------------------------

    def looks_like_single_file(self, keys: set[str]) -> bool:
        """ComfyUI's / Alpha-VLLM's NextDiT names. Z-Image shares the layout; it is told apart by its
        blocks' modulation (``adaLN_modulation.0``: no SiLU module in front) and its pad tokens."""
        return ("layers.0.attention.qkv.weight" in keys and "cap_embedder.1.weight" in keys
                and "layers.0.adaLN_modulation.1.weight" in keys
                and "x_pad_token" not in keys and "cap_pad_token" not in keys)

    def param_table(self, config: dict[str, Any]) -> list[NativeParam]:
        return lumina2_param_table(config)

    # --- text ------------------------------------------------------------------------------------

    def text_encoder_specs(self, variant: str) -> tuple[TextEncoderSpec, ...]:
        if variant == self.tiny_variant:
            return (_gemma(64, 2),)  # the fixtures' Gemma2Model has 3 layers
        return (_gemma(256, 25),)  # Gemma-2-2B: 26 layers

    def text_widths(self, config: dict[str, Any]) -> dict[str, int]:
        return {"prompt_embeds": int(config["cap_feat_dim"])}

    # --- latents ---------------------------------------------------------------------------------

    def latent_shape(self, model: nn.Module, width: int, height: int, frames: int = 1) -> tuple[int, ...]:
        image_only(self, frames)
        return (int(model.config.in_channels), height // 8, width // 8)

    # --- training --------------------------------------------------------------------------------

    def model_inputs(self, model: nn.Module, latents: torch.Tensor, embeds: dict[str, torch.Tensor],
                     sigmas: torch.Tensor, guidance: float) -> dict[str, Any]:
        """Keyword arguments of ``Lumina2Transformer2DModel.forward`` on noisy latents (B, 16, h, w).

        ``embeds["prompt_embeds"]`` (B, L, D) is right-padded with ``prompt_embeds_mask`` (B, L), 1 = a
        real token, as Lumina2Pipeline passes Gemma's: the model reads the first ``mask.sum()`` rows of
        each caption and ignores the rest (padding never changes the output). The timestep stays fp32:
        1 - sigma in bf16 would keep only 8 bits near the image end."""
        prompt = embeds["prompt_embeds"].to(latents.dtype)  # (B, L, D)
        mask = embeds.get("prompt_embeds_mask")
        if mask is None:
            mask = torch.ones(prompt.shape[:2], dtype=torch.bool, device=prompt.device)
        return {
            "hidden_states": latents,
            "timestep": self.schedule.prediction.model_timestep(sigmas.float()),
            "encoder_hidden_states": prompt,
            "encoder_attention_mask": mask.to(prompt.device).bool(),  # (B, L)
            "return_dict": False,
        }

    def unpack_prediction(self, output: Any, latents: torch.Tensor) -> torch.Tensor:
        """The model answers in the latents' layout (it unpatchifies itself); sign as given (x0 - noise)."""
        pred = output[0] if isinstance(output, (tuple, list)) else output
        if pred.shape != latents.shape:
            raise ValueError(f"Lumina 2 prediction has shape {tuple(pred.shape)}, expected {tuple(latents.shape)}")
        return pred

    def guidance(self, variant: str) -> Guidance:
        """Lumina2Pipeline: ``uncond + 4 (cond - uncond)`` rescaled to the conditional norm
        (``cfg_normalization=True``); the negative prompt is the empty string WITHOUT the system prompt."""
        return Guidance(mode="cfg", scale=4.0, steps=25, formula="standard", renormalize="last_axis")

