"""Wan blocks in three parts (diffusers 0.42.1 ``WanTransformerBlock``): self-attention, cross-attention, FFN.

Why: at 480x832x81 (32,760 tokens) one A14B hidden state of width 5120 is 335 MB, and a whole block's recompute +
backward keeps every intermediate of the block alive at once (the fp32 norm and modulated copies, q/k/v and their
RoPE'd copies, both attentions' outputs, the residual sums, and their gradients): ~9 GB. Streamed in parts
(``engine/offload/units.py``), each part is checkpointed and recomputed on its own, so only the running part's
intermediates exist.

Each part is diffusers' arithmetic in the same order, with the same casts (``WanTransformerBlock.forward``); the fp32
norms and gated residuals run in token slices (``fp32_chunks.py``: no fp32 copy of the whole sequence is made or
saved, the values are the same):
- ``SelfAttention`` owns ``scale_shift_table``: it computes all six modulation vectors in fp32 (per sample, or per
  token for TI2V-5B's ``expand_timesteps``: temb (B, S, 6, D)), runs the modulated ``norm1``, ``attn1`` with RoPE and
  the gated fp32 residual, and hands the FFN's three vectors on;
- ``CrossAttention``: ``norm2`` (fp32 LayerNorm, or Identity), ``attn2`` to the text, the plain residual;
- ``FeedForward``: the modulated ``norm3``, ``ffn`` (token-chunked by ``install_chunked_recompute``, which patches
  ``block.ffn`` itself, so it works whole or in parts) and the gated fp32 residual.
The FFN's modulation vectors are made contiguous where they leave the first part: a chunk of the (.., 6, D) sum is
a view that would otherwise keep all six alive (and be saved whole) until the FFN part; the values are the same.
"""
from __future__ import annotations

import torch
from torch import nn

from ..block_part import BlockPart
from ..fp32_chunks import fp32_gated_residual, fp32_modulated_norm


def modulation(table: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The six fp32 modulation vectors of a block, as diffusers splits ``scale_shift_table + temb``: (B, 1, D) each
    for temb (B, 6, D), (B, S, D) each for TI2V's per-token temb (B, S, 6, D)."""
    if temb.ndim == 4:
        return tuple(m.squeeze(2) for m in (table.unsqueeze(0) + temb.float()).chunk(6, dim=2))
    return (table + temb.float()).chunk(6, dim=1)


class SelfAttention(BlockPart):
    """Modulation, the modulated ``norm1``, self-attention with RoPE and its gated residual. Returns the inputs of
    ``CrossAttention``: (hidden_states, encoder_hidden_states, c_shift_msa, c_scale_msa, c_gate_msa)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.norm1, self.attn1, self.scale_shift_table = block.norm1, block.attn1, block.scale_shift_table

    def constant_outputs(self, hidden_states, encoder_hidden_states, temb, rotary_emb) -> tuple[int, ...]:
        """Outputs that carry no gradient (read by the activation offloader's checkpoint,
        ``engine/offload/activations.py``): the text states handed on when they are frozen (cached embeddings),
        and the FFN's modulation vectors when the time embedding and the table are."""
        text = () if encoder_hidden_states.requires_grad else (1,)
        return text + (() if temb.requires_grad or self.scale_shift_table.requires_grad else (2, 3, 4))

    def forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = modulation(self.scale_shift_table, temb)
        norm_hidden_states = fp32_modulated_norm(self.norm1, hidden_states, scale_msa, shift_msa)
        attn_output = self.attn1(norm_hidden_states, None, None, rotary_emb)
        hidden_states = fp32_gated_residual(hidden_states, attn_output, gate_msa)
        return (hidden_states, encoder_hidden_states,
                c_shift_msa.contiguous(), c_scale_msa.contiguous(), c_gate_msa.contiguous())


class CrossAttention(BlockPart):
    """``norm2``, cross-attention to the text and the residual. Returns the inputs of ``FeedForward``."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.norm2, self.attn2 = block.norm2, block.attn2

    def constant_outputs(self, hidden_states, encoder_hidden_states, c_shift_msa, c_scale_msa, c_gate_msa):
        """The modulation vectors pass through: constant when they came in so."""
        return () if any(m.requires_grad for m in (c_shift_msa, c_scale_msa, c_gate_msa)) else (1, 2, 3)

    def forward(self, hidden_states, encoder_hidden_states, c_shift_msa, c_scale_msa, c_gate_msa):
        norm_hidden_states = fp32_modulated_norm(self.norm2, hidden_states)
        attn_output = self.attn2(norm_hidden_states, encoder_hidden_states, None, None)
        hidden_states = hidden_states + attn_output
        return hidden_states, c_shift_msa, c_scale_msa, c_gate_msa


class FeedForward(BlockPart):
    """The modulated ``norm3``, the feed-forward and its gated residual: what the block returns."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.norm3, self.ffn = block.norm3, block.ffn

    def forward(self, hidden_states, c_shift_msa, c_scale_msa, c_gate_msa):
        norm_hidden_states = fp32_modulated_norm(self.norm3, hidden_states, c_scale_msa, c_shift_msa)
        ff_output = self.ffn(norm_hidden_states)
        return fp32_gated_residual(hidden_states, ff_output, c_gate_msa)


def wan_block_parts(block: nn.Module) -> list[tuple[str, nn.Module]]:
    """The three parts of a ``WanTransformerBlock``, in run order."""
    return [("self_attention", SelfAttention(block)), ("cross_attention", CrossAttention(block)),
            ("feed_forward", FeedForward(block))]
