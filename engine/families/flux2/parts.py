"""Flux.2 double blocks in two parts (diffusers 0.37-0.42 ``Flux2TransformerBlock``): attention, then the
feed-forwards, each diffusers' arithmetic in the same order (``engine/offload/units.py`` streams them)."""
from __future__ import annotations

import torch
from torch import nn


class DoubleAttention(nn.Module):
    """The first part of diffusers' Flux2TransformerBlock.forward (0.37-0.42): the modulated norms, joint
    attention and the gated attention residuals. The global modulation passes through to the second part.
    Same arithmetic in the same order as diffusers."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.norm1, self.norm1_context, self.attn = block.norm1, block.norm1_context, block.attn

    def forward(self, hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt, image_rotary_emb=None,
                joint_attention_kwargs=None):
        from diffusers.models.transformers.transformer_flux2 import Flux2Modulation

        (shift_msa, scale_msa, gate_msa), _ = Flux2Modulation.split(temb_mod_img, 2)
        (c_shift_msa, c_scale_msa, c_gate_msa), _ = Flux2Modulation.split(temb_mod_txt, 2)
        norm_hidden_states = (1 + scale_msa) * self.norm1(hidden_states) + shift_msa
        norm_encoder_hidden_states = (1 + c_scale_msa) * self.norm1_context(encoder_hidden_states) + c_shift_msa
        attn_output, context_attn_output = self.attn(
            hidden_states=norm_hidden_states, encoder_hidden_states=norm_encoder_hidden_states,
            image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
        hidden_states = hidden_states + gate_msa * attn_output
        encoder_hidden_states = encoder_hidden_states + c_gate_msa * context_attn_output
        return hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt


class DoubleFeedForward(nn.Module):
    """The rest of Flux2TransformerBlock.forward: both streams' feed-forwards with their gated residuals."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.norm2, self.ff, self.norm2_context, self.ff_context = (
            block.norm2, block.ff, block.norm2_context, block.ff_context)

    def forward(self, hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt):
        from diffusers.models.transformers.transformer_flux2 import Flux2Modulation

        _, (shift_mlp, scale_mlp, gate_mlp) = Flux2Modulation.split(temb_mod_img, 2)
        _, (c_shift_mlp, c_scale_mlp, c_gate_mlp) = Flux2Modulation.split(temb_mod_txt, 2)
        norm_hidden_states = self.norm2(hidden_states) * (1 + scale_mlp) + shift_mlp
        hidden_states = hidden_states + gate_mlp * self.ff(norm_hidden_states)
        norm_encoder_hidden_states = self.norm2_context(encoder_hidden_states) * (1 + c_scale_mlp) + c_shift_mlp
        encoder_hidden_states = encoder_hidden_states + c_gate_mlp * self.ff_context(norm_encoder_hidden_states)
        if encoder_hidden_states.dtype == torch.float16:
            encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
        return encoder_hidden_states, hidden_states
