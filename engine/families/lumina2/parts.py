"""Lumina 2's forward with every block checkpointed.

diffusers' ``Lumina2Transformer2DModel.forward`` (0.42.1) checkpoints its 26 ``layers`` only; the two
``context_refiner`` and two ``noise_refiner`` blocks run plainly, keeping all their activations (four blocks'
worth at 1024²) and, worse for block streaming, needing their weights in the backward without a recompute
that would bring them back. This is that forward, the same arithmetic in the same order, with the refiners
also run through the model's checkpoint function (which the engine replaces with its activation offloader
when blocks stream). Installed by ``Lumina2Memory.checkpoint_every_block`` while training; the model's own
forward is restored afterwards.
"""
from __future__ import annotations

import torch


def forward_checkpointing_every_block(self, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask,
                                      attention_kwargs=None, return_dict=True):
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    checkpointing = torch.is_grad_enabled() and self.gradient_checkpointing

    def run(layer, *args):
        return self._gradient_checkpointing_func(layer, *args) if checkpointing else layer(*args)

    # 1. Condition, positional & patch embedding
    batch_size, _, height, width = hidden_states.shape
    temb, encoder_hidden_states = self.time_caption_embed(hidden_states, timestep, encoder_hidden_states)
    (hidden_states, context_rotary_emb, noise_rotary_emb, rotary_emb, encoder_seq_lengths,
     seq_lengths) = self.rope_embedder(hidden_states, encoder_attention_mask)
    hidden_states = self.x_embedder(hidden_states)

    # 2. Context & noise refinement (checkpointed here; plain in diffusers)
    for layer in self.context_refiner:
        encoder_hidden_states = run(layer, encoder_hidden_states, encoder_attention_mask, context_rotary_emb)
    for layer in self.noise_refiner:
        hidden_states = run(layer, hidden_states, None, noise_rotary_emb, temb)

    # 3. Joint Transformer blocks
    max_seq_len = max(seq_lengths)
    use_mask = len(set(seq_lengths)) > 1
    attention_mask = hidden_states.new_zeros(batch_size, max_seq_len, dtype=torch.bool)
    joint_hidden_states = hidden_states.new_zeros(batch_size, max_seq_len, self.config.hidden_size)
    for i, (encoder_seq_len, seq_len) in enumerate(zip(encoder_seq_lengths, seq_lengths)):
        attention_mask[i, :seq_len] = True
        joint_hidden_states[i, :encoder_seq_len] = encoder_hidden_states[i, :encoder_seq_len]
        joint_hidden_states[i, encoder_seq_len:seq_len] = hidden_states[i]
    hidden_states = joint_hidden_states
    for layer in self.layers:
        hidden_states = run(layer, hidden_states, attention_mask if use_mask else None, rotary_emb, temb)

    # 4. Output norm & projection
    hidden_states = self.norm_out(hidden_states, temb)

    # 5. Unpatchify
    p = self.config.patch_size
    output = []
    for i, (encoder_seq_len, seq_len) in enumerate(zip(encoder_seq_lengths, seq_lengths)):
        output.append(hidden_states[i][encoder_seq_len:seq_len].view(height // p, width // p, p, p, self.out_channels)
                      .permute(4, 0, 2, 1, 3).flatten(3, 4).flatten(1, 2))
    output = torch.stack(output, dim=0)
    if not return_dict:
        return (output,)
    return Transformer2DModelOutput(sample=output)
