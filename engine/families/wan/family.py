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
passes as one timestep per sample (``test_family`` checks the two agree).

Image-to-video (``i2v.py``): Wan 2.1 I2V 14B (``in_channels`` 36, CLIP ViT-H states through ``image_dim`` 1280)
and Wan 2.2 I2V-A14B's two experts (``in_channels`` 36, no CLIP; high / low by the file name, switching at sigma
0.9, not T2V's 0.875). The cache keeps each clip window's first-frame condition (and CLIP states) beside its latent
(``first_frame``); frame 0 stays in the loss, as the pipeline and the peers train these models.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ...errors import ConfigError
from ..base import ModelFamily
from ..specs import (FirstFrameCondition, Guidance, LoraForm, MemoryProfile, NoiseSchedule, Prediction,
                     StepConstants, TextEncoderSpec, VaeSpec, static_shift_mu)
from ..names import NativeParam
from .i2v import CONDITION_KEY, IMAGE_EMBEDS_KEY, WAN21_I2V, WAN22_I2V
from .names import wan_param_table
from .vae import WAN21_VAE, WAN22_VAE

#: Self- and cross-attention q/k/v/o in every block: DiffSynth's and musubi-tuner's Wan LoRAs (facts §3.7; both also
#: train the FFN: ``FFN_TARGETS``). 8 Linears per block; 14B at r16: 8 x 2 x 5120 x 16 x 40 = 52.4 M parameters.
ATTENTION_TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                     "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")
FFN_TARGETS = ("ffn.net.0.proj", "ffn.net.2")
#: Wan 2.1 I2V's image cross-attention (native ``cross_attn.k_img`` / ``v_img``): musubi-tuner's target rule and the
#: published I2V LoRAs carry them (facts §1.8); models without the CLIP path have no such Linears.
IMAGE_TARGETS = ("attn2.add_k_proj", "attn2.add_v_proj")

#: The hub schedulers' ``flow_shift`` (diffusers ``convert_wan_to_diffusers.py``): 3.0 T2V, 5.0 TI2V-5B.
FLOW_SHIFT_T2V, FLOW_SHIFT_TI2V = 3.0, 5.0
#: T2V-A14B: the high-noise expert runs at sampling timesteps >= 875 (``boundary_ratio``, facts §3.1).
A14B_BOUNDARY = 0.875
#: I2V-A14B: 0.9 (the official config, diffusers' conversion, musubi-tuner, DiffSynth; facts §1.4).
I2V_BOUNDARY = 0.9
TEXT_TOKENS = 512

_A14B = {"high_noise": "wan2.2-t2v-a14b-high-noise", "low_noise": "wan2.2-t2v-a14b-low-noise"}
#: Tiny stand-ins for the two experts (tests and the demo): wan-tiny's shapes, told apart by the name as A14B's are.
_A14B_TINY = {"high_noise": "wan-tiny-high-noise", "low_noise": "wan-tiny-low-noise"}
_I2V_A14B = {"high_noise": "wan2.2-i2v-a14b-high-noise", "low_noise": "wan2.2-i2v-a14b-low-noise"}
_I2V_TINY = {"high_noise": "wan2.2-i2v-tiny-high-noise", "low_noise": "wan2.2-i2v-tiny-low-noise"}
_HIGH = {_A14B["high_noise"]: _A14B["low_noise"], _A14B_TINY["high_noise"]: _A14B_TINY["low_noise"],
         _I2V_A14B["high_noise"]: _I2V_A14B["low_noise"], _I2V_TINY["high_noise"]: _I2V_TINY["low_noise"]}
_LOW = {low: high for high, low in _HIGH.items()}
_TI2V = ("wan2.2-ti2v-5b", "wan2.2-ti2v-tiny")
#: Image-to-video: Wan 2.1 I2V (with CLIP) and Wan 2.2 I2V (the 20 condition channels only).
_I2V21 = ("wan2.1-i2v-14b", "wan-i2v-tiny")
_I2V22 = ("wan2.2-i2v-a14b", "wan2.2-i2v-tiny", *_I2V_A14B.values(), *_I2V_TINY.values())


def _boundary(variant: str) -> float:
    return I2V_BOUNDARY if variant in _I2V22 else A14B_BOUNDARY


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
            return (_boundary(variant), 1.0)
        if variant in _LOW:
            return (0.0, _boundary(variant))
        return (0.0, 1.0)

    def preview_partner(self, variant: str) -> tuple[str, float] | None:
        """An A14B expert's previews need the other expert: WanPipeline(transformer=high, transformer_2=low,
        boundary_ratio=0.875) runs the high-noise one while the timestep is >= 875, the low-noise one below
        (I2V-A14B: WanImageToVideoPipeline with boundary_ratio 0.9)."""
        other = _HIGH.get(variant) or _LOW.get(variant)
        return (other, _boundary(variant)) if other else None


class WanLora(LoraForm):
    """Wan's targets; the image cross-attention's (``IMAGE_TARGETS``) only where the model has them (Wan 2.1 I2V)."""

    def target_modules(self, model: nn.Module) -> list[str]:
        names = set(dict(model.named_modules()))
        return [n for n in super().target_modules(model)
                if n in names or not n.endswith(tuple("." + t for t in IMAGE_TARGETS))]


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
        # Image-to-video (``i2v.py``): 36 input channels; Wan 2.1 I2V also takes CLIP states (image_dim).
        "wan2.1-i2v-14b": "wan2.1-i2v-14b.json",  # 480p and 720p: one architecture
        "wan2.2-i2v-a14b": "wan2.2-i2v-a14b.json",  # the shape only: a file is one expert, by its name
        "wan2.2-i2v-a14b-high-noise": "wan2.2-i2v-a14b.json",
        "wan2.2-i2v-a14b-low-noise": "wan2.2-i2v-a14b.json",
        "wan-i2v-tiny": "wan-i2v-tiny.json",  # tests: Wan 2.1 I2V's layout (CLIP path) at wan-tiny's width
        "wan2.2-i2v-tiny": "wan2.2-i2v-tiny.json",  # tests: Wan 2.2 I2V's layout; its experts by name, as A14B's
        "wan2.2-i2v-tiny-high-noise": "wan2.2-i2v-tiny.json",
        "wan2.2-i2v-tiny-low-noise": "wan2.2-i2v-tiny.json",
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
        # The allocator's holes at an 8 GB cap, whole blocks: the step's largest request is the fp32 residual,
        # ``hidden.float() + attn * gate`` (640 MiB at 832x480x81): Wan 2.2 A14B, 40 of 40 blocks streamed, 9 token
        # chunks, ran out of memory asking for it with 0.49-1.24 GiB unusable (2xH200 2026-11-27,
        # bench/logs/experts_wan_oom_session5.log; 2xH100 2026-11-28, bench/logs/experts_wan_oom_session7_h100x2.log):
        # 2.12x the plan's largest tensor (0.67 GB) beyond the predicted peak (tests/test_plan_margin.py). Blocks that
        # run whole (partial or no activation offload) still make that request.
        fragmentation=2.2,
        # Blocks in parts: their fp32 norms and residuals run in token slices (``parts.py``, ``fp32_chunks.py``), so
        # that request is gone. Refit on 2xH200, 2026-11-28 (bench/logs/issue39_wan_i2v_8gb_session10_h200x2.log): at
        # an 8.0 GB cap, Wan 2.2 I2V-A14B (a 0.95 GB margin, 1.4x) and Wan 2.1 I2V 14B (0.82 GB, 1.2x) trained 40
        # streamed blocks in parts, peak 6.67 / 6.84 GB allocated, 7.54 / 7.99 GB reserved; then at ``auto`` 8 GB with
        # 1.4 (bench/logs/issue39_wan_i2v_auto8_session10_h200x2.log): 6.56 / 6.84 GB allocated, 7.88 / 7.91 GB
        # reserved. 1.4: the larger margin that ran; thin (Wan 2.1 I2V reserved 7.99 of 8.0 GB at 1.2).
        parts_fragmentation=1.4,
        # Blocks in parts (``block_parts``): the largest part is self-attention (its norm, q/k/v and their norms, the
        # unchunked attention's backward), which no token chunk reaches, so the working set is the same at any number
        # of chunks (``parts_chunked=False``). Measured on 2xH200, 2026-11-28 (the log above), 832x480x81 with the fp32
        # slices: 5.84 GB of activations at the peak for both I2V models, whole (``auto`` 12 GB, 38-39 of 40 blocks
        # streamed) and in 9 chunks (the 8 GB rows): 15.1-15.2 B*T*D units (each peak less the predicted ring,
        # LoRA and kept inputs), 0.444 x Flux.1's unchunked line (34.2). Before the slices: 18.2 units (8.80 GB at
        # ``auto`` 12 GB, bench/logs/issue39_wan_i2v_ram_session9_h200x2.log).
        parts_activation_scale=0.45,
        parts_chunked=False,
        # Compiled at an activation-memory budget below 1 (auto's 0.5), in token chunks, the compile saved nothing
        # here: measured on an H200, 2026-11-28 (bench/logs/issue39_wan_i2v_8gb_session9_h200x2.log), before the fp32
        # slices: Wan 2.2 I2V-A14B and Wan 2.1 I2V 14B at 832x480x81, 40 of 40 blocks streamed in parts, 9 chunks,
        # budget 0.5: 6.87 / 6.86 GB of activations at step 1's peak, 18.2 B*T*D units of block working set (both ran
        # out of memory at an 8 GB cap in step 2 on Flux.1's compiled line). The slices now stay eager inside compiled
        # blocks too (``fp32_chunks.py``), so this is an upper bound, not remeasured: 1.19x the eager parts' 15.4
        # (``parts_activation_scale``). Applied to whole-block compiled plans too (partial or no activation offload,
        # a split's parts): 1.19x the whole block's eager line there, not measured.
        compiled_activation_scale=1.19,
        temporal_compression=4,  # the causal VAE: the first frame alone, then 4 per latent frame
        # The time embedding and its projection to the blocks' six modulation vectors (the blocks add their own
        # scale_shift_table: no Linear of theirs is constant).
        step_constants=StepConstants(source="condition_embedder.time_embedder",
                                     modules={"condition_embedder.time_proj": "silu"}),
    )
    lora = WanLora(
        targets={"blocks": ATTENTION_TARGETS + IMAGE_TARGETS},
        architecture="wan/lora",
        # ComfyUI 0.33 maps no diffusers name of Wan (facts §3.6): the LoRA carries the native module names
        # (``diffusion_model.blocks.N.self_attn.q``), one native Linear per diffusers Linear.
        comfyui_form="native_fused",
    )
    file_help = {
        "checkpoint": "wan2.1_t2v_1.3B_bf16.safetensors, wan2.1_t2v_14B_bf16.safetensors, "
                      "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors / wan2.2_t2v_low_noise_14B_fp8_scaled."
                      "safetensors (one expert per file), wan2.2_ti2v_5B_fp16.safetensors; image-to-video: "
                      "wan2.2_i2v_high_noise_14B_fp8_scaled.safetensors / wan2.2_i2v_low_noise_14B_fp8_scaled."
                      "safetensors, wan2.1_i2v_480p_14B_fp16.safetensors (or 720p)",
        "pipeline": "text_encoder (UMT5EncoderModel), tokenizer, vae (AutoencoderKLWan); Wan 2.1 I2V also "
                    "image_encoder (CLIPVisionModel) and image_processor",
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
        """A 14B file named ``..._high_noise_...`` / ``..._low_noise_...`` is that Wan 2.2 A14B expert (T2V, or I2V
        for a 36-channel file). A Wan 2.2 I2V file must say which expert it is: its shapes do not (the boundary of
        its noise levels depends on it)."""
        lower = name.lower().replace("-", "_")
        for base, experts in (("wan2.1-t2v-14b", _A14B), ("wan-tiny", _A14B_TINY), ("wan2.2-i2v-a14b", _I2V_A14B),
                              ("wan2.2-i2v-tiny", _I2V_TINY)):
            if variant == base or variant in experts.values():
                for key, expert in experts.items():
                    if key in lower:
                        return expert
        if variant == "wan2.2-i2v-a14b":
            raise ConfigError(f"'{name}' is a Wan 2.2 I2V-A14B expert, but its name does not say which one; the two "
                              f"experts have the same shapes and train on different noise levels (high noise: sigma "
                              f">= {I2V_BOUNDARY}). Keep ComfyUI's names (wan2.2_i2v_high_noise_14B_fp8_scaled / "
                              f"wan2.2_i2v_low_noise_14B_fp8_scaled) or put high_noise / low_noise in the file name")
        return variant

    # --- text ------------------------------------------------------------------------------------

    def text_encoder_specs(self, variant: str) -> tuple[TextEncoderSpec, ...]:
        """umT5-XXL's last hidden state, 512 tokens, zero rows after each caption (``zero_padded``)."""
        tiny = variant.startswith("wan-tiny") or variant.startswith("wan2.2-i2v-tiny") or variant == "wan2.2-ti2v-tiny"
        # The tiny fixtures: short. Wan 2.1 I2V's image cross-attention splits its keys at 512 text rows (diffusers
        # hard-codes it), so its tiny stand-in keeps 512.
        length = 32 if tiny else TEXT_TOKENS
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
        out = {
            "hidden_states": _with_condition(model, latents, embeds),
            "timestep": self.schedule.prediction.model_timestep(sigmas.to(latents.device, torch.float32)),
            "encoder_hidden_states": prompt,
            "return_dict": False,
        }
        if model.config.image_dim is not None:  # Wan 2.1 I2V: CLIP states of the first frame
            if IMAGE_EMBEDS_KEY not in embeds:
                raise ValueError(f"this Wan image-to-video model takes CLIP image states ('{IMAGE_EMBEDS_KEY}'), which "
                                 f"the dataset cache lacks; build the cache with this model (Cache Text Embeds)")
            out["encoder_hidden_states_image"] = embeds[IMAGE_EMBEDS_KEY].to(latents.dtype)
        return out

    def unpack_prediction(self, output: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return output

    def first_frame(self, variant: str) -> FirstFrameCondition | None:
        """Image-to-video: the 20 condition channels of each clip's first frame (``i2v.py``), and for Wan 2.1 I2V
        CLIP ViT-H's states of it."""
        return WAN21_I2V if variant in _I2V21 else WAN22_I2V if variant in _I2V22 else None

    def guidance(self, variant: str) -> Guidance:
        """CFG ``uncond + g (cond - uncond)`` against the empty prompt: g = 5 (WanPipeline's default; Wan 2.1 and
        TI2V-5B's official one, and WanImageToVideoPipeline's default for Wan 2.1 I2V); the A14B experts' official
        (low 3.0, high 4.0); I2V-A14B's official 3.5 for both (``wan_i2v_A14B.py``). 20 preview steps."""
        if variant in _I2V22:
            return Guidance(mode="cfg", scale=3.5, steps=20, formula="standard")
        scale = 4.0 if variant in _HIGH else 3.0 if variant in _LOW else 5.0
        return Guidance(mode="cfg", scale=scale, steps=20, formula="standard")


def _with_condition(model: nn.Module, latents: torch.Tensor, embeds: dict[str, torch.Tensor]) -> torch.Tensor:
    """The transformer's input: the noisy latents, and for an image-to-video model (36 input channels) the 20
    channels of the first frame's condition after them, as WanImageToVideoPipeline concatenates them."""
    extra = int(model.config.in_channels) - latents.shape[1]
    if extra == 0:
        return latents
    cond = embeds.get(CONDITION_KEY)
    if cond is None:
        raise ValueError(f"this Wan image-to-video model takes {extra} condition channels (the first frame and its "
                         f"mask, '{CONDITION_KEY}'), which the dataset cache lacks; build the cache with this model "
                         f"(Cache Text Embeds)")
    if cond.shape[1] != extra or cond.shape[2:] != latents.shape[2:] or cond.shape[0] != latents.shape[0]:
        raise ValueError(f"Wan '{CONDITION_KEY}' {tuple(cond.shape)} does not fit latents {tuple(latents.shape)} "
                         f"(it needs {extra} channels of the same batch, frames and size)")
    return torch.cat([latents, cond.to(latents.dtype)], dim=1)
