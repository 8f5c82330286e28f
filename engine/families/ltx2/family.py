"""LTX-2.3 and LTX-2.5 (Lightricks, 22B: a 19B joint audio-video transformer plus 3.2B of text connectors) on
diffusers' ``LTX2VideoTransformer3DModel`` (0.42.1). Video-only LoRA: the audio stream runs, frozen.

Facts (../../../shared/reference/families-2026-video-facts.md §2; checked against diffusers 0.42.1
``transformer_ltx2.py``, ``pipelines/ltx2/pipeline_ltx2.py``, ``connectors.py`` and
``single_file_utils.convert_ltx2_transformer_to_diffusers``):

- 48 ``transformer_blocks`` (773 MB bf16 / 387 MB int8 each), each with two residual streams: video (4096 wide,
  self-attention, cross-attention to the text, FFN) and audio (2048 wide, the same), joined by audio->video and
  video->audio cross-attention. 2.3 and 2.5 gate every attention (``to_gate_logits``) and modulate the text
  cross-attention with the noise level (``prompt_adaln``); 2.5 drops the video FFN's biases and adds a keyframe
  embedding (the file tells them apart by shape).
- Forward: packed video latents (B, F' h w, 128) (patch 1: a plain reshape), packed audio latents (B, L_a, 128),
  the connectors' video (B, 1024, 4096) and audio (B, 1024, 2048) text states (no mask: the registers fill every
  row), ``timestep`` = 1000 sigma, ``sigma`` = the same value for the prompt AdaLN (the pipeline passes
  ``sigma=timestep``), ``use_cross_timestep=True``, the latent grid and ``fps`` for RoPE. It answers the velocities
  ``noise - x0`` of both streams.
- Latents: the LTX-2 video VAE, 128 channels, 32x spatial, 8x temporal (causal: frames 8k + 1), normalised per
  channel (``vae.py``).

What the audio stream is fed (video-only training): the model cannot run without it (every block's video stream
reads the audio through the audio->video cross-attention, and the modulation of that attention reads the audio's
noise level). Training gives it pure Gaussian noise at audio sigma 1 (timestep 1000) for the clip's duration
(``audio_tokens``: 25 per second at the clip's frame rate), and takes no audio loss. At sigma 1 the noisy audio is
the noise whatever the clip's sound was, so this is an exact sample of the joint model's input with the unknown audio
marginalised out: no made-up audio content (zeros or silence encoded would be one particular soundtrack) enters the
video's training signal. It is the state a text-to-video generation starts its audio in. The noise is drawn from a
generator seeded by each sample's sigma (reproducible runs; a fresh draw per step). The audio modules get no LoRA
and no gradient flows to anything but the LoRA (the musubi fork's warning about audio LoRAs trained without an
audio signal; facts §2.6).

Image-to-video (``i2v.py``): the same checkpoint; the ``-i2v`` variants hold each clip's first frame clean at
per-token timestep 0, out of the loss (``model_inputs`` reads the held latents), as ``LTX2ImageToVideoPipeline`` does.

Text (``text.py``): Gemma 3 (2.3) / Gemma 4 (2.5) left-padded to 1024 tokens, every hidden state stacked, then the
connectors; the cache keeps the connectors' output (see ``text.py`` for why). ComfyUI's single files for the text path
and the VAE (LTX-2.3's Gemma file, the connectors and VAE bundled in the all-in-one checkpoint): ``comfy_files.py``.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from ..base import ModelFamily
from ..names import NativeParam
from ..specs import (HELD_KEY, HELD_ON_KEY, FirstFrameCondition, Guidance, JointStream, LoraForm, MemoryProfile,
                     NoiseSchedule, Prediction, TextEncoderSpec, TokenModulation, VaeSpec)
from .i2v import LTX2_I2V, conditioned_inputs
from .names import ltx2_param_table
from .text import PROMPT_KEY, text_spec
from .vae import LTX2_TINY_VAE, LTX2_VAE, LTX25_VAE

#: The video branch of every block: self-attention, text cross-attention and the FFN (the musubi fork's
#: ``video_sa_ca_ff`` preset; 10 Linears a block, 163.6 M parameters at rank 32 on 2.3). Nothing of the audio stream
#: or the audio<->video attention.
VIDEO_TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                 "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
                 "ff.net.0.proj", "ff.net.2")

#: The pipeline's default frame rate (``frame_rate=24``): RoPE's video positions and the audio's length follow it.
#: Training clips are resampled to the template's fps (24), so positions match the previews'.
FRAME_RATE = 24.0
#: Audio latents per second: 16000 Hz / hop 160 / 4 (the audio VAE's temporal compression; pipeline L1307-1310).
AUDIO_TOKENS_PER_SECOND = 16000 / 160 / 4
#: The pipeline's shift: ``calculate_shift(video tokens, 1024, 4096, 0.95, 2.05)`` (scheduler config).
BASE_SEQ, MAX_SEQ, BASE_SHIFT, MAX_SHIFT = 1024, 4096, 0.95, 2.05
#: The scheduler's ``shift_terminal`` (Lightricks' scheduler config): the last sigma before 0 is stretched to 0.1.
SHIFT_TERMINAL = 0.1
#: The audio stream's noise level while only the video trains (see the module doc).
AUDIO_SIGMA = 1.0
#: Where previews hand ``model_inputs`` the audio latents they step (``JointStream``).
AUDIO_KEY = "audio_latents"
#: LTX2Pipeline's defaults (and the official trainer's validation): video CFG 3, audio CFG 7.
VIDEO_CFG, AUDIO_CFG = 3.0, 7.0

#: Linears outside the blocks fed by the noise level only (2.3: time_embed 169 M, av cross-attention scale/shift
#: 85 M, prompt_adaln 51 M, audio_time_embed 43 M): int8 in a slab; once per forward on inputs without gradient.
OUTER_LINEARS = tuple(f"{m}.{lin}" for m in (
    "time_embed", "audio_time_embed", "av_cross_attn_video_scale_shift", "av_cross_attn_audio_scale_shift",
    "av_cross_attn_video_a2v_gate", "av_cross_attn_audio_v2a_gate", "prompt_adaln", "audio_prompt_adaln")
    for lin in ("emb.timestep_embedder.linear_1", "emb.timestep_embedder.linear_2", "linear"))


def video_tokens(latents: torch.Tensor) -> int:
    return int(latents.shape[-3] * latents.shape[-2] * latents.shape[-1])


def pixel_frames(latent_frames: int) -> int:
    """Pixel frames of a clip of ``latent_frames`` (the causal VAE: the first alone, then 8 per latent frame)."""
    return (int(latent_frames) - 1) * 8 + 1


def audio_tokens(latent_frames: int, fps: float = FRAME_RATE) -> int:
    """The pipeline's ``audio_num_frames``: round(duration * 25), the duration ``num_frames / frame_rate``."""
    return round(pixel_frames(latent_frames) / fps * AUDIO_TOKENS_PER_SECOND)


def shift_mu(latents: torch.Tensor) -> float:
    """``calculate_shift`` of the pipeline on the video tokens."""
    m = (MAX_SHIFT - BASE_SHIFT) / (MAX_SEQ - BASE_SEQ)
    return video_tokens(latents) * m + (BASE_SHIFT - m * BASE_SEQ)


class Ltx2Schedule(NoiseSchedule):
    """The pipeline's token-dependent exponential shift (training and previews) and its terminal stretch."""

    def train_shift_mu(self, latents: torch.Tensor) -> float:
        """The sampling shift at the clip's video tokens (the official trainer's ``shifted_logit_normal`` takes its
        shift from the sequence length the same way)."""
        return shift_mu(latents)

    def sample_sigmas(self, latents: torch.Tensor, steps: int) -> list[float]:
        """FlowMatchEulerDiscreteScheduler with Lightricks' config: ``linspace(1, 1/N, N)`` under the exponential
        shift at ``shift_mu``, stretched so the last one is ``shift_terminal``, then 0."""
        if steps < 2:  # one step from sigma 1: nothing to stretch (the scheduler divides by zero there)
            return [1.0, 0.0]
        mu = shift_mu(latents)
        base = np.linspace(1.0, 1.0 / steps, steps)
        shifted = math.exp(mu) / (math.exp(mu) + (1.0 / base - 1.0))
        one_minus = 1.0 - shifted
        stretched = 1.0 - one_minus / (one_minus[-1] / (1.0 - SHIFT_TERMINAL))
        return [float(x) for x in np.concatenate([stretched, [0.0]]).astype(np.float32)]


class Ltx2Memory(MemoryProfile):
    """The video FFN in token chunks (16384 wide: the widest intermediate of a block); the audio stream's tokens for the
    FLOP count (``audio_linears``); image-to-video's per-token modulation (``token_modulation``). No ``step_constants``:
    the modulation window is off for LTX-2 (with image-to-video its modulation is per token, not a vector of the step,
    so a window of per-sample vectors would not hold it)."""

    def audio_tokens(self, latent_frames: int) -> int:
        """What training feeds the audio stream beside a clip of ``latent_frames``: ``audio_tokens`` (the pipeline's
        count at the template's frame rate)."""
        return audio_tokens(latent_frames)

    def token_modulation(self, config: dict) -> TokenModulation:
        """Image-to-video's per-token video timestep (diffusers 0.42.1 ``transformer_ltx2.py``): ``time_embed`` runs on
        every token, so ``temb`` (B, N, m D), m = 9 with ``cross_attn_mod`` (2.3, 2.5) else 6, is handed to every block
        and held to the end of the backward (its ``embedded_timestep``, 1 row, lives through the forward only: gone at
        the backward's peak). Each block adds ``scale_shift_table + temb`` (m rows, ``get_mod_params``; its gates stay
        saved as views of it) and the ``1 + scale`` factors its backward keeps (``scale_msa``, ``scale_mlp``,
        ``scale_text_q`` with ``cross_attn_mod``: 3 rows, else 2). The audio stream, the prompt AdaLN and the
        audio<->video modulation read per-sample timesteps (``sigma``, ``use_cross_timestep``): unchanged.
        Measured against a forward + backward on the tiny model (test_i2v.py)."""
        m = 9 if config.get("cross_attn_mod") else 6
        return TokenModulation(held_rows=m, block_rows=m + (3 if config.get("cross_attn_mod") else 2), input_rows=m)

    def install_chunked_recompute(self, model: nn.Module, chunks: int, undo) -> None:
        from ..recompute import chunk_token_wise

        for block in model.transformer_blocks:
            chunk_token_wise(block.ff, chunks, undo)


class Ltx2Family(ModelFamily):
    id = "ltx2"
    display_name = "LTX-2"
    diffusers_class_name = "LTX2VideoTransformer3DModel"
    variants = {
        # Tests and the demo (video width 32, audio 8, 2 blocks; 2.3's layout). First: its shapes are its own, and a
        # file is matched against the variants in order (each a meta model of the config; the full-size ones are slow).
        "ltx2-tiny": "ltx2-tiny.json",
        "ltx2.3": "ltx2.3.json",
        "ltx2.5": "ltx2.5.json",  # no FFN biases, a keyframe embedding: told apart by the file's shapes
        # Image-to-video on the same checkpoints (i2v.py): after the others, so a file always matches its T2V
        # variant; chosen by the user (VideoConfig.image_to_video), never by shape.
        "ltx2-tiny-i2v": "ltx2-tiny.json",
        "ltx2.3-i2v": "ltx2.3.json",
        "ltx2.5-i2v": "ltx2.5.json",
    }
    tiny_variant = "ltx2-tiny"
    structural_keys = ("num_layers", "num_attention_heads", "attention_head_dim", "cross_attention_dim",
                       "audio_num_attention_heads", "audio_attention_head_dim", "in_channels", "ff_bias",
                       "use_keyframes_abs_pos_embedding", "gated_attn", "cross_attn_mod")
    # ComfyUI's all-in-one checkpoint also holds the text connectors (under the transformer's prefix), the text
    # projection, both VAEs and the vocoder: the transformer reads none of them (prefixes, ``unused_native_keys``).
    unused_native_keys = ("video_embeddings_connector.", "audio_embeddings_connector.", "text_embedding_projection.",
                          "vae.", "audio_vae.", "vocoder.")

    schedule = Ltx2Schedule(Prediction(timestep="sigma_x1000", sign=+1))
    video = True
    memory = Ltx2Memory(
        block_lists=("transformer_blocks",),
        int8_extra_linears=OUTER_LINEARS,
        block_list_tokens={"transformer_blocks": "image"},
        # The text cross-attention's keys and values run on the 1024 text rows.
        text_linears=("attn2.to_k", "attn2.to_v", "audio_attn2.to_k", "audio_attn2.to_v"),
        # The audio stream's Linears (after the text ones: the audio text keys / values are text rows): its own
        # attentions and FFN, and of the cross-modal attentions the side that reads or writes the audio (the gate
        # logits follow the query); audio_tokens says how many rows.
        audio_linears=("audio_attn1.", "audio_attn2.", "audio_ff.", "audio_to_video_attn.to_k",
                       "audio_to_video_attn.to_v", "video_to_audio_attn.to_q", "video_to_audio_attn.to_out",
                       "video_to_audio_attn.to_gate_logits"),
        width_keys=("num_attention_heads", "attention_head_dim"),
        token_pixels=32,
        temporal_compression=8,
        chunked_recompute=True,
        # A block's recompute + backward working set against Flux.1's at the same tokens x width. Fitted on
        # 2026-11-28 (H100, LTX-2.3 int8, 960x544x89, all 48 blocks streamed + activation offload, compiled):
        # step 1 (before the AdamW moments) peaked at 5.62 GB where 1.0 predicted 4.77 GB without the moments
        # (activations 2.13 GB; 2.98 GB measured: 1.40x), and step 2 ran out of a 6 GB budget. Image-to-video
        # measured the same +0.85 GB over its 3.18 GB (of which 1.05 GB per-token modulation, counted apart).
        activation_scale=1.40,
    )
    lora = LoraForm(
        targets={"transformer_blocks": VIDEO_TARGETS},
        architecture="ltx2/lora",
        # ComfyUI maps LTXV/LTXAV LoRAs by the bare native key and ``diffusion_model.<key>`` (comfy/lora.py); the
        # block Linears have the same names natively and in diffusers, so the native form is the diffusers name.
        comfyui_form="native_fused",
    )
    file_help = {
        "checkpoint": "ltx-2.3-22b-dev.safetensors or ltx-2.3-22b-dev-fp8.safetensors (models/checkpoints: the "
                      "transformer is trained; Cache Text Embeds reads the text connectors and the video VAE bundled "
                      "in it), ltx-2.5-22b-dev-transformer-bf16.safetensors (models/diffusion_models)",
        "pipeline": "text_encoder (Gemma 3 12B for 2.3, LTX's Gemma 4 12B for 2.5), tokenizer, connectors "
                    "(LTX2TextConnectors), vae (AutoencoderKLLTX2Video)",
        "single_files": "LTX-2.3: gemma_3_12B_it.safetensors or gemma_3_12B_it_fp8_scaled.safetensors (its embedded "
                        "tokenizer is used), vae_file '(none)': the text connectors and the VAE come from the model's "
                        "all-in-one checkpoint (ltx-2.3-22b-dev*.safetensors, also when a slab was built from it); "
                        "LTX-2.5's single files are not read yet (use its diffusers folder)",
    }

    # --- identity --------------------------------------------------------------------------------

    def looks_like_single_file(self, keys: set[str]) -> bool:
        """ComfyUI's test (``adaln_single.emb.timestep_embedder.linear_1.bias``) and its audio-video flag
        (``audio_adaln_single.linear.weight``: LTXAV; video-only LTXV files are not this family)."""
        return "adaln_single.emb.timestep_embedder.linear_1.bias" in keys and "audio_adaln_single.linear.weight" in keys

    def param_table(self, config: dict[str, Any]) -> list[NativeParam]:
        return ltx2_param_table(self, config)

    # --- text ------------------------------------------------------------------------------------

    def text_encoder_specs(self, variant: str) -> tuple[TextEncoderSpec, ...]:
        return (text_spec(I2V_OF.get(variant, variant)),)

    def text_widths(self, config: dict[str, Any]) -> dict[str, int]:
        """The cached row: the video connector's output then the audio connector's, per token."""
        return {PROMPT_KEY: int(config["cross_attention_dim"]) + int(config["audio_cross_attention_dim"])}

    # --- latents ---------------------------------------------------------------------------------

    def vae_for(self, variant: str | None) -> VaeSpec:
        """LTX-2.3's VAE (and its single-file config); the tiny model's config; LTX-2.5's (no single file yet)."""
        return {"ltx2-tiny": LTX2_TINY_VAE, "ltx2.5": LTX25_VAE}.get(I2V_OF.get(variant, variant), LTX2_VAE)

    def latent_shape(self, model: nn.Module, width: int, height: int, frames: int = 1) -> tuple[int, ...]:
        """(C, (F - 1) / 8 + 1, H / 32, W / 32): the causal video VAE; an image is one frame. Frames are 8k + 1."""
        if frames < 1 or (frames - 1) % 8:
            from ...errors import ConfigError

            raise ConfigError(f"{self.display_name} takes clips of 8k+1 frames (1, 9, 17, ..., 89, 121): its video "
                              f"VAE keeps the first frame alone and packs every next 8; {frames} frames is not one; "
                              f"set video_frames / sample_frames to such a count")
        return (int(model.config.in_channels), (frames - 1) // 8 + 1, height // 32, width // 32)

    # --- the forward -----------------------------------------------------------------------------

    def model_inputs(self, model: nn.Module, latents: torch.Tensor, embeds: dict[str, torch.Tensor],
                     sigmas: torch.Tensor, guidance: float) -> dict[str, Any]:
        """Keyword arguments of ``LTX2VideoTransformer3DModel.forward`` for latents (B, C, F', h, w): packed; the
        cached connector outputs split into the video and audio text states; timestep and prompt sigma 1000 sigma
        (fp32); the audio stream pure noise at sigma 1 (module doc). ``guidance`` is unused."""
        if latents.dim() != 5:
            raise ValueError(f"LTX-2 takes latents (B, C, frames, h, w); got shape {tuple(latents.shape)}")
        b, c, f, h, w = latents.shape
        prompt = embeds[PROMPT_KEY]
        video_width, audio_width = int(model.config.cross_attention_dim), int(model.config.audio_cross_attention_dim)
        if prompt.shape[0] != b:
            raise ValueError(f"LTX-2 batch mismatch: {b} latents, {prompt.shape[0]} captions")
        if prompt.shape[-1] != video_width + audio_width:
            raise ValueError(f"LTX-2 text embeddings are {prompt.shape[-1]} wide; this model takes the connectors' "
                             f"video ({video_width}) and audio ({audio_width}) states: rebuild the dataset cache for "
                             f"this model (2.3 and 2.5 caches are not interchangeable)")
        prompt = prompt.to(latents.dtype)
        t = self.schedule.prediction.model_timestep(sigmas.to(latents.device, torch.float32))
        hidden, video_t = latents.flatten(2).transpose(1, 2), t
        if HELD_KEY in embeds:  # image-to-video: frame 0 clean at timestep 0 (i2v.py)
            hidden, video_t = conditioned_inputs(hidden, t, embeds[HELD_KEY], h * w, embeds.get(HELD_ON_KEY))
        audio_len = audio_tokens(f)
        if AUDIO_KEY in embeds:  # previews: the audio latents the sampler steps, at the video's noise level
            audio, audio_t = embeds[AUDIO_KEY].to(latents.device, latents.dtype), t
        else:  # training: pure noise at sigma 1 (the module doc)
            audio = audio_noise(sigmas, audio_len, int(model.config.audio_in_channels), latents.device, latents.dtype)
            audio_t = torch.full_like(t, AUDIO_SIGMA * 1000.0)
        return {
            "hidden_states": hidden,
            "audio_hidden_states": audio,
            "encoder_hidden_states": prompt[..., :video_width],
            "audio_encoder_hidden_states": prompt[..., video_width:],
            "timestep": video_t, "sigma": t,
            "audio_timestep": audio_t, "audio_sigma": audio_t,
            "num_frames": f, "height": h, "width": w, "fps": FRAME_RATE, "audio_num_frames": audio_len,
            "use_cross_timestep": True,
            "return_dict": False,
        }

    def unpack_prediction(self, output: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The video velocity (B, F' h w, C) back to (B, C, F', h, w); the audio velocity is not trained."""
        b, c, f, h, w = latents.shape
        return output.transpose(1, 2).reshape(b, c, f, h, w)

    def first_frame(self, variant: str) -> FirstFrameCondition | None:
        """The I2V variants: each clip's first frame held clean at timestep 0, out of the loss (``i2v.py``)."""
        return LTX2_I2V if variant in I2V_OF else None

    def guidance(self, variant: str) -> Guidance:
        """LTX2Pipeline's CFG ``cond + (g - 1)(cond - uncond)`` (= uncond + g (cond - uncond)) against the empty
        prompt, video g = 3 and audio g = 7, 30 steps (the pipeline's defaults and the official trainer's
        validation). The audio stream is denoised beside the video from its own noise, as the pipeline does
        (``JointStream``), so the preview's video is the pipeline's; it is never decoded. The pipeline's further
        guidance terms (STG at block 28, modality isolation, rescale 0.7) are not run: previews equal
        ``LTX2Pipeline(stg_scale=0, modality_scale=1, guidance_rescale=0)``."""
        stream = JointStream(key=AUDIO_KEY, output=1, shape=audio_shape, scale=AUDIO_CFG)
        return Guidance(mode="cfg", scale=VIDEO_CFG, steps=30, formula="standard", joint=stream)


#: Each image-to-video variant's text-to-video twin (the same checkpoint and text encoder).
I2V_OF = {"ltx2-tiny-i2v": "ltx2-tiny", "ltx2.3-i2v": "ltx2.3", "ltx2.5-i2v": "ltx2.5"}


def audio_shape(model: nn.Module, latent_shape) -> tuple[int, int]:
    """One sample's packed audio latents (L_a, 128) beside video latents of ``latent_shape`` (C, F', h, w)."""
    return (audio_tokens(latent_shape[1]), int(model.config.audio_in_channels))


def audio_noise(sigmas: torch.Tensor, length: int, channels: int, device, dtype) -> torch.Tensor:
    """(B, length, channels) standard normal audio latents, each sample's drawn on the CPU from a generator seeded
    by its sigma's bits: reproducible, fresh at every training step (a new sigma)."""
    rows = []
    for s in sigmas.detach().float().cpu().tolist():
        seed = int(np.float32(s).view(np.uint32)) ^ 0x5A17
        rows.append(torch.randn(length, channels, generator=torch.Generator().manual_seed(seed)))
    return torch.stack(rows).to(device, dtype)
