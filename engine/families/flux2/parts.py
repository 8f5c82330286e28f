"""Flux.2 blocks in parts (diffusers 0.37-0.42): double blocks (``Flux2TransformerBlock``) stream as two parts,
attention then the feed-forwards (``engine/offload/units.py``); single blocks (``Flux2SingleTransformerBlock``) run
their MLP half in token chunks (``single_block_forward_chunked``). Each is diffusers' arithmetic in the same order."""
from __future__ import annotations

import torch
from torch import nn

from ...errors import ConfigError
from ..recompute import token_chunk_outputs


def single_block_forward_chunked(chunks: int):
    """diffusers' Flux2SingleTransformerBlock.forward with its ``Flux2ParallelSelfAttnProcessor`` inlined, the MLP
    half in ``chunks`` checkpointed token chunks while attention sees every token. Same arithmetic, in the same order,
    per token. One function for all blocks (compile_blocks compiles one code object for a class's blocks).

    The block is "parallel": one fused Linear makes q/k/v (3 x width) and the MLP input (2 x 3 x width, SwiGLU) of
    every token, and one Linear maps [attention, MLP] (4 x width) back. Both run per token chunk:

    1. ``project``, each chunk under its own checkpoint: the fused Linear on the chunk's rows, split into q/k/v
       (joined for attention) and the SwiGLU activation (kept per chunk, 3 x width). The Linear is called as a module,
       all of its columns: slicing it to the q/k/v rows would need the weight itself, which a LoRA / LoHa / LoKr / DoRA
       wrapper (their delta and DoRA's row norm are over the whole fused weight) and the slab Linears (int8 / int4
       buffers, no float ``weight``) each hold differently; the module call is the one path every form (and the
       block streamer's hooks, which sit on the block) takes unchanged, and both halves of its product are used.
       Under the checkpoint only the chunk's normed rows are saved: the 9 x width product and the SwiGLU's 6 x width
       input exist for one chunk at a time, formed once more in the backward (one more forward of this Linear a
       step, as Flux.1's chunked single blocks).
    2. the output part, per chunk without a checkpoint: [attention, activation] through ``to_out``, gated, plus the
       residual. What it saves (the 4 x width concatenation, where an adapter sits on ``to_out``) is freed by its own
       backward, before attention's backward, where the block's peak is (bench/flux2_working_set.py measured the same
       peak both ways), so a checkpoint there would only add a recompute of ``to_out``.

    Kept for all tokens through the block: q/k/v (3 x width), the activation (3 x width) until the output part has
    used it, and attention's own tensors."""

    def forward(self, hidden_states, encoder_hidden_states, temb_mod, image_rotary_emb=None,
                joint_attention_kwargs=None, split_hidden_states=False, text_seq_len=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.embeddings import apply_rotary_emb
        from diffusers.models.transformers.transformer_flux2 import Flux2Modulation, Flux2ParallelSelfAttnProcessor

        attn = self.attn
        processor = attn.processor
        if type(processor) is not Flux2ParallelSelfAttnProcessor:
            raise ConfigError(f"a Flux.2 single block runs {type(processor).__name__}, not diffusers' "
                              f"Flux2ParallelSelfAttnProcessor: its MLP half cannot run in token chunks. Set "
                              f"recompute_chunks to 1, or put the default attention processor back")
        if encoder_hidden_states is not None:
            text_seq_len = encoder_hidden_states.shape[1]
            hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        mod_shift, mod_scale, mod_gate = Flux2Modulation.split(temb_mod, 1)[0]
        norm_hidden_states = self.norm(hidden_states)
        norm_hidden_states = (1 + mod_scale) * norm_hidden_states + mod_shift

        qkv_dim = 3 * attn.inner_dim
        mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor

        def project(normed):
            fused = attn.to_qkv_mlp_proj(normed)
            local_qkv = fused.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)  # the processor's split, as diffusers
            qkv, mlp = torch.split(fused, [local_qkv, fused.shape[-1] - local_qkv], dim=-1)
            # contiguous: a view would keep the chunk's whole 9 x width product alive as the checkpoint's output
            return qkv.contiguous(), attn.mlp_act_fn(mlp)

        pieces = token_chunk_outputs(project, norm_hidden_states, chunks=chunks)
        qkv = pieces[0][0] if len(pieces) == 1 else torch.cat([p[0] for p in pieces], dim=1)
        acts = [p[1] for p in pieces]
        del pieces

        query, key, value = qkv.chunk(3, dim=-1)
        query = query.unflatten(-1, (-1, attn.head_dim))
        key = key.unflatten(-1, (-1, attn.head_dim))
        value = value.unflatten(-1, (-1, attn.head_dim))
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        attn_hidden = dispatch_attention_fn(query, key, value,
                                            attn_mask=(joint_attention_kwargs or {}).get("attention_mask"),
                                            backend=processor._attention_backend,
                                            parallel_config=processor._parallel_config)
        attn_hidden = attn_hidden.flatten(2, 3).to(query.dtype)

        def output(residual, attn_part, act):
            return residual + mod_gate * attn.to_out(torch.cat([attn_part, act], dim=-1))

        sizes = [a.shape[1] for a in acts]  # the slices ``project`` ran on
        outs = []
        for residual, attn_part in zip(hidden_states.split(sizes, dim=1), attn_hidden.split(sizes, dim=1)):
            outs.append(output(residual, attn_part, acts.pop(0)))
        hidden_states = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        if split_hidden_states:
            return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
        return hidden_states

    return forward


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
