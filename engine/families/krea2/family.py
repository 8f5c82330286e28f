"""Krea 2 (Krea AI, 12.8B single-stream MMDiT; Raw and Turbo) on diffusers' ``Krea2Transformer2DModel`` (0.42.1).

Facts (../../../shared/reference/families-2026-image-facts.md §2; checked against diffusers 0.42.1
``transformer_krea2.py``, ``pipeline_krea2.py`` and
``single_file_utils.convert_krea2_transformer_checkpoint_to_diffusers``):

- 28 ``transformer_blocks`` (868 MB bf16 / 434 MB int8 each): GQA attention (48 query, 12 KV heads) with a sigmoid
  output gate, SwiGLU, zero-centred RMSNorms; the modulation is one global ``time_mod_proj`` (226 M, outside the
  blocks) plus a learned table per block. No Linear inside a block reads the time embedding.
- The forward takes 2x2-packed latents (B, N, 64) (Qwen-Image's packing), the text stack (B, L, 12, 2560) with a bool
  key-padding mask, ``timestep`` = sigma (x1000 inside) and ``position_ids`` (L + N, 3): text rows all zero, image rows
  (0, h, w). It answers the velocity ``noise - x0``.
- Text: Qwen3-VL-4B's ``hidden_states[2, 5, ..., 35]`` (the raw outputs of 2, 5, ..., 35 decoder layers) over
  Qwen-Image's system template, the first 34 tokens dropped. The pipeline pads in the middle (``[prefix | prompt | PAD
  | suffix]``) with positions that skip the padding; a causal LM's rows of ``[prefix | prompt | suffix]`` with no
  padding are the same numbers, so the cache keeps each caption at its own length (``variable``). The transformer
  gives text rows position 0 and masks padded keys everywhere, so where the padding sits in a batch changes nothing
  (test_family.py checks both against the pipeline).
- VAE: Qwen-Image's (``AutoencoderKLQwenImage``, per-channel mean/std); the Qwen-Image family's spec.
- Sampling: sigmas ``linspace(1, 1/N, N)`` under the exponential shift; Raw: mu linear in image tokens, 0.5 at 256 ..
  1.15 at 6400, CFG ``cond + g (cond - uncond)`` with g = 4.5, 28 steps; Turbo (``is_distilled``): mu 1.15 at every
  resolution, no guidance, 8 steps.

Variants. Raw (``krea2_raw_bf16.safetensors``, ``krea/Krea-2-Raw``) and Turbo (``krea2_turbo_*``) share one shape;
the file or folder name tells them apart ("turbo": Turbo). Train on Raw, as Krea's model card says ("You train LoRAs on
RAW and apply them on Turbo"); a Turbo file loads and previews as Turbo samples (8 steps, no CFG, mu 1.15), and the
Load node's family tooltip says to train on Raw.

The text-fusion stage (4 blocks, 343 M) is not cached. It runs on the cached text stack inside every forward. Caching
its output would need the transformer's weights at caching time (the text cache is keyed by the text encoder alone
and built before the transformer is loaded; Raw and Turbo carry their own fusion weights), a second entry point
into ``Krea2Transformer2DModel.forward`` (it always runs ``text_fusion`` on the stack), and a LoRA that leaves the stage
alone (musubi-tuner's default trains it). What it would save is small: the frozen stage gets no backward (nothing
before it takes a gradient), its forward is ~2% of the main blocks' at 1024² (6144 rows x 2 layer-wise blocks + 512
rows x 2 refiners of 85.9 M against 4608 rows x 28 x 434 M), and its weights are int8 in a slab with the other
Linears outside the blocks (``int8_extra_linears``, 0.34 GB) and may wait in pinned host memory between forwards
(``outer_on_host``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..base import ModelFamily, image_only
from ..names import NativeParam
from ..patches import linear_mu, pack_2x2, unpack_2x2
from ..qwen_image.family import QWEN_IMAGE_VAE, SUFFIX, SYSTEM_PREFIX
from ..specs import Guidance, LoraForm, MemoryProfile, NoiseSchedule, PromptTemplate, TextEncoderSpec, VaeSpec
from .names import krea2_param_table

#: Every main block's attention with its output gate: "the authors' long training run config" (musubi-tuner
#: docs/krea2.md; 140 Linears, 46.8 M parameters at rank 32). musubi's default adds the SwiGLUs and the Linears
#: outside the blocks (264).
ATTENTION_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.to_gate")

#: Krea2Pipeline's taps (``text_encoder_select_layers``): indices into Qwen3-VL's ``hidden_states``.
TEXT_TAPS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)
#: ``prompt_template_encode_start_idx``: the system turn and "<|im_start|>user\n" (Qwen-Image's 34 tokens).
DROP = 34
#: The tiny fixtures' word-level tokenizer cuts the same prefix into this many tokens (Qwen-Image's tiny count).
TINY_DROP = 31
#: The tiny Qwen3-VL's taps (3 layers; the tiny transformer's ``num_text_layers`` is 3).
TINY_TAPS = (1, 2, 3)

#: The pipeline's resolution-aware shift: mu 0.5 at 256 image tokens .. 1.15 at 6400 (1280²); Turbo's fixed mu.
BASE_SEQ, MAX_SEQ, BASE_SHIFT, MAX_SHIFT = 256, 6400, 0.5, 1.15
TURBO_MU = 1.15

#: The Linears outside the blocks (622 M): the global modulation, the text projection and the text-fusion stage.
#: Each runs once per forward on inputs that carry no gradient; int8 in a slab, and on the host between forwards
#: with ``outer_on_host``. Every Krea 2 (and the tiny model) has 2 layer-wise + 2 refiner fusion blocks.
_FUSION_LINEARS = tuple(f"text_fusion.{kind}.{i}.{linear}" for kind in ("layerwise_blocks", "refiner_blocks")
                        for i in range(2) for linear in ATTENTION_TARGETS + ("ff.gate", "ff.up", "ff.down"))
OUTER_LINEARS = ("time_mod_proj", "txt_in.linear_1", "txt_in.linear_2") + _FUSION_LINEARS

_TEMPLATE = PromptTemplate(style="plain", prefix=SYSTEM_PREFIX, suffix=SUFFIX)


class Krea2Memory(MemoryProfile):
    """Krea 2's token-wise part: every block's SwiGLU (16384 wide, 2.7x the width)."""

    def install_chunked_recompute(self, model: nn.Module, chunks: int, undo) -> None:
        from ..recompute import chunk_token_wise

        for block in model.transformer_blocks:
            chunk_token_wise(block.ff, chunks, undo)


class Krea2Schedule(NoiseSchedule):
    """The resolution-aware exponential shift of Krea2Pipeline (Raw), for training and sampling."""

    def train_shift_mu(self, latents: torch.Tensor) -> float:
        """``calculate_shift(image tokens, 256, 6400, 0.5, 1.15)``: ai-toolkit's Krea 2 train scheduler and musubi's
        ``krea2_shift`` (musubi's fixed alternative, shift 2.5, is this mu at 1024²)."""
        return linear_mu((latents.shape[-2] // 2) * (latents.shape[-1] // 2), BASE_SEQ, MAX_SEQ, BASE_SHIFT,
                         MAX_SHIFT)


class Krea2Family(ModelFamily):
    id = "krea2"
    display_name = "Krea 2"
    diffusers_class_name = "Krea2Transformer2DModel"
    variants = {
        "krea2-raw": "krea2.json",  # first: what identification returns for the shared config
        "krea2-turbo": "krea2.json",
        # Tiny random model for tests and the demo (width 64, 2 blocks, a 3-tap text stack of width 32).
        "krea2-tiny": "krea2-tiny.json",
    }
    tiny_variant = "krea2-tiny"
    structural_keys = ("num_layers", "attention_head_dim", "num_attention_heads", "num_key_value_heads",
                       "intermediate_size", "text_hidden_dim", "num_text_layers", "in_channels")

    # Raw trains and samples under the resolution-aware shift; the model answers the velocity at sigma (the default).
    schedule = Krea2Schedule()
    memory = Krea2Memory(
        block_lists=("transformer_blocks",),
        int8_extra_linears=OUTER_LINEARS,
        # Single stream: every block Linear runs on the [text, image] sequence; none reads the time embedding.
        # activation_scale: Flux.1's constants until GPU rows fit Krea 2 (the bench command is in the README row).
        activation_scale=1.0,
        chunked_recompute=True,
    )
    lora = LoraForm(
        targets={"transformer_blocks": ATTENTION_TARGETS},
        architecture="krea2/lora",
        # ComfyUI maps diffusers-named Krea 2 LoRAs (``transformer.transformer_blocks.N.attn.to_q`` and the bare name)
        # onto the native weights through ``comfy.utils.krea2_to_diffusers`` (comfy/lora.py, Krea2 branch).
        comfyui_form="diffusers_names",
    )
    file_help = {
        "checkpoint": "krea2_raw_bf16.safetensors or krea2_raw_fp8_scaled.safetensors (train on Raw; Turbo files "
                      "load and preview as Turbo; int8_convrot files are refused: use bf16 or fp8_scaled)",
        "pipeline": "text_encoder (Qwen3-VL-4B; layers 0-34 are read), tokenizer, vae (AutoencoderKLQwenImage)",
        "single_files": "qwen3vl_4b_bf16.safetensors or qwen3vl_4b_fp8_scaled.safetensors (inside ComfyUI its bundled "
                        "Qwen tokenizer is used) and qwen_image_vae.safetensors",
    }

    # --- identity --------------------------------------------------------------------------------

    def looks_like_single_file(self, keys: set[str]) -> bool:
        """ComfyUI's own test (``txtfusion.projector.weight``) plus a native main block."""
        return "txtfusion.projector.weight" in keys and "blocks.0.attn.wq.weight" in keys

    def param_table(self, config: dict[str, Any]) -> list[NativeParam]:
        return krea2_param_table(self, config)

    def variant_from_name(self, variant: str, name: str, keys: frozenset[str] | set[str] = frozenset()) -> str:
        if variant not in ("krea2-raw", "krea2-turbo"):
            return variant  # the tiny model, or a custom config
        return "krea2-turbo" if "turbo" in name.lower() else "krea2-raw"

    # --- text ------------------------------------------------------------------------------------

    def text_encoder_specs(self, variant: str) -> tuple[TextEncoderSpec, ...]:
        """Qwen3-VL-4B's twelve taps stacked per token ((L, 12 * 2560)), the template's first 34 tokens dropped,
        each caption at its own length (see the module doc)."""
        if variant == self.tiny_variant:
            return (TextEncoderSpec("text_encoder", "tokenizer", "decoder_lm", 32, "prompt_embeds",
                                    hidden_layers=TINY_TAPS, length="variable", template=_TEMPLATE,
                                    drop_tokens=TINY_DROP),)
        return (TextEncoderSpec("text_encoder", "tokenizer", "decoder_lm", 512, "prompt_embeds",
                                hidden_layers=TEXT_TAPS, length="variable", template=_TEMPLATE,
                                architecture="qwen3-vl-4b", drop_tokens=DROP, comfyui_tokenizer="qwen25_tokenizer"),)

    def text_widths(self, config: dict[str, Any]) -> dict[str, int]:
        return {"prompt_embeds": int(config["num_text_layers"]) * int(config["text_hidden_dim"])}

    # --- latents ---------------------------------------------------------------------------------

    def vae_for(self, variant: str | None) -> VaeSpec:
        return QWEN_IMAGE_VAE

    def latent_shape(self, model: nn.Module, width: int, height: int, frames: int = 1) -> tuple[int, ...]:
        """(16, H/8, W/8): one frame of the Qwen-Image VAE (packed 2x2 in ``model_inputs``)."""
        image_only(self, frames)
        return (int(model.config.in_channels) // 4, height // 8, width // 8)

    # --- the forward -----------------------------------------------------------------------------

    def model_inputs(self, model: nn.Module, latents: torch.Tensor, embeds: dict[str, torch.Tensor],
                     sigmas: torch.Tensor, guidance: float) -> dict[str, Any]:
        """Keyword arguments of ``Krea2Transformer2DModel.forward`` for latents (B, 16, h, w): packed 2x2; the cached
        stack (B, L, K * D) back to (B, L, K, D) with its mask as bool (all real without one); sigma; the pipeline's
        position ids (``Krea2Pipeline.prepare_position_ids``). ``guidance`` is unused (no guidance embedding)."""
        b, _, h, w = latents.shape
        prompt = embeds["prompt_embeds"]
        if prompt.shape[0] != b:
            raise ValueError(f"Krea 2 batch mismatch: {b} latents, {prompt.shape[0]} captions")
        layers, width = int(model.config.num_text_layers), int(model.config.text_hidden_dim)
        if prompt.shape[-1] != layers * width:
            raise ValueError(f"Krea 2 text embeddings are {prompt.shape[-1]} wide; this model takes {layers} stacked "
                             f"hidden states of {width} ({layers * width}): rebuild the dataset cache for this model")
        mask = embeds.get("prompt_embeds_mask")  # TextEncoderSpec("prompt_embeds").mask_key
        return {
            "hidden_states": pack_2x2(latents),
            "encoder_hidden_states": prompt.to(latents.dtype).unflatten(-1, (layers, width)),
            "timestep": self.schedule.prediction.model_timestep(sigmas.to(latents.device)).to(latents.dtype),
            "position_ids": position_ids(prompt.shape[1], h // 2, w // 2, latents.device),
            "encoder_attention_mask": None if mask is None else mask.to(latents.device).bool(),
            "return_dict": False,
        }

    def unpack_prediction(self, output: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return unpack_2x2(output, latents.shape[-2], latents.shape[-1])

    def guidance(self, variant: str) -> Guidance:
        """Raw (and the tiny model): Krea's CFG ``cond + 4.5 (cond - uncond)`` against the empty prompt, 28 steps (the
        pipeline's defaults). Turbo: no guidance, 8 steps, mu 1.15 at every resolution."""
        if variant == "krea2-turbo":
            return Guidance(mode="none", scale=0.0, steps=8, formula="z_image", sample_mu=TURBO_MU)
        return Guidance(mode="cfg", scale=4.5, steps=28, formula="z_image")


def position_ids(text_len: int, grid_h: int, grid_w: int, device) -> torch.Tensor:
    """``Krea2Pipeline.prepare_position_ids``: (text_len + grid_h * grid_w, 3), text rows zero, image rows (0, h, w)."""
    image = torch.zeros(grid_h, grid_w, 3, device=device)
    image[..., 1] = torch.arange(grid_h, device=device)[:, None]
    image[..., 2] = torch.arange(grid_w, device=device)[None, :]
    return torch.cat([torch.zeros(text_len, 3, device=device), image.reshape(grid_h * grid_w, 3)], dim=0)
