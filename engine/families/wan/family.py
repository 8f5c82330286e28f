"""Wan 2.1 / 2.2 (Alibaba Wan-AI) text-to-video on diffusers' ``WanTransformer3DModel`` (diffusers 0.42.1).

Facts (../../../shared/reference/new-families-facts.md §3; checked against diffusers 0.42.1 ``transformer_wan.py``,
``pipeline_wan.py``, ``scheduling_unipc_multistep.py`` and ``scripts/convert_wan_to_diffusers.py``):

- ``blocks``: self-attention over the video tokens (3-D RoPE), cross-attention to 512 umT5 tokens, a GELU FFN,
  a per-block 6 x dim modulation table; biases on every Linear. No joint attention, no ids: the model patchifies
  (Conv3d 1x2x2) and builds RoPE from the input shape.
- Forward: ``hidden_states`` (B, C, F', h, w), ``timestep`` = 1000 sigma (raw), ``encoder_hidden_states``
  (B, 512, 4096) without a mask. It answers the velocity ``noise - x0``.
- Latents: (C, (F - 1) // 4 + 1, H / 8, W / 8) from the Wan 2.1 VAE (C = 16), an image being one frame; TI2V-5B
  uses the Wan 2.2 VAE (C = 48, H / 16, W / 16). Both normalised per channel (``vae.py``).
- Text: umT5-XXL's encoder, run with the attention mask, each caption's states followed by zero rows up to 512
  (``WanPipeline._get_t5_prompt_embeds``: ``u[:v]`` then zeros).
- Variants: Wan 2.1 T2V 1.3B and 14B; Wan 2.2 T2V-A14B's two experts (each the 14B shape, told apart by the file
  or folder name: ``high_noise`` / ``low_noise``); Wan 2.2 TI2V-5B.
- Sampling: CFG ``uncond + g (cond - uncond)`` (WanPipeline), the hub scheduler's flow sigmas (UniPC
  ``use_flow_sigmas``: ``linspace(1, 1/1000, N + 1)[:-1]`` under the static shift ``flow_shift``: 3.0 for T2V,
  5.0 for TI2V-5B, as diffusers' conversion script writes the hub configs), stepped with Euler here.
- Training: sigmas under the same static shift (``flow_shift``).

TI2V-5B's pipeline gives the transformer per-token timesteps (``expand_timesteps``), so the clean first frame of
image-to-video can sit at t = 0; in text-to-video every token has the same t, which is what ``model_inputs``
passes as one timestep per sample (``test_family`` checks the two agree). I2V (image conditioning) is not
supported yet: files named "i2v" are refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ...errors import ConfigError
from ..base import ModelFamily
from ..specs import (Guidance, LoraForm, MemoryProfile, NoiseSchedule, Prediction, StepConstants, TextEncoderSpec,
                     VaeSpec, static_shift_mu)
from ..names import NativeParam
from .names import wan_param_table
from .vae import WAN21_VAE, WAN22_VAE

#: Self- and cross-attention q/k/v/o in every block: DiffSynth's and musubi-tuner's Wan LoRAs (facts §3.7; both also
#: train the FFN: ``FFN_TARGETS``). 8 Linears per block; 14B at r16: 8 x 2 x 5120 x 16 x 40 = 52.4 M parameters.
ATTENTION_TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                     "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")
FFN_TARGETS = ("ffn.net.0.proj", "ffn.net.2")

#: The hub schedulers' ``flow_shift`` (diffusers ``convert_wan_to_diffusers.py``): 3.0 T2V, 5.0 TI2V-5B.
FLOW_SHIFT_T2V, FLOW_SHIFT_TI2V = 3.0, 5.0
#: T2V-A14B: the high-noise expert runs at sampling timesteps >= 875 (``boundary_ratio``, facts §3.1).
A14B_BOUNDARY = 0.875
TEXT_TOKENS = 512

_A14B = {"high_noise": "wan2.2-t2v-a14b-high-noise", "low_noise": "wan2.2-t2v-a14b-low-noise"}
#: Tiny stand-ins for the two experts (tests and the demo): wan-tiny's shapes, told apart by the name as A14B's are.
_A14B_TINY = {"high_noise": "wan-tiny-high-noise", "low_noise": "wan-tiny-low-noise"}
_HIGH = {_A14B["high_noise"]: _A14B["low_noise"], _A14B_TINY["high_noise"]: _A14B_TINY["low_noise"]}
_LOW = {low: high for high, low in _HIGH.items()}
_TI2V = ("wan2.2-ti2v-5b", "wan2.2-ti2v-tiny")


def _spatial(out_channels: int) -> int:
    """Pixels per latent cell: the Wan 2.2 VAE's 48-channel latents are 16x, the Wan 2.1 VAE's 8x."""
    return 16 if int(out_channels) == 48 else 8


@dataclass(frozen=True)
class WanMemory(MemoryProfile):
    """Wan's blocks in three parts, the FFN in token chunks, and TI2V-5B's 16x VAE in the token count."""

    #: Blocks stream as three parts (``parts.py``) with activation offload: measured on the H100 (bench/NOTES.md
    #: "Wan (issue 25)"), A14B at 480x832x81 went from 12.05 GB (whole blocks, eager) to 8.20 GB (parts, eager).
    #: Compiled parts once failed in the backward (inductor returned the FFN part's modulation gradient as [5120]
    #: for a [1, 1, 5120] input); the parts now hand their modulation vectors on as constants
    #: (``constant_outputs``), so no part is asked for that gradient. A switch for tests and benches
    #: (``dataclasses.replace(FAMILY.memory, stream_in_parts=False)``).
    stream_in_parts: bool = True

    def image_tokens(self, width: int, height: int, variant: str = "") -> int:
        """One latent frame's tokens: 1x2x2 patches of the Wan 2.1 VAE's 8x latents, or of the Wan 2.2 VAE's 16x
        latents for TI2V-5B (a quarter as many)."""
        spatial = 32 if variant in _TI2V else 16
        return (width // spatial) * (height // spatial)

    def install_chunked_recompute(self, model: nn.Module, chunks: int, undo) -> None:
        """Every block's feed-forward (``ffn``: token-wise, the widest intermediates of a block) in
        checkpointed token chunks."""
        from ..recompute import chunk_token_wise

        for block in model.blocks:
            chunk_token_wise(block.ffn, chunks, undo)

    def block_parts(self, block: nn.Module):
        """With ``stream_in_parts``: a block as three parts (``parts.py``): self-attention (with the block's
        modulation), cross-attention, FFN; each checkpointed on its own, so a block's recompute + backward holds
        one part's intermediates, not the whole block's."""
        if not self.stream_in_parts:
            return None
        from diffusers.models.transformers.transformer_wan import WanTransformerBlock

        from .parts import wan_block_parts

        return wan_block_parts(block) if isinstance(block, WanTransformerBlock) else None


def flow_shift(latents: torch.Tensor) -> float:
    """The hub scheduler's ``flow_shift``: 5.0 for TI2V-5B (its 48-channel latents), 3.0 for T2V."""
    return FLOW_SHIFT_TI2V if latents.shape[1] == 48 else FLOW_SHIFT_T2V


class WanSchedule(NoiseSchedule):
    """The hub schedulers' static ``flow_shift``, UniPC's flow sigmas, and the A14B experts' halves of the path."""

    def train_shift_mu(self, latents: torch.Tensor) -> float:
        """The static ``flow_shift`` the pipeline samples with (musubi-tuner's ``--discrete_flow_shift 3.0``)."""
        return static_shift_mu(flow_shift(latents))

    def sample_sigmas(self, latents: torch.Tensor, steps: int) -> list[float]:
        """UniPCMultistepScheduler's flow sigmas with the hub config: ``linspace(1, 1/1000, steps + 1)[:-1]`` under
        the static shift, the first nudged below 1 by 1e-6 (as the scheduler does), then 0."""
        s = flow_shift(latents)
        base = np.linspace(1.0, 1.0 / 1000, steps + 1)[:-1]
        shifted = s * base / (1 + (s - 1) * base)
        if abs(shifted[0] - 1.0) < 1e-6:
            shifted[0] -= 1e-6
        return [float(x) for x in np.concatenate([shifted, [0.0]]).astype(np.float32)]

    def train_sigma_range(self, variant: str) -> tuple[float, float]:
        """The A14B experts split the noise levels at the pipeline's boundary (``boundary_ratio`` 0.875: the high-
        noise expert denoises sigma >= 0.875, the low-noise one below): each trains on its own side only."""
        if variant in _HIGH:
            return (A14B_BOUNDARY, 1.0)
        if variant in _LOW:
            return (0.0, A14B_BOUNDARY)
        return (0.0, 1.0)

    def preview_partner(self, variant: str) -> tuple[str, float] | None:
        """An A14B expert's previews need the other expert: WanPipeline(transformer=high, transformer_2=low,
        boundary_ratio=0.875) runs the high-noise one while the timestep is >= 875, the low-noise one below."""
        other = _HIGH.get(variant) or _LOW.get(variant)
        return (other, A14B_BOUNDARY) if other else None


class WanFamily(ModelFamily):
    id = "wan"
    display_name = "Wan"
    diffusers_class_name = "WanTransformer3DModel"
    variants = {
        "wan2.1-t2v-1.3b": "wan2.1-t2v-1.3b.json",
        "wan2.1-t2v-14b": "wan2.1-t2v-14b.json",  # first: a 14B shape is this unless the name says which expert
        "wan2.2-t2v-a14b-high-noise": "wan2.1-t2v-14b.json",  # same shapes (convert_wan_to_diffusers.py)
        "wan2.2-t2v-a14b-low-noise": "wan2.1-t2v-14b.json",
        "wan2.2-ti2v-5b": "wan2.2-ti2v-5b.json",
        "wan-tiny": "wan-tiny.json",  # tests and the demo (width 32, 2 blocks, the Wan 2.1 VAE)
        "wan-tiny-high-noise": "wan-tiny.json",  # tests: the A14B experts' roles on wan-tiny (by name, as A14B)
        "wan-tiny-low-noise": "wan-tiny.json",
        "wan2.2-ti2v-tiny": "wan2.2-ti2v-tiny.json",  # tests: 48 channels, the Wan 2.2 VAE
    }
    tiny_variant = "wan-tiny"
    structural_keys = ("num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim", "in_channels",
                       "out_channels", "text_dim", "image_dim", "added_kv_proj_dim")

    schedule = WanSchedule(Prediction(timestep="sigma_x1000", sign=+1))
    video = True
    memory = WanMemory(
        block_lists=("blocks",),
        # Which rows the block Linears multiply (MemoryProfile.linear_tokens: the step-time model's FLOPs).
        # The sequence is the video's tokens; the text enters only as cross-attention keys and values.
        block_list_tokens={"blocks": "image"},
        text_linears=("attn2.to_k", "attn2.to_v"),
        # Outside the blocks but large (14B: time_proj 157 M, text_embedder 47 M parameters): int8 in slabs.
        int8_extra_linears=("condition_embedder.time_proj", "condition_embedder.text_embedder.linear_1",
                            "condition_embedder.text_embedder.linear_2"),
        chunked_recompute=True,  # install_chunked_recompute: the FFN in token chunks
        # Blocks in parts (``block_parts``): the largest part, self-attention, holds 0.63 of the whole block's
        # recompute + backward working set with the FFN in token chunks (25.3 of 40.5 B*T*D units alive at once;
        # 0.50 of the bytes saved for backward; 0.50-0.56 unchunked), the same for every variant:
        # bench/parts_working_set.py on CPU (bf16, LoRA on q/k/v/o, head dim 128). An estimate, not a GPU fit:
        # refit on the bench rows of blocks in parts.
        parts_activation_scale=0.63,
        temporal_compression=4,  # the causal VAE: the first frame alone, then 4 per latent frame
        # The time embedding and its projection to the blocks' six modulation vectors (the blocks add their own
        # scale_shift_table: no Linear of theirs is constant).
        step_constants=StepConstants(source="condition_embedder.time_embedder",
                                     modules={"condition_embedder.time_proj": "silu"}),
    )
    lora = LoraForm(
        targets={"blocks": ATTENTION_TARGETS},
        architecture="wan/lora",
        # ComfyUI 0.33 maps no diffusers name of Wan (facts §3.6): the LoRA carries the native module names
        # (``diffusion_model.blocks.N.self_attn.q``), one native Linear per diffusers Linear.
        comfyui_form="native_fused",
    )
    file_help = {
        "checkpoint": "wan2.1_t2v_1.3B_bf16.safetensors, wan2.1_t2v_14B_bf16.safetensors, "
                      "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors / wan2.2_t2v_low_noise_14B_fp8_scaled."
                      "safetensors (one expert per file) or wan2.2_ti2v_5B_fp16.safetensors",
        "pipeline": "text_encoder (UMT5EncoderModel), tokenizer, vae (AutoencoderKLWan)",
        "single_files": "umt5_xxl_fp8_e4m3fn_scaled.safetensors (or umt5_xxl_fp16; the tokenizer it embeds is used) "
                        "and wan_2.1_vae.safetensors (wan2.2_vae.safetensors for TI2V-5B)",
    }

    # --- identity --------------------------------------------------------------------------------

    def looks_like_single_file(self, keys: set[str]) -> bool:
        """ComfyUI's own test (model_detection: ``head.modulation``) plus the native block names."""
        return ("head.modulation" in keys and "patch_embedding.weight" in keys
                and "blocks.0.self_attn.q.weight" in keys and "blocks.0.cross_attn.k.weight" in keys)

    def param_table(self, config: dict[str, Any]) -> list[NativeParam]:
        return wan_param_table(self, config)

    def variant_from_name(self, variant: str, name: str, keys: frozenset[str] | set[str] = frozenset()) -> str:
        """A 14B file named ``..._high_noise_...`` / ``..._low_noise_...`` is that Wan 2.2 A14B expert; I2V files
        are refused (image conditioning is not supported yet)."""
        lower = name.lower().replace("-", "_")
        if "i2v" in lower and "ti2v" not in lower:
            raise ConfigError(f"'{name}' looks like a Wan image-to-video model. I2V LoRAs need image conditioning "
                              f"(first-frame latents, a mask), which lowvram-lora does not support yet; train on the "
                              f"T2V files (wan2.2_t2v_high_noise_14B / low_noise, wan2.1_t2v_*, wan2.2_ti2v_5B)")
        for base, experts in (("wan2.1-t2v-14b", _A14B), ("wan-tiny", _A14B_TINY)):
            if variant == base:
                for key, expert in experts.items():
                    if key in lower:
                        return expert
        return variant

    # --- text ------------------------------------------------------------------------------------

    def text_encoder_specs(self, variant: str) -> tuple[TextEncoderSpec, ...]:
        """umT5-XXL's last hidden state, 512 tokens, zero rows after each caption (``zero_padded``)."""
        tiny = variant.startswith("wan-tiny") or variant == "wan2.2-ti2v-tiny"
        length = 32 if tiny else TEXT_TOKENS  # the tiny fixtures: short
        return (TextEncoderSpec("text_encoder", "tokenizer", "umt5", length, "prompt_embeds", length="zero_padded"),)

    def text_widths(self, config: dict[str, Any]) -> dict[str, int]:
        return {"prompt_embeds": int(config["text_dim"])}

    # --- latents ---------------------------------------------------------------------------------

    def vae_for(self, variant: str | None) -> VaeSpec:
        """The Wan 2.2 VAE for TI2V-5B, the Wan 2.1 VAE for everything else."""
        return WAN22_VAE if variant in _TI2V else WAN21_VAE

    def latent_shape(self, model: nn.Module, width: int, height: int, frames: int = 1) -> tuple[int, ...]:
        """(C, (F - 1) // 4 + 1, H / s, W / s): the causal VAE keeps the first frame alone, then one latent frame
        per 4; s = 8 (Wan 2.1 VAE) or 16 (Wan 2.2 VAE, 48 channels). Frames must be 4k + 1."""
        if frames < 1 or (frames - 1) % 4:
            raise ConfigError(f"Wan takes 4k + 1 frames (1, 5, ..., 81), not {frames}")
        c = int(model.config.out_channels)
        s = _spatial(c)
        return (c, (frames - 1) // 4 + 1, height // s, width // s)

    # --- training --------------------------------------------------------------------------------

    def model_inputs(self, model: nn.Module, latents: torch.Tensor, embeds: dict[str, torch.Tensor],
                     sigmas: torch.Tensor, guidance: float) -> dict[str, Any]:
        """Keyword arguments of ``WanTransformer3DModel.forward`` for latents (B, C, F', h, w): the zero-padded
        umT5 states (no mask: the model attends all 512 rows), timestep = 1000 sigma kept in fp32 (bf16 would round
        999 to 1000). ``guidance`` is unused (no guidance embedding)."""
        if latents.dim() != 5:
            raise ValueError(f"Wan takes latents (B, C, frames, h, w); got shape {tuple(latents.shape)}")
        prompt = embeds["prompt_embeds"].to(latents.dtype)
        if prompt.shape[0] != latents.shape[0]:
            raise ValueError(f"Wan batch mismatch: {latents.shape[0]} latents, {prompt.shape[0]} captions")
        return {
            "hidden_states": latents,
            "timestep": self.schedule.prediction.model_timestep(sigmas.to(latents.device, torch.float32)),
            "encoder_hidden_states": prompt,
            "return_dict": False,
        }

    def unpack_prediction(self, output: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return output

    def guidance(self, variant: str) -> Guidance:
        """CFG ``uncond + g (cond - uncond)`` against the empty prompt: g = 5 (WanPipeline's default; Wan 2.1 and
        TI2V-5B's official one); the A14B experts' official (low 3.0, high 4.0). 20 preview steps."""
        scale = 4.0 if variant in _HIGH else 3.0 if variant in _LOW else 5.0
        return Guidance(mode="cfg", scale=scale, steps=20, formula="standard")
