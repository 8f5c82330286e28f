"""Flux.2 (dev 32B, klein 4B/9B) on diffusers' ``Flux2Transformer2DModel`` (diffusers >= 0.37).

Facts used here (sources: diffusers 0.42.1 ``pipelines/flux2/pipeline_flux2.py`` and
``pipeline_flux2_klein.py``, ``examples/dreambooth/train_dreambooth_lora_flux2.py``,
BFL ``src/flux2/sampling.py``; ../shared/reference/flux2-and-editor-facts.md §A):

- dev: 8 double + 48 single blocks at width 6144, guidance-distilled (a guidance
  embedding); text = Mistral-Small-3.x 24B hidden states of layers 10/20/30, stacked
  per token into (512, 15360).
- klein 4B / 9B: 5+20 / 8+24 blocks at 3072 / 4096, no guidance embedding; text =
  Qwen3-4B / Qwen3-8B hidden states of layers 9/18/27. The undistilled "base"
  variants have the same transformer config (one variant id covers both).
- Latents: a 32-channel VAE, 2x2 patchified to 128 channels and normalised with the
  VAE's BatchNorm running statistics (``Flux2Pipeline._encode_vae_image``); the cache
  holds exactly these (C, H/16, W/16) tensors, which are also ComfyUI's Flux.2 LATENTs.
  Tokens are their pixels in row-major order (``_pack_latents``).
- Position ids have 4 axes (T, H, W, L): image (0, h, w, 0), text (0, 0, 0, l)
  (``_prepare_latent_ids`` / ``_prepare_text_ids``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import TextEncoderSpec, block_lora_targets
from .flux2_names import flux2_param_table

# LoRA targets: every attention projection of the double blocks, image and text streams
# (diffusers' own script leaves the text stream untrained), and the single blocks' fused
# projections. Never the final layer (proj_out) or the global modulation.
DOUBLE_BLOCK_TARGETS = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
)
SINGLE_BLOCK_TARGETS = ("attn.to_qkv_mlp_proj", "attn.to_out")

_MISTRAL = TextEncoderSpec("text_encoder", "tokenizer", "stacked", 512, "prompt_embeds",
                           hidden_layers=(10, 20, 30), prompt_format="mistral3")
_QWEN3 = TextEncoderSpec("text_encoder", "tokenizer", "stacked", 512, "prompt_embeds",
                         hidden_layers=(9, 18, 27), prompt_format="qwen3")


class Flux2Family:
    id = "flux2"
    display_name = "Flux.2"
    variants = {
        "flux2-dev": "flux2-dev.json",
        "flux2-klein-4b": "flux2-klein-4b.json",
        "flux2-klein-9b": "flux2-klein-9b.json",
        # Tiny random model for the tests (same architecture, small widths; text = a tiny Mistral3).
        "flux2-tiny": "flux2-tiny.json",
    }
    diffusers_class_name = "Flux2Transformer2DModel"
    # Outside the blocks but large (Flux.2-dev: 566 M modulation + 94 M text-embedder parameters, 1.3 GB
    # in bf16): int8 in slabs like the block Linears. They run once per forward, outside checkpointing.
    int8_extra_linears = (
        "double_stream_modulation_img.linear", "double_stream_modulation_txt.linear",
        "single_stream_modulation.linear", "context_embedder",
    )
    text_encoders = (_MISTRAL,)  # dev's; text_encoder_specs() gives each variant's
    vae_class_name = "AutoencoderKLFlux2"

    def text_encoder_specs(self, variant: str) -> tuple[TextEncoderSpec, ...]:
        if variant.startswith("flux2-klein"):
            return (_QWEN3,)
        if variant == "flux2-tiny":
            return (TextEncoderSpec("text_encoder", "tokenizer", "stacked", 16, "prompt_embeds",
                                    hidden_layers=(1, 2, 3), prompt_format="mistral3"),)
        return (_MISTRAL,)

    def transformer_class(self) -> type[nn.Module]:
        from diffusers import Flux2Transformer2DModel

        return Flux2Transformer2DModel

    def param_table(self, config: dict[str, Any]):
        hidden = config["num_attention_heads"] * config["attention_head_dim"]
        return flux2_param_table(
            num_double=config["num_layers"], num_single=config["num_single_layers"], hidden=hidden,
            mlp_hidden=int(hidden * config.get("mlp_ratio", 3.0)), head_dim=config["attention_head_dim"],
            guidance=bool(config.get("guidance_embeds", True)),
            out_channels=config.get("out_channels") or config.get("in_channels", 128),
        )

    def looks_like_single_file(self, keys: set[str]) -> bool:
        # What ComfyUI's model_detection keys on for Flux.2 (global modulation).
        return "double_stream_modulation_img.lin.weight" in keys

    def block_lists(self, model: nn.Module) -> list[nn.ModuleList]:
        return [model.transformer_blocks, model.single_transformer_blocks]

    def lora_target_modules(self, model: nn.Module) -> list[str]:
        return block_lora_targets(model, DOUBLE_BLOCK_TARGETS, SINGLE_BLOCK_TARGETS)

    def install_chunked_recompute(self, model: nn.Module, chunks: int, undo) -> None:
        """The double blocks' feed-forwards in checkpointed token chunks (engine/offload/recompute.py).
        Single blocks are left whole: their MLP input projection is fused with q/k/v
        (``to_qkv_mlp_proj``), so chunking them needs a rewritten attention processor (not done)."""
        from ..offload.recompute import chunk_token_wise

        for block in model.transformer_blocks:
            chunk_token_wise(block.ff, chunks, undo)
            chunk_token_wise(block.ff_context, chunks, undo)

    # A block's recompute + backward working set against Flux.1's at the same tokens x width (the planner's
    # constants are Flux.1 fits): the single blocks' fused projection is 9x the width (Flux.1: 7x) and the
    # SwiGLU feed-forward 6x. Fitted on 2026-11-25 (H100, Flux.2-dev int8, stream + activation offload,
    # blocks in parts, compiled, 1024²): 6.24 GB measured against 5.54 GB predicted at 1.0.
    activation_scale = 1.37

    def block_parts(self, block: nn.Module):
        """A double block streams as two parts (engine/offload/units.py): attention (0.60 GB bf16 at
        Flux.2-dev's size) and the feed-forwards (1.36 GB). Single blocks (0.98 GB) stream whole."""
        from diffusers.models.transformers.transformer_flux2 import Flux2TransformerBlock

        if not isinstance(block, Flux2TransformerBlock):
            return None
        return [("attention", _DoubleAttention(block)), ("feed_forward", _DoubleFeedForward(block))]

    def text_widths(self, config: dict) -> dict[str, int]:
        """Width of each cached embedding the transformer takes: the stacked hidden states (dev 15360,
        klein 4B 7680, klein 9B 12288)."""
        return {"prompt_embeds": int(config["joint_attention_dim"])}

    def default_max_sequence_length(self, variant: str) -> int:
        return self.text_encoder_specs(variant)[0].max_length

    # --- latents ------------------------------------------------------------

    @staticmethod
    def patchify(latents: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) VAE latents -> (B, 4C, H/2, W/2), as ``Flux2Pipeline._patchify_latents``."""
        b, c, h, w = latents.shape
        x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
        return x.reshape(b, c * 4, h // 2, w // 2)

    @staticmethod
    def unpatchify(latents: torch.Tensor) -> torch.Tensor:
        b, c4, h, w = latents.shape
        x = latents.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
        return x.reshape(b, c4 // 4, h * 2, w * 2)

    def latents_from_vae(self, vae, mean: torch.Tensor) -> torch.Tensor:
        """VAE latent mean (B, 32, H/8, W/8) -> the transformer's normalised (B, 128, H/16, W/16)."""
        x = self.patchify(mean)
        bn_mean = vae.bn.running_mean.view(1, -1, 1, 1).to(x.device, x.dtype)
        bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(x.device, x.dtype)
        return (x - bn_mean) / bn_std

    def latents_to_vae(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """The inverse of ``latents_from_vae`` (Flux2Pipeline: un-normalise, unpatchify) for ``vae.decode``."""
        bn_mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device,
                                                                                                 latents.dtype)
        return self.unpatchify(latents * bn_std + bn_mean)

    def latent_shape(self, model, width: int, height: int) -> tuple[int, int, int]:
        """(C, h, w) of the (patchified) latents of a width x height image."""
        return (model.config.in_channels, height // 16, width // 16)

    def sample_shift_mu(self, latents: torch.Tensor, steps: int) -> float:
        """Flux2Pipeline's shift for ``steps`` sampling steps (compute_empirical_mu)."""
        return compute_empirical_mu(latents.shape[2] * latents.shape[3], steps)

    # --- training-time math -------------------------------------------------

    @staticmethod
    def image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
        """(h * w, 4) position ids (T=0, row, col, L=0) in token order."""
        ids = torch.zeros(h, w, 4, device=device, dtype=dtype)
        ids[..., 1] = torch.arange(h, device=device, dtype=dtype)[:, None]
        ids[..., 2] = torch.arange(w, device=device, dtype=dtype)[None, :]
        return ids.reshape(-1, 4)

    @staticmethod
    def text_ids(length: int, device, dtype) -> torch.Tensor:
        ids = torch.zeros(length, 4, device=device, dtype=dtype)
        ids[:, 3] = torch.arange(length, device=device, dtype=dtype)
        return ids

    def model_inputs(self, model: nn.Module, latents: torch.Tensor, embeds: dict[str, torch.Tensor],
                     timesteps: torch.Tensor, guidance: float) -> dict[str, Any]:
        """Keyword arguments for ``Flux2Transformer2DModel.forward`` on noisy latents (B, C, h, w)."""
        b, c, h, w = latents.shape
        dtype = latents.dtype
        prompt = embeds["prompt_embeds"].to(dtype)  # (B, L, joint_attention_dim)
        inputs = {
            "hidden_states": latents.reshape(b, c, h * w).permute(0, 2, 1),
            "encoder_hidden_states": prompt,
            "timestep": timesteps.to(dtype),  # sigma in [0, 1]; the model scales by 1000
            "img_ids": self.image_ids(h, w, latents.device, dtype),
            "txt_ids": self.text_ids(prompt.shape[1], latents.device, dtype),
            "return_dict": False,
        }
        if getattr(model.config, "guidance_embeds", True):
            inputs["guidance"] = torch.full((b,), guidance, device=latents.device, dtype=dtype)
        return inputs

    def unpack_prediction(self, pred: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        b, c, h, w = latents.shape
        return pred.permute(0, 2, 1).reshape(b, c, h, w)

    def timestep_shift_mu(self, latents: torch.Tensor) -> float:
        """The shift Flux.2 samples with (BFL ``sampling.py`` ``compute_empirical_mu``, also in
        diffusers' pipeline and ComfyUI's Flux2Scheduler) at its 50-step default: training
        concentrates on the noise levels inference visits (mu 2.02 at 1024², ComfyUI's shift)."""
        seq = latents.shape[2] * latents.shape[3]
        return compute_empirical_mu(seq, 50)


class _DoubleAttention(nn.Module):
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


class _DoubleFeedForward(nn.Module):
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


def compute_empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """BFL flux2 ``sampling.py`` (commit 5a5d316b) ``compute_empirical_mu``."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200 = a2 * image_seq_len + b2
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    b = m_200 - 200.0 * a
    return float(a * num_steps + b)
