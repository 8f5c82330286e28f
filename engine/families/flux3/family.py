"""FLUX.3 Image Klein (Black Forest Labs, 5.5B; Base and the step-distilled flow map) on diffusers'
``Flux3Transformer2DModel`` (0.42.1; the pipelines are modular: ``Flux3ModularPipeline``,
``Flux3DistilledModularPipeline``).

Facts (../../../shared/reference/families-2026-image-facts.md §1; checked against diffusers 0.42.1
``transformer_flux3.py`` and ``modular_pipelines/flux3/``):

- 43 blocks of one shape (122.7 M: separate q/k/v/out, a fused SwiGLU, a LayerNorm without affine, no modulation
  inside): ``txt_mode_blocks`` (5, the text alone), ``mode_blocks["image"]`` (5, the image alone),
  ``mode_blocks["image_cond"]`` (5, reference images alone: editing only), ``single_transformer_blocks`` (28, the joint
  [text, image] sequence). The modulation is per token from six Linears outside the blocks: image tokens at sigma,
  text (and references) at sigma 0; the flow map adds the embedding of the sigma each step jumps to.
- The forward takes the Flux.2 VAE's patchified, BatchNorm-normalised latents as tokens (B, N, 128), the stacked text
  (B, L, 20480) with **no mask** (the model attends to the text window's padding), sigma (x1000 inside), and 2-D
  position ids (t, h, w, l) shared by the batch: image (0, 0.5 h, 0.5 w, 0) (``image_rope_scale``), text
  (0, 0, 0, l). It answers the velocity ``noise - x0``.
- Text: Qwen3-VL-4B's ``hidden_states[4, 8, ..., 32]`` (raw layer outputs) stacked per token, one user turn and the
  assistant prompt, the window right-padded to a multiple of 80 with pad positions 1 (``Flux3TextEncoderStep``): a
  ``windowed`` text encoder spec; the cache keeps every caption's window, padding rows included.
- Sampling: sigmas ``linspace(1, 1/N, N)`` under the static shift 6.93. Base: CFG ``neg + g (pos - neg)`` with
  g = 3.5 against the empty prompt (diffusers' default; BFL's README says 4), 50 steps. The flow map: no guidance,
  16 steps, each forward told the sigma it jumps to (``Guidance.target_sigma``).

Training uses Base (BFL: "Fine-tuning, LoRA training, research -> FLUX 3 Image Klein Base"); the flow map needs the
target sigma of a sampling step and has no training target, so it previews only and training on it is refused by
name. A LoRA trained on Base applies to Base; whether it carries over to the distilled model is not checked here.

The reference-image blocks (``mode_blocks["image_cond"]``, 0.6 GB int8) never run without references: they are
Linears outside the streamed block lists, int8 in a slab and on the host between forwards with ``outer_on_host``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from ..base import ModelFamily, image_only
from ..flux2.family import FLUX2_VAE
from ..names import NativeParam
from ..specs import Guidance, LoraForm, MemoryProfile, NoiseSchedule, PromptTemplate, TextEncoderSpec, VaeSpec
from .names import flux3_param_table

#: Attention of every block that runs in text-to-image (musubi-style attention LoRA; 152 Linears, 14.9 M at rank 16).
ATTENTION_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")
#: ``Flux3TextEncoderStep``'s ``text_encoder_out_layers``: indices into Qwen3-VL's ``hidden_states``.
TEXT_TAPS = (4, 8, 12, 16, 20, 24, 28, 32)
#: The tiny Qwen3-VL's taps (4 layers, the last one never read: its output is the normed state).
TINY_TAPS = (1, 2, 3)
#: The text window is a multiple of this many tokens (``Flux3TextEncoderStep(pad_multiple=80)``).
PAD_MULTIPLE = 80
#: The longest window cached by default: the pipeline caps at 8192; 480 (6 windows) covers dense captions and stays
#: within Cache Text Embeds' max_sequence_length (512). A longer caption is cut at 480 tokens where the pipeline
#: would not cut it.
MAX_WINDOW = 480
#: ``Flux3SetTimestepsStep(shift=6.93)``: the constant shift of the FLUX.3 sampling recipe.
SHIFT = 6.93
#: ``Flux3PrepareLatentsStep(image_rope_scale=0.5)``: image H/W position ids are scaled by it.
IMAGE_ROPE_SCALE = 0.5
#: ``Flux3LoopDenoiser(guidance_scale=3.5)`` with ``ClassifierFreeGuidance``; 50 steps (``Flux3SetTimestepsStep``).
BASE_CFG, BASE_STEPS, DISTILLED_STEPS = 3.5, 50, 16

#: The Qwen chat turn written out (what Qwen3-VL's chat template renders for one user turn with the generation
#: prompt, and what ComfyUI's Qwen3-VL template writes), so ComfyUI's bundled Qwen tokenizer needs no template.
_TEMPLATE = PromptTemplate(style="plain", prefix="<|im_start|>user\n", suffix="<|im_end|>\n<|im_start|>assistant\n")

_MODES = ("image", "image_cond", "txt")
#: The Linears outside the streamed blocks: the per-token modulation heads (6 x 3072 -> 9216, run on every token),
#: the text projection (20480 -> 3072), and the reference-image blocks, which text-to-image never runs.
OUTER_LINEARS = (tuple(f"{kind}.{mode}.linear" for kind in ("early_stream_modulations", "single_stream_modulations")
                       for mode in _MODES) + ("context_embedder",))
_IMAGE_COND_LINEARS = ATTENTION_TARGETS + ("ff.linear_in", "ff.linear_out")


def outer_linears(num_layers: int) -> tuple[str, ...]:
    """``OUTER_LINEARS`` and every Linear of the ``num_layers`` reference-image blocks."""
    return OUTER_LINEARS + tuple(f"mode_blocks.image_cond.{i}.{linear}" for i in range(num_layers)
                                 for linear in _IMAGE_COND_LINEARS)


class Flux3Memory(MemoryProfile):
    """Every block's SwiGLU (9216 wide, 3x the width) runs token-wise beside its attention."""

    def install_chunked_recompute(self, model: nn.Module, chunks: int, undo) -> None:
        from ..recompute import chunk_token_wise

        for blocks in self.block_lists_of(model):
            for block in blocks:
                chunk_token_wise(block.ff, chunks, undo)


class Flux3Family(ModelFamily):
    id = "flux3"
    display_name = "FLUX.3 Image Klein"
    diffusers_class_name = "Flux3Transformer2DModel"
    variants = {
        "flux3-klein-base": "flux3-klein-base.json",  # first: what training uses
        "flux3-klein": "flux3-klein.json",  # the step-distilled flow map (flow_map: a target-timestep embedder)
        # Tiny random models for tests and the demo (width 32, 2 + 2 + 2 + 2 blocks, a 3-tap text stack of width 32).
        "flux3-tiny": "flux3-tiny.json",
        "flux3-tiny-distilled": "flux3-tiny-distilled.json",
    }
    tiny_variant = "flux3-tiny"
    structural_keys = ("num_layers", "num_single_layers", "attention_head_dim", "num_attention_heads",
                       "joint_attention_dim", "in_channels", "flow_map")

    schedule = NoiseSchedule(train_shift=SHIFT, sample_shift=SHIFT)
    memory = Flux3Memory(
        block_lists=("txt_mode_blocks", "mode_blocks.image", "single_transformer_blocks"),
        int8_extra_linears=outer_linears(5),
        block_list_tokens={"txt_mode_blocks": "text", "mode_blocks.image": "image"},
        # activation_scale: Flux.1's constants until GPU rows fit FLUX.3.
        activation_scale=1.0,
        chunked_recompute=True,
    )
    lora = LoraForm(
        targets={"txt_mode_blocks": ATTENTION_TARGETS, "mode_blocks.image": ATTENTION_TARGETS,
                 "single_transformer_blocks": ATTENTION_TARGETS},
        architecture="flux3/lora",
        # ComfyUI 0.33 has no FLUX.3: the file takes BFL's native module names with peft's lora_A / lora_B and the
        # scale folded in, which diffusers' Flux3LoraLoaderMixin converts and ComfyUI's generic loader maps where
        # its module names are BFL's (not verified: no ComfyUI with FLUX.3 was available).
        comfyui_form="native_names",
    )
    file_help = {
        "checkpoint": "FLUX 3 Image Klein Base as one BFL-named file (bf16 or fp8; train on Base; the step-distilled "
                      "flow-map file loads and previews in 16 steps but does not train)",
        "pipeline": "text_encoder (Qwen3-VL-4B; layers 0-31 are read), tokenizer, vae (AutoencoderKLFlux2)",
        "single_files": "qwen3vl_4b_bf16.safetensors or qwen3vl_4b_fp8_scaled.safetensors (inside ComfyUI its "
                        "bundled Qwen tokenizer is used) and flux2-vae.safetensors",
    }

    # --- identity --------------------------------------------------------------------------------

    def looks_like_single_file(self, keys: set[str]) -> bool:
        """diffusers' detection key (``early_stream_modulations.image.lin.weight``) plus a per-mode block."""
        return "early_stream_modulations.image.lin.weight" in keys and "txt_mode_blocks.0.q_proj.weight" in keys

    def param_table(self, config: dict[str, Any]) -> list[NativeParam]:
        return flux3_param_table(self, config)

    # --- text ------------------------------------------------------------------------------------

    def text_encoder_specs(self, variant: str) -> tuple[TextEncoderSpec, ...]:
        """Qwen3-VL-4B's eight taps stacked per token ((L, 8 * 2560)), each caption's window a multiple of 80 tokens
        with its padding kept (pad positions 1)."""
        tiny = variant in ("flux3-tiny", "flux3-tiny-distilled")
        return (TextEncoderSpec("text_encoder", "tokenizer", "decoder_lm", MAX_WINDOW, "prompt_embeds",
                                hidden_layers=TINY_TAPS if tiny else TEXT_TAPS, length="windowed",
                                pad_multiple=PAD_MULTIPLE, template=_TEMPLATE,
                                architecture="" if tiny else "qwen3-vl-4b",
                                comfyui_tokenizer="" if tiny else "qwen25_tokenizer"),)

    def text_widths(self, config: dict[str, Any]) -> dict[str, int]:
        return {"prompt_embeds": int(config["joint_attention_dim"])}

    # --- latents ---------------------------------------------------------------------------------

    def vae_for(self, variant: str | None) -> VaeSpec:
        return FLUX2_VAE

    def latent_shape(self, model: nn.Module, width: int, height: int, frames: int = 1) -> tuple[int, ...]:
        """(128, H/16, W/16): the Flux.2 VAE's patchified latents."""
        image_only(self, frames)
        return (int(model.config.in_channels), height // 16, width // 16)

    # --- the forward -----------------------------------------------------------------------------

    def model_inputs(self, model: nn.Module, latents: torch.Tensor, embeds: dict[str, torch.Tensor],
                     sigmas: torch.Tensor, guidance: float) -> dict[str, Any]:
        """Keyword arguments of ``Flux3Transformer2DModel.forward`` on latents (B, C, h, w): tokens in row-major order,
        the cached window as is (no mask: the model attends to it whole), sigma, the pipeline's position ids. The
        flow map takes ``embeds["target_sigmas"]`` (sampling only). ``guidance`` is unused."""
        b, c, h, w = latents.shape
        dtype, device = latents.dtype, latents.device
        prompt = embeds["prompt_embeds"]
        if prompt.shape[0] != b:
            raise ValueError(f"FLUX.3 batch mismatch: {b} latents, {prompt.shape[0]} captions")
        width = int(model.config.joint_attention_dim)
        if prompt.shape[-1] != width:
            raise ValueError(f"FLUX.3 text embeddings are {prompt.shape[-1]} wide; this model takes {width}: rebuild "
                             f"the dataset cache for this model")
        inputs = {
            "hidden_states": latents.reshape(b, c, h * w).permute(0, 2, 1),
            "encoder_hidden_states": prompt.to(dtype),
            "timestep": self.schedule.prediction.model_timestep(sigmas.to(device)).to(dtype),
            "img_ids": image_ids(h, w, device),
            "txt_ids": text_ids(prompt.shape[1], device),
            "return_dict": False,
        }
        if model.config.flow_map:
            target = embeds.get("target_sigmas")
            if target is None:
                raise ConfigError("the step-distilled FLUX 3 Image Klein (a flow map) is sampled, not trained: each of "
                                  "its forwards needs the noise level its sampling step jumps to. Train the LoRA on "
                                  "FLUX 3 Image Klein Base (BFL's recommendation for LoRA training)")
            inputs["target_timestep"] = target.to(device, dtype).expand(b)
        return inputs

    def unpack_prediction(self, output: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        b, c, h, w = latents.shape
        return output.permute(0, 2, 1).reshape(b, c, h, w)

    def guidance(self, variant: str) -> Guidance:
        """Base (and the tiny model): CFG ``neg + 3.5 (pos - neg)`` against the empty prompt, 50 steps
        (Flux3ModularPipeline's defaults). The flow map: no guidance, 16 steps, every forward given the sigma its
        step jumps to (Flux3DistilledModularPipeline)."""
        if variant in ("flux3-klein", "flux3-tiny-distilled"):
            return Guidance(mode="none", scale=0.0, steps=DISTILLED_STEPS, target_sigma=True)
        return Guidance(mode="cfg", scale=BASE_CFG, steps=BASE_STEPS, formula="standard")


def image_ids(grid_h: int, grid_w: int, device) -> torch.Tensor:
    """``_prepare_image_ids``: (grid_h * grid_w, 4) rows (0, 0.5 h, 0.5 w, 0) in token order."""
    ids = torch.zeros(grid_h, grid_w, 4, device=device)
    ids[..., 1] = torch.arange(grid_h, device=device)[:, None] * IMAGE_ROPE_SCALE
    ids[..., 2] = torch.arange(grid_w, device=device)[None, :] * IMAGE_ROPE_SCALE
    return ids.reshape(-1, 4)


def text_ids(length: int, device) -> torch.Tensor:
    """``_prepare_text_ids``: (length, 4) rows (0, 0, 0, l)."""
    ids = torch.zeros(length, 4, device=device)
    ids[:, 3] = torch.arange(length, device=device)
    return ids
