"""Flux.1 blocks in parts (diffusers 0.37-0.42 ``FluxTransformerBlock`` / ``FluxSingleTransformerBlock``).

Double blocks stream as two parts (``engine/offload/units.py``): modulation + attention, then the
feed-forwards; single blocks run the part after attention in token chunks. Each forward is diffusers'
arithmetic in the same order.
"""
from __future__ import annotations

import torch
from torch import nn

from ...errors import ConfigError
from ..recompute import run_in_token_chunks


def single_block_forward_chunked(chunks: int):
    """diffusers' FluxSingleTransformerBlock.forward (0.37-0.42), with the part after attention in
    token chunks. Same arithmetic, in the same order, per token."""
    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                joint_attention_kwargs=None):
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
        attn_output = self.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                                **(joint_attention_kwargs or {}))
        gate = gate.unsqueeze(1)

        def rest(residual, normed, attn):
            mlp = self.act_mlp(self.proj_mlp(normed))
            return residual + gate * self.proj_out(torch.cat([attn, mlp], dim=2))

        out = run_in_token_chunks(rest, hidden_states, norm_hidden_states, attn_output, chunks=chunks)
        if out.dtype == torch.float16:
            out = out.clip(-65504, 65504)
        return out[:, :text_seq_len], out[:, text_seq_len:]

    return forward


class DoubleAttention(nn.Module):
    """The first part of diffusers' FluxTransformerBlock.forward (0.37-0.42): modulation, joint attention
    and the gated attention residuals. Returns the residual streams and the feed-forward's modulation,
    the inputs of ``DoubleFeedForward``. Same arithmetic in the same order as diffusers."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.norm1, self.norm1_context, self.attn = block.norm1, block.norm1_context, block.attn

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                joint_attention_kwargs=None):
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)
        norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
            encoder_hidden_states, emb=temb)
        attention_outputs = self.attn(hidden_states=norm_hidden_states,
                                      encoder_hidden_states=norm_encoder_hidden_states,
                                      image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
        if len(attention_outputs) != 2:
            raise ConfigError("this Flux.1 model's attention returns IP-adapter outputs; streaming a double block "
                              "in parts does not carry them. Train without the IP-adapter, or with "
                              "activation_offload off (whole blocks)")
        attn_output, context_attn_output = attention_outputs
        hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output
        encoder_hidden_states = encoder_hidden_states + c_gate_msa.unsqueeze(1) * context_attn_output
        return (hidden_states, encoder_hidden_states, shift_mlp, scale_mlp, gate_mlp,
                c_shift_mlp, c_scale_mlp, c_gate_mlp)


class DoubleFeedForward(nn.Module):
    """The rest of FluxTransformerBlock.forward: both streams' feed-forwards with their gated residuals."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.norm2, self.ff, self.norm2_context, self.ff_context = (
            block.norm2, block.ff, block.norm2_context, block.ff_context)

    def forward(self, hidden_states, encoder_hidden_states, shift_mlp, scale_mlp, gate_mlp,
                c_shift_mlp, c_scale_mlp, c_gate_mlp):
        norm_hidden_states = self.norm2(hidden_states)
        norm_hidden_states = norm_hidden_states * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        hidden_states = hidden_states + gate_mlp.unsqueeze(1) * self.ff(norm_hidden_states)
        norm_encoder_hidden_states = self.norm2_context(encoder_hidden_states)
        norm_encoder_hidden_states = norm_encoder_hidden_states * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
        encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * self.ff_context(
            norm_encoder_hidden_states)
        if encoder_hidden_states.dtype == torch.float16:
            encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
        return encoder_hidden_states, hidden_states
