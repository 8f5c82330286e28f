"""Flux.1 (dev and schnell) on diffusers' ``FluxTransformer2DModel``.

Facts used here: 19 double + 38 single blocks at width 3072; T5-XXL sequence
embeddings (4096) + CLIP-L pooled (768); a 16-channel VAE whose latents are
packed 2x2 into 64-channel tokens; dev is guidance-distilled (a guidance
embedding), schnell is not.
Kontext (``kontext.py``) is dev's transformer trained with one reference image: its own variant, told apart by name.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..base import ModelFamily, image_only
from ..specs.controls import check_control_batch, control_latents
from ..specs import ControlImages, Guidance, LoraForm, MemoryProfile, NoiseSchedule, StepConstants, TextEncoderSpec
from ..names import NativeParam
from ..patches import linear_mu, pack_2x2, unpack_2x2
from .names import flux1_param_table

# Linear modules that get a LoRA. Double blocks: attention q/k/v/out for the image
# stream and the context (text) projections. Single blocks: their projections,
# named exactly so the model's final ``proj_out`` is never matched.
DOUBLE_BLOCK_TARGETS = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
)
SINGLE_BLOCK_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out")

# ComfyUI's Flux takes T5's states as the conditioning and CLIP's pooled vector as its pooled_output
# (tests/comfyui: the demo's prompts sampled by ComfyUI's KSampler).
_CLIP = TextEncoderSpec("text_encoder", "tokenizer", "clip_pooled", 77, "pooled_prompt_embeds",
                        comfy_slot="pooled_output")
# T5's default length is what the diffusers pipelines use: dev 512, schnell 256. The tiny model keeps it short.
_T5 = TextEncoderSpec("text_encoder_2", "tokenizer_2", "t5", 512, "prompt_embeds", comfy_slot="")
_T5_SCHNELL = TextEncoderSpec("text_encoder_2", "tokenizer_2", "t5", 256, "prompt_embeds", comfy_slot="")
_T5_TINY = TextEncoderSpec("text_encoder_2", "tokenizer_2", "t5", 32, "prompt_embeds", comfy_slot="")


class Flux1Memory(MemoryProfile):
    """Flux.1's block surgery: double blocks in two parts, token-wise parts in chunks."""

    def install_chunked_recompute(self, model: nn.Module, chunks: int, undo) -> None:
        """The double blocks' feed-forwards, and in single blocks everything after attention (proj_mlp,
        GELU, the 5x-wide concatenation, proj_out, gate, residual), in checkpointed token chunks."""
        import types

        from ..recompute import chunk_token_wise
        from .parts import single_block_forward_chunked

        for block in model.transformer_blocks:
            chunk_token_wise(block.ff, chunks, undo)
            chunk_token_wise(block.ff_context, chunks, undo)
        for block in model.single_transformer_blocks:
            undo.set_forward(block, types.MethodType(single_block_forward_chunked(chunks), block))

    def block_parts(self, block: nn.Module):
        """A double block streams as two parts: modulation + attention (0.38 GB bf16 at full size) and the
        feed-forwards (0.30 GB). Single blocks (0.28 GB) stream whole."""
        from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

        from .parts import DoubleAttention, DoubleFeedForward

        if not isinstance(block, FluxTransformerBlock):
            return None
        return [("attention", DoubleAttention(block)), ("feed_forward", DoubleFeedForward(block))]


class Flux1Schedule(NoiseSchedule):
    """Flux's resolution-dependent shift, in training and sampling."""

    def train_shift_mu(self, latents: torch.Tensor) -> float:
        """Flux's resolution-dependent shift: mu grows linearly with the token count,
        0.5 at 256 tokens to 1.15 at 4096 (the values in Flux's scheduler config)."""
        return linear_mu((latents.shape[2] // 2) * (latents.shape[3] // 2), 256, 4096, 0.5, 1.15)


class Flux1Family(ModelFamily):
    id = "flux1"
    display_name = "Flux.1"
    variants = {
        "flux1-dev": "flux1-dev.json",
        "flux1-schnell": "flux1-schnell.json",
        # Tiny random model for the demo and the tests (same architecture, small widths).
        "flux1-tiny": "flux1-tiny.json",
        # Kontext: dev's shapes, told apart by name (variant_from_name); its tiny stand-in for the tests.
        "flux1-kontext": "flux1-dev.json",
        "flux1-kontext-tiny": "flux1-tiny.json",
        # The demo's model: tiny too, but ComfyUI's loader takes it (its Flux detection fixes the head width at 128
        # and the RoPE axes at 16/56/56, and reads everything else from the file's shapes), so the demo's LoRA can
        # be tried with ComfyUI's own KSampler.
        "flux1-demo": "flux1-demo.json",
    }
    tiny_variant = "flux1-tiny"
    diffusers_class_name = "FluxTransformer2DModel"
    structural_keys = ("num_layers", "num_single_layers", "attention_head_dim", "num_attention_heads",
                       "guidance_embeds")
    memory = Flux1Memory(
        block_lists=("transformer_blocks", "single_transformer_blocks"),
        # Which rows the block Linears multiply (MemoryProfile.linear_tokens: the step-time model's FLOPs).
        modulation_linears=("norm1.linear", "norm1_context.linear", "norm.linear"),
        text_linears=("attn.add_", "attn.to_add_out", "ff_context."),
        dual_stream_lists=("transformer_blocks",),
        chunked_recompute=True,
        # Measured on the H200, 2026-11-27 (bench/logs/parallel_flux1_pipeline_session5.log): dev bf16 1024², batch 4,
        # capped at 12.02 GB, OOMed asking for 540 MiB (a single block's attention + MLP concatenation, 4 x 4608 tokens
        # x 15360 x 2 bytes, asked right after its 4-wide MLP tensors were freed, which cannot serve it) with 1.28 GiB
        # reserved but unusable: 2.4x the request. The allocated bytes were under the plan (tests/test_plan_margin.py).
        fragmentation=2.5,
        # The time / guidance / pooled-text embedding and every AdaLN modulation fed by it (27% of the block bytes).
        step_constants=StepConstants(source="time_text_embed", modules={
            "transformer_blocks.*.norm1.linear": "silu", "transformer_blocks.*.norm1_context.linear": "silu",
            "single_transformer_blocks.*.norm.linear": "silu", "norm_out.linear": "silu"}),
    )
    schedule = Flux1Schedule()
    lora = LoraForm(
        targets={"transformer_blocks": DOUBLE_BLOCK_TARGETS, "single_transformer_blocks": SINGLE_BLOCK_TARGETS},
        architecture="flux1/lora",
        # The SAI model spec's names for the two released models.
        variant_architectures={"flux1-dev": "flux-1-dev/lora", "flux1-schnell": "flux-1-schnell/lora"},
    )
    file_help = {
        "checkpoint": "flux1-dev.safetensors or flux1-schnell.safetensors (BFL names; bf16, fp16, fp8, scaled fp8), "
                      "or flux1-dev-kontext_fp8_scaled.safetensors (Kontext: its name says so)",
        "pipeline": "text_encoder (CLIP-L), text_encoder_2 (T5-XXL), tokenizer, tokenizer_2, vae",
        "single_files": "clip_l.safetensors and t5xxl_fp16.safetensors (fp8 / scaled fp8 too; in either input; "
                        "tokenizers: ComfyUI's bundled ones, else a folder named like the file beside it), "
                        "ae.safetensors",
    }

    # --- identity ----------------------------------------------------------------------------

    def looks_like_single_file(self, keys: set[str]) -> bool:
        # Per-block modulation (img_mod) is Flux.1's; Flux.2 has global modulation instead.
        return "img_in.weight" in keys and "double_blocks.0.img_mod.lin.weight" in keys

    def variant_from_name(self, variant: str, name: str, keys: frozenset[str] | set[str] = frozenset()) -> str:
        """Kontext has dev's shapes; ComfyUI's and BFL's names say it (``flux1-dev-kontext_fp8_scaled``,
        ``FLUX.1-Kontext-dev``)."""
        if variant in ("flux1-dev", "flux1-tiny") and "kontext" in name.lower():
            return "flux1-kontext-tiny" if variant == "flux1-tiny" else "flux1-kontext"
        return variant

    def param_table(self, config: dict[str, Any]) -> list[NativeParam]:
        hidden = config["num_attention_heads"] * config["attention_head_dim"]
        return flux1_param_table(
            num_double=config["num_layers"],
            num_single=config["num_single_layers"],
            hidden=hidden,
            mlp_hidden=int(hidden * config.get("mlp_ratio", 4.0)),
            head_dim=config["attention_head_dim"],
            guidance=bool(config.get("guidance_embeds", False)),
        )

    # --- text ------------------------------------------------------------------------------

    def text_encoder_specs(self, variant: str) -> tuple[TextEncoderSpec, ...]:
        return (_CLIP, {"flux1-schnell": _T5_SCHNELL, "flux1-tiny": _T5_TINY, "flux1-kontext-tiny": _T5_TINY,
                        "flux1-demo": _T5_TINY}.get(variant, _T5))

    def text_widths(self, config: dict) -> dict[str, int]:
        return {"prompt_embeds": int(config["joint_attention_dim"]),
                "pooled_prompt_embeds": int(config["pooled_projection_dim"])}

    # --- latents -----------------------------------------------------------------------------

    def latent_shape(self, model, width: int, height: int, frames: int = 1) -> tuple[int, int, int]:
        """(C, h, w) of the latents of a width x height image (C: the packed channels / 4)."""
        image_only(self, frames)
        return (model.config.in_channels // 4, height // 8, width // 8)

    pack_latents = staticmethod(pack_2x2)  # (B, C, H, W) -> (B, H/2 * W/2, 4C)
    unpack_latents = staticmethod(unpack_2x2)

    @staticmethod
    def image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
        """(H/2 * W/2, 3) position ids: (0, row, col) per packed token."""
        ids = torch.zeros(h // 2, w // 2, 3, device=device, dtype=dtype)
        ids[..., 1] = torch.arange(h // 2, device=device, dtype=dtype)[:, None]
        ids[..., 2] = torch.arange(w // 2, device=device, dtype=dtype)[None, :]
        return ids.reshape(-1, 3)

    def control_images(self, variant: str) -> ControlImages | None:
        """Kontext takes one reference image, always (``kontext.py``); the other variants none."""
        if variant not in ("flux1-kontext", "flux1-kontext-tiny"):
            return None
        from .kontext import MULTIPLE, encode_reference, reference_size

        auto = variant == "flux1-kontext"  # the tiny stand-in keeps each reference's own size (CPU tests)
        return ControlImages(max_count=1, ident=("kontext-reference", auto, MULTIPLE),
                             size=lambda width, height: reference_size(width, height, auto),
                             encode_latents=lambda vae, images: encode_reference(vae, images, auto))

    # --- training ----------------------------------------------------------------------------

    def model_inputs(self, model: nn.Module, latents: torch.Tensor, embeds: dict[str, torch.Tensor],
                     sigmas: torch.Tensor, guidance: float) -> dict[str, Any]:
        """Keyword arguments for ``FluxTransformer2DModel.forward`` on noisy latents (B, C, H, W). A Kontext
        reference latent in ``embeds`` (``control_latents_0``, (B, C, h, w)) is packed after the target's tokens
        with ids (1, row, col), as FluxKontextPipeline appends ``image_latents``; ``unpack_prediction`` keeps the
        target's tokens, so the loss covers the target only."""
        from .kontext import REFERENCE_INDEX

        b, _, h, w = latents.shape
        dtype = latents.dtype
        prompt = embeds["prompt_embeds"].to(dtype)  # (B, L, 4096)
        refs = [r.to(latents.device, dtype) for r in control_latents(embeds)]
        check_control_batch("Flux.1 Kontext reference", refs, latents)
        ids = [self.image_ids(h, w, latents.device, dtype)]
        for ref in refs:
            ids.append(self.image_ids(ref.shape[-2], ref.shape[-1], latents.device, dtype))
            ids[-1][:, 0] = REFERENCE_INDEX
        inputs = {
            "hidden_states": torch.cat([self.pack_latents(x) for x in [latents] + refs], dim=1),
            "encoder_hidden_states": prompt,
            "pooled_projections": embeds["pooled_prompt_embeds"].to(dtype),  # (B, 768)
            "timestep": self.schedule.prediction.model_timestep(sigmas).to(dtype),  # sigma; the model scales by 1000
            "img_ids": torch.cat(ids, dim=0),
            "txt_ids": torch.zeros(prompt.shape[1], 3, device=latents.device, dtype=dtype),
            "return_dict": False,
        }
        if model.config.guidance_embeds:
            inputs["guidance"] = torch.full((b,), guidance, device=latents.device, dtype=dtype)
        return inputs

    def unpack_prediction(self, output: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The target's tokens (the first H/2 * W/2; a Kontext forward also answers for the reference) unpacked."""
        h, w = latents.shape[2], latents.shape[3]
        return self.unpack_latents(output[:, : (h // 2) * (w // 2)], h, w)

    def guidance(self, variant: str) -> Guidance:
        """dev is guidance-distilled (an embedding, 3.5 by default); schnell samples without any."""
        return Guidance("none") if variant == "flux1-schnell" else Guidance("embedded", 3.5)

