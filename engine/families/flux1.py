"""Flux.1 (dev and schnell) on diffusers' ``FluxTransformer2DModel``.

Facts used here: 19 double + 38 single blocks at width 3072; T5-XXL sequence
embeddings (4096) + CLIP-L pooled (768); a 16-channel VAE whose latents are
packed 2x2 into 64-channel tokens; dev is guidance-distilled (a guidance
embedding), schnell is not.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import TextEncoderSpec, block_lora_targets
from .flux1_names import BflParam, flux1_param_table

# Linear modules that get a LoRA. Double blocks: attention q/k/v/out for the image
# stream and the context (text) projections. Single blocks: their projections,
# named exactly so the model's final ``proj_out`` is never matched.
DOUBLE_BLOCK_TARGETS = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
)
SINGLE_BLOCK_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out")


class Flux1Family:
    id = "flux1"
    display_name = "Flux.1"
    variants = {
        "flux1-dev": "flux1-dev.json",
        "flux1-schnell": "flux1-schnell.json",
        # Tiny random model for the demo and the tests (same architecture, small widths).
        "flux1-tiny": "flux1-tiny.json",
    }
    diffusers_class_name = "FluxTransformer2DModel"
    text_encoders = (
        TextEncoderSpec("text_encoder", "tokenizer", "pooled", 77, "pooled_prompt_embeds"),
        TextEncoderSpec("text_encoder_2", "tokenizer_2", "sequence", 512, "prompt_embeds"),
    )

    vae_class_name = "AutoencoderKL"

    def text_encoder_specs(self, variant: str) -> tuple[TextEncoderSpec, ...]:
        return self.text_encoders

    def latents_from_vae(self, vae, mean: torch.Tensor) -> torch.Tensor:
        """VAE latent mean -> what the transformer takes: shifted and scaled (pipeline_flux.py)."""
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        return (mean - shift) * vae.config.scaling_factor

    def latents_to_vae(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """The inverse of ``latents_from_vae``: what ``vae.decode`` takes (pipeline_flux.py)."""
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        return latents / vae.config.scaling_factor + shift

    def latent_shape(self, model, width: int, height: int) -> tuple[int, int, int]:
        """(C, h, w) of the latents of a width x height image (C: the packed channels / 4)."""
        return (model.config.in_channels // 4, height // 8, width // 8)

    def sample_shift_mu(self, latents: torch.Tensor, steps: int) -> float:
        """FluxPipeline's shift for sampling: the same resolution-dependent mu as training."""
        return self.timestep_shift_mu(latents)

    def transformer_class(self) -> type[nn.Module]:
        from diffusers import FluxTransformer2DModel

        return FluxTransformer2DModel

    def param_table(self, config: dict[str, Any]) -> list[BflParam]:
        hidden = config["num_attention_heads"] * config["attention_head_dim"]
        return flux1_param_table(
            num_double=config["num_layers"],
            num_single=config["num_single_layers"],
            hidden=hidden,
            mlp_hidden=int(hidden * config.get("mlp_ratio", 4.0)),
            head_dim=config["attention_head_dim"],
            guidance=bool(config.get("guidance_embeds", False)),
        )

    def looks_like_single_file(self, keys: set[str]) -> bool:
        # Per-block modulation (img_mod) is Flux.1's; Flux.2 has global modulation instead.
        return "img_in.weight" in keys and "double_blocks.0.img_mod.lin.weight" in keys

    def block_lists(self, model: nn.Module) -> list[nn.ModuleList]:
        return [model.transformer_blocks, model.single_transformer_blocks]

    def lora_target_modules(self, model: nn.Module) -> list[str]:
        return block_lora_targets(model, DOUBLE_BLOCK_TARGETS, SINGLE_BLOCK_TARGETS)

    def install_chunked_recompute(self, model: nn.Module, chunks: int, undo) -> None:
        """Token-wise parts in checkpointed chunks (engine/offload/recompute.py): the double blocks'
        feed-forwards, and in single blocks everything after attention (proj_mlp, GELU, the 5x-wide
        concatenation, proj_out, gate, residual)."""
        import types

        from ..offload.recompute import chunk_token_wise

        for block in model.transformer_blocks:
            chunk_token_wise(block.ff, chunks, undo)
            chunk_token_wise(block.ff_context, chunks, undo)
        for block in model.single_transformer_blocks:
            undo.set_forward(block, types.MethodType(_single_block_forward_chunked(chunks), block))

    def block_parts(self, block: nn.Module):
        """A double block streams as two parts (engine/offload/units.py): modulation + attention
        (0.38 GB bf16 at full size) and the feed-forwards (0.30 GB). Single blocks (0.28 GB) stream whole."""
        from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

        if not isinstance(block, FluxTransformerBlock):
            return None
        return [("attention", _DoubleAttention(block)), ("feed_forward", _DoubleFeedForward(block))]

    def text_widths(self, config: dict) -> dict[str, int]:
        """Width of each cached embedding the transformer takes (checked against a cache before loading)."""
        return {"prompt_embeds": int(config["joint_attention_dim"]),
                "pooled_prompt_embeds": int(config["pooled_projection_dim"])}

    def default_max_sequence_length(self, variant: str) -> int:
        # What the diffusers pipelines use: dev 512, schnell 256. The tiny model keeps it short.
        return {"flux1-schnell": 256, "flux1-tiny": 32}.get(variant, 512)

    # --- training-time math -------------------------------------------------

    @staticmethod
    def pack_latents(latents: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, H/2 * W/2, 4C): 2x2 patches become tokens."""
        b, c, h, w = latents.shape
        x = latents.view(b, c, h // 2, 2, w // 2, 2)
        x = x.permute(0, 2, 4, 1, 3, 5)  # (B, H/2, W/2, C, 2, 2)
        return x.reshape(b, (h // 2) * (w // 2), c * 4)

    @staticmethod
    def unpack_latents(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Inverse of pack_latents for latent height h and width w."""
        b, _, c4 = tokens.shape
        c = c4 // 4
        x = tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, c, h, w)

    @staticmethod
    def image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
        """(H/2 * W/2, 3) position ids: (0, row, col) per packed token."""
        ids = torch.zeros(h // 2, w // 2, 3, device=device, dtype=dtype)
        ids[..., 1] = torch.arange(h // 2, device=device, dtype=dtype)[:, None]
        ids[..., 2] = torch.arange(w // 2, device=device, dtype=dtype)[None, :]
        return ids.reshape(-1, 3)

    def model_inputs(
        self,
        model: nn.Module,
        latents: torch.Tensor,
        embeds: dict[str, torch.Tensor],
        timesteps: torch.Tensor,
        guidance: float,
    ) -> dict[str, Any]:
        """Keyword arguments for ``FluxTransformer2DModel.forward`` on noisy latents (B, C, H, W)."""
        b, _, h, w = latents.shape
        dtype = latents.dtype
        prompt = embeds["prompt_embeds"].to(dtype)  # (B, L, 4096)
        inputs = {
            "hidden_states": self.pack_latents(latents),
            "encoder_hidden_states": prompt,
            "pooled_projections": embeds["pooled_prompt_embeds"].to(dtype),  # (B, 768)
            "timestep": timesteps.to(dtype),  # sigma in [0, 1]; the model scales by 1000
            "img_ids": self.image_ids(h, w, latents.device, dtype),
            "txt_ids": torch.zeros(prompt.shape[1], 3, device=latents.device, dtype=dtype),
            "return_dict": False,
        }
        if getattr(model.config, "guidance_embeds", False):
            inputs["guidance"] = torch.full((b,), guidance, device=latents.device, dtype=dtype)
        return inputs

    def unpack_prediction(self, pred: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return self.unpack_latents(pred, latents.shape[2], latents.shape[3])

    def timestep_shift_mu(self, latents: torch.Tensor) -> float:
        """Flux's resolution-dependent shift: mu grows linearly with the token count,
        0.5 at 256 tokens to 1.15 at 4096 (the values in Flux's scheduler config)."""
        seq_len = (latents.shape[2] // 2) * (latents.shape[3] // 2)
        base_len, max_len, base_shift, max_shift = 256, 4096, 0.5, 1.15
        slope = (max_shift - base_shift) / (max_len - base_len)
        return seq_len * slope + (base_shift - slope * base_len)


def _single_block_forward_chunked(chunks: int):
    """diffusers' FluxSingleTransformerBlock.forward (0.37-0.42), with the part after attention in
    token chunks. Same arithmetic, in the same order, per token."""
    from ..offload.recompute import run_in_token_chunks

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


class _DoubleAttention(nn.Module):
    """The first part of diffusers' FluxTransformerBlock.forward (0.37-0.42): modulation, joint attention
    and the gated attention residuals. Returns the residual streams and the feed-forward's modulation,
    the inputs of ``_DoubleFeedForward``. Same arithmetic in the same order as diffusers."""

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
            from ..errors import ConfigError

            raise ConfigError("this Flux.1 model's attention returns IP-adapter outputs; streaming a double block "
                              "in parts does not carry them. Train without the IP-adapter, or with "
                              "activation_offload off (whole blocks)")
        attn_output, context_attn_output = attention_outputs
        hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output
        encoder_hidden_states = encoder_hidden_states + c_gate_msa.unsqueeze(1) * context_attn_output
        return (hidden_states, encoder_hidden_states, shift_mlp, scale_mlp, gate_mlp,
                c_shift_mlp, c_scale_mlp, c_gate_mlp)


class _DoubleFeedForward(nn.Module):
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
