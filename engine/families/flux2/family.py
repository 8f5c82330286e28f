"""Flux.2 (dev 32B, klein 4B/9B) on diffusers' ``Flux2Transformer2DModel`` (diffusers >= 0.37).

Facts used here (sources: diffusers 0.42.1 ``pipelines/flux2/pipeline_flux2.py`` and
``pipeline_flux2_klein.py``, ``examples/dreambooth/train_dreambooth_lora_flux2.py``,
BFL ``src/flux2/sampling.py``; ../shared/reference/flux2-and-editor-facts.md §A):

- dev: 8 double + 48 single blocks at width 6144, guidance-distilled (a guidance
  embedding); text = Mistral-Small-3.x 24B hidden states of layers 10/20/30, stacked
  per token into (512, 15360).
- klein 4B / 9B: 5+20 / 8+24 blocks at 3072 / 4096, no guidance embedding; text =
  Qwen3-4B / Qwen3-8B hidden states of layers 9/18/27. The undistilled "base"
  variants have the same transformer config and are told apart by the file or folder name
  (``flux-2-klein-base-4b.safetensors``, ``FLUX.2-klein-base-9B``): they train the same way, but sample with
  classifier-free guidance (``Flux2KleinPipeline(is_distilled=False)``: the empty prompt, scale 4, 50 steps),
  where the distilled klein samples without.
- Latents: a 32-channel VAE, 2x2 patchified to 128 channels and normalised with the
  VAE's BatchNorm running statistics (``Flux2Pipeline._encode_vae_image``); the cache
  holds exactly these (C, H/16, W/16) tensors, which are also ComfyUI's Flux.2 LATENTs.
  Tokens are their pixels in row-major order (``_pack_latents``).
- Position ids have 4 axes (T, H, W, L): image (0, h, w, 0), text (0, 0, 0, l)
  (``_prepare_latent_ids`` / ``_prepare_text_ids``).
- Editing: every variant also takes reference images (the same checkpoint generates and edits), appended after the
  target's tokens at T = 10, 20, ... (``references.py``); a dataset with control images trains on them.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from ..base import ModelFamily, image_only
from ..specs.controls import check_control_batch, control_latents
from ..specs import (ControlImages, Guidance, LoraForm, MemoryProfile, NoiseSchedule, PromptTemplate, StepConstants,
                     TextEncoderSpec, VaeSpec)
from .names import flux2_param_table

# LoRA targets: every attention projection of the double blocks, image and text streams
# (diffusers' own script leaves the text stream untrained), and the single blocks' fused
# projections. Never the final layer (proj_out) or the global modulation.
DOUBLE_BLOCK_TARGETS = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
)
SINGLE_BLOCK_TARGETS = ("attn.to_qkv_mlp_proj", "attn.to_out")

#: diffusers ``pipelines/flux2/system_messages.SYSTEM_MESSAGE`` (0.42.1; tests/test_families.py checks it).
SYSTEM_MESSAGE = ("You are an AI that reasons about image descriptions. You give structured responses focusing on "
                  "object relationships, object\nattribution and actions without speculation.")
#: Flux2Pipeline.format_input: "[IMG]" removed, a system turn + a user turn, content as text parts.
MISTRAL3_TEMPLATE = PromptTemplate("chat", system=SYSTEM_MESSAGE, structured=True, generation_prompt=False,
                                   drop="[IMG]")
#: Flux2KleinPipeline._get_qwen3_prompt_embeds: one user turn, the assistant prompt, an empty thinking block: the text
#: Qwen3's chat template renders with enable_thinking=False, written out (ComfyUI's KleinTokenizer.llama_template,
#: comfy/text_encoders/flux.py, is the same text). Written out, not a chat template, so that inside ComfyUI its bundled
#: qwen25_tokenizer (Qwen3's vocabulary and special tokens, but Qwen2.5's chat template) tokenizes it as Qwen3's own does.
QWEN3_TEMPLATE = PromptTemplate("plain", prefix="<|im_start|>user\n",
                                suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def _mistral(max_length: int = 512, layers: tuple[int, ...] = (10, 20, 30)) -> TextEncoderSpec:
    return TextEncoderSpec("text_encoder", "tokenizer", "decoder_lm", max_length, "prompt_embeds",
                           hidden_layers=layers, template=MISTRAL3_TEMPLATE, architecture="mistral3-small-24b")


def _qwen3(architecture: str, max_length: int = 512, layers: tuple[int, ...] = (9, 18, 27)) -> TextEncoderSpec:
    """klein's Qwen3. A single file without tokenizer files beside it (ComfyUI's qwen_3_4b.safetensors,
    qwen_3_8b_fp8mixed.safetensors) uses ComfyUI's bundled Qwen tokenizer inside ComfyUI, as ComfyUI's own klein
    nodes do (KleinTokenizer); the tiny stand-in (no architecture) brings its own."""
    return TextEncoderSpec("text_encoder", "tokenizer", "decoder_lm", max_length, "prompt_embeds",
                           hidden_layers=layers, template=QWEN3_TEMPLATE, architecture=architecture,
                           comfyui_tokenizer="qwen25_tokenizer" if architecture else "")


class Flux2VaeSpec(VaeSpec):
    """AutoencoderKLFlux2: 32 channels, 2x2 patchified to 128 and normalised with the VAE's BatchNorm
    running statistics (``Flux2Pipeline._encode_vae_image``)."""

    def to_model(self, vae, mean: torch.Tensor) -> torch.Tensor:
        """VAE latent mean (B, 32, H/8, W/8) -> the transformer's normalised (B, 128, H/16, W/16)."""
        x = patchify(mean)
        bn_mean = vae.bn.running_mean.view(1, -1, 1, 1).to(x.device, x.dtype)
        bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(x.device, x.dtype)
        return (x - bn_mean) / bn_std

    def to_vae(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """The inverse of ``to_model`` (Flux2Pipeline: un-normalise, unpatchify) for ``vae.decode``."""
        bn_mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device,
                                                                                                 latents.dtype)
        return unpatchify(latents * bn_std + bn_mean)

    def load_file(self, path, dtype: torch.dtype, read, companion):
        """Flux.2's VAE from its single file: the same LDM names as Flux.1's ae.safetensors (what ComfyUI's
        comfy/sd.py reads) plus the latent BatchNorm (``bn.*``), 32 latent channels, and in some releases a
        smaller decoder (``full_encoder_small_decoder``). diffusers 0.42 has no single-file loader for
        ``AutoencoderKLFlux2``: its LDM key conversion (``convert_ldm_vae_checkpoint``) is reused and the
        config is read off the tensor shapes."""
        from diffusers import AutoencoderKLFlux2
        from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

        from ...errors import ModelLoadError

        sd = read(path)
        sd = {("quant_conv." + k[len("encoder.quant_conv."):] if k.startswith("encoder.quant_conv.") else
               "post_quant_conv." + k[len("decoder.post_quant_conv."):] if k.startswith("decoder.post_quant_conv.") else k): v
              for k, v in sd.items()}
        if "bn.running_mean" not in sd or "encoder.conv_in.weight" not in sd:
            raise ModelLoadError(f"'{path}' is not a Flux.2 VAE file (expected encoder.conv_in and bn.running_mean)")
        enc_levels = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("encoder.down."))
        dec_levels = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("decoder.up."))
        ch = sd["encoder.conv_in.weight"].shape[0]
        mult = [sd[f"encoder.down.{i}.block.0.conv1.weight"].shape[0] // ch for i in range(enc_levels)]
        dec_ch = sd["decoder.conv_in.weight"].shape[0] // mult[-1]
        config = {
            "in_channels": 3, "out_channels": 3, "latent_channels": sd["decoder.conv_in.weight"].shape[1],
            "block_out_channels": [ch * m for m in mult],
            "decoder_block_out_channels": [dec_ch * m for m in mult[:dec_levels]],
            "down_block_types": ["DownEncoderBlock2D"] * enc_levels, "up_block_types": ["UpDecoderBlock2D"] * dec_levels,
            "layers_per_block": 1 + max(int(k.split(".")[4]) for k in sd if k.startswith("encoder.down.0.block.")),
            "norm_num_groups": 32 if sd["encoder.norm_out.weight"].shape[0] % 32 == 0 else 4,
            "use_quant_conv": "quant_conv.weight" in sd, "use_post_quant_conv": "post_quant_conv.weight" in sd,
        }
        if (companion / "config.json").exists():  # an exact config beside the file wins over the inferred one
            import json

            config.update({k: v for k, v in json.loads((companion / "config.json").read_text()).items() if not k.startswith("_")})
        with torch.device("meta"):
            vae = AutoencoderKLFlux2(**config)
        state = convert_ldm_vae_checkpoint(sd, vae.config)
        state.update({k: v for k, v in sd.items() if k.startswith(("bn.", "quant_conv.", "post_quant_conv."))})
        missing, unexpected = vae.load_state_dict(state, strict=False, assign=True)
        missing = [k for k in missing if not k.endswith("num_batches_tracked")]
        if missing or unexpected:
            raise ModelLoadError(f"'{path}' does not fit the Flux.2 VAE (missing {missing[:3]}, unexpected {unexpected[:3]})")
        if vae.bn.num_batches_tracked.is_meta:
            vae.bn.num_batches_tracked = torch.zeros((), dtype=torch.long)
        return vae.to(dtype)


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) VAE latents -> (B, 4C, H/2, W/2), as ``Flux2Pipeline._patchify_latents``."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * 4, h // 2, w // 2)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    b, c4, h, w = latents.shape
    x = latents.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c4 // 4, h * 2, w * 2)


class Flux2Memory(MemoryProfile):
    """Flux.2's block surgery: double blocks in two parts, token-wise parts in chunks."""

    def install_chunked_recompute(self, model: nn.Module, chunks: int, undo) -> None:
        """The double blocks' feed-forwards, and the single blocks' MLP half (the fused projection, SwiGLU and the
        output projection, with attention over all tokens between them: ``parts.single_block_forward_chunked``),
        in checkpointed token chunks."""
        import types

        from ..recompute import chunk_token_wise
        from .parts import single_block_forward_chunked

        for block in model.transformer_blocks:
            chunk_token_wise(block.ff, chunks, undo)
            chunk_token_wise(block.ff_context, chunks, undo)
        forward = single_block_forward_chunked(chunks)
        for block in model.single_transformer_blocks:
            undo.set_forward(block, types.MethodType(forward, block))

    def block_parts(self, block: nn.Module):
        """A double block streams as two parts: attention (0.60 GB bf16 at Flux.2-dev's size) and the
        feed-forwards (1.36 GB). Single blocks (0.98 GB) stream whole."""
        from diffusers.models.transformers.transformer_flux2 import Flux2TransformerBlock

        from .parts import DoubleAttention, DoubleFeedForward

        if not isinstance(block, Flux2TransformerBlock):
            return None
        return [("attention", DoubleAttention(block)), ("feed_forward", DoubleFeedForward(block))]


class Flux2Schedule(NoiseSchedule):
    """BFL's empirical shift (``compute_empirical_mu``) over the image tokens and the step count."""

    def train_shift_mu(self, latents: torch.Tensor) -> float:
        """The shift Flux.2 samples with (BFL ``sampling.py`` ``compute_empirical_mu``, also in
        diffusers' pipeline and ComfyUI's Flux2Scheduler) at its 50-step default: training
        concentrates on the noise levels inference visits (mu 2.02 at 1024², ComfyUI's shift)."""
        return compute_empirical_mu(latents.shape[2] * latents.shape[3], 50)

    def sample_shift_mu(self, latents: torch.Tensor, steps: int) -> float:
        """Flux2Pipeline's shift for ``steps`` sampling steps (compute_empirical_mu)."""
        return compute_empirical_mu(latents.shape[2] * latents.shape[3], steps)


#: The Flux.2 VAE; its single file has its own loader (``Flux2VaeSpec.load_file``).
FLUX2_VAE = Flux2VaeSpec("AutoencoderKLFlux2", "")


#: klein's variants (distilled and base) and the transformer size each is: what picks the text encoder.
KLEIN_SIZE = {"flux2-klein-4b": "4b", "flux2-klein-9b": "9b", "flux2-klein-base-4b": "4b", "flux2-klein-base-9b": "9b"}


class Flux2Family(ModelFamily):
    id = "flux2"
    display_name = "Flux.2"
    variants = {
        "flux2-dev": "flux2-dev.json",
        "flux2-klein-4b": "flux2-klein-4b.json",
        "flux2-klein-9b": "flux2-klein-9b.json",
        # The undistilled klein: the same transformers (after the distilled, so a config alone matches those), named
        # by their files (variant_from_name); what the klein templates train.
        "flux2-klein-base-4b": "flux2-klein-4b.json",
        "flux2-klein-base-9b": "flux2-klein-9b.json",
        # Tiny random model for the tests (same architecture, small widths; text = a tiny Mistral3).
        "flux2-tiny": "flux2-tiny.json",
        # The klein templates' tiny stand-in: flux2-tiny without the guidance embedding, text = a tiny Qwen3; it samples
        # as the base klein the templates train (classifier-free guidance).
        "flux2-klein-tiny": "flux2-klein-tiny.json",
    }
    tiny_variant = "flux2-tiny"
    diffusers_class_name = "Flux2Transformer2DModel"
    structural_keys = ("num_layers", "num_single_layers", "attention_head_dim", "num_attention_heads",
                       "guidance_embeds")
    file_help = {
        "checkpoint": "flux2_dev_fp8mixed.safetensors or flux2-dev.safetensors, or a klein 4B/9B file (and its base "
                      "variants)",
        "pipeline": "dev: text_encoder (Mistral-Small 3.x 24B; only layers 0-29 are read), tokenizer, vae "
                    "(AutoencoderKLFlux2); klein: text_encoder (Qwen3 4B/8B), tokenizer, vae",
        "single_files": "mistral_3_small_flux2_bf16.safetensors (its embedded tokenizer is used) or klein's Qwen3 "
                        "file, qwen_3_4b.safetensors / qwen_3_8b_fp8mixed.safetensors (inside ComfyUI its bundled Qwen "
                        "tokenizer is used; elsewhere tokenizer files in a folder named like it), and "
                        "flux2-vae.safetensors",
    }
    memory = Flux2Memory(
        block_lists=("transformer_blocks", "single_transformer_blocks"),
        # Outside the blocks but large (Flux.2-dev: 566 M modulation + 94 M text-embedder parameters, 1.3 GB
        # in bf16): int8 in slabs like the block Linears. They run once per forward, outside checkpointing.
        int8_extra_linears=("double_stream_modulation_img.linear", "double_stream_modulation_txt.linear",
                            "single_stream_modulation.linear", "context_embedder"),
        # Which rows the block Linears multiply (MemoryProfile.linear_tokens: the step-time model's FLOPs); its
        # modulation is global, outside the blocks.
        text_linears=("attn.add_", "attn.to_add_out", "ff_context."),
        dual_stream_lists=("transformer_blocks",),
        # A block's recompute + backward working set against Flux.1's at the same tokens x width (the planner's
        # constants are Flux.1 fits): the single blocks' fused projection is 9x the width (Flux.1: 7x) and the
        # SwiGLU feed-forward 6x. Fitted on 2026-11-25 (H100, Flux.2-dev int8, stream + activation offload,
        # blocks in parts, compiled, 1024²): 6.24 GB measured against 5.54 GB predicted at 1.0.
        activation_scale=1.37,
        # With the single blocks' MLP half in chunks too (parts.single_block_forward_chunked). On the CPU (bench/flux2_working_set.py, bench/logs/2026-11-28_flux2_working_set_cpu.log: the most bytes
        # alive in one block's forward + backward, bf16, LoRA r16, head dim 128, 2048 + 128 tokens, B*T*D units) the
        # largest Flux.2 block working set is 42.3 units with the single blocks whole (they set it at every chunk
        # count) and 24.1 with them chunked (flat over 2-8 chunks: attention over all tokens sets it; a double block is
        # 24.1 whole at 2 chunks, 20.4 in parts): x 0.57. The GPU rows of chunked plans with whole single blocks imply
        # 1.52 for the old code (Flux.2-dev 1024², 2 chunks, eager: 5.58 GB measured, 5.31 predicted at 1.37,
        # 2026-11-25) and 1.26 (klein 9B + a 1024² reference, 3 chunks, compiled: 3.32 GB, 3.49 predicted,
        # 2026-11-27); x 0.57 gives 0.87 and 0.72. Fitted since on the GPU (H100, 2026-11-28, klein 9B + a 1024²
        # reference, int8, every block streamed + activation offload, 3 chunks, compiled at activation budget 0.5,
        # AdamW moments on the host): 2.90 GB measured against 2.35 GB predicted at 0.87; the same plan predicts
        # 2.90 GB at 1.22 (bench/logs/klein9b_edit_chunked_session6.log). The CPU count's 0.57 is not what the GPU
        # keeps (compiled blocks, the allocator's rounding): the GPU row decides.
        chunked_activation_scale=1.22,
        chunked_recompute=True,
        # Measured on 2xH100, 2026-11-28 (bench/logs/parallel_flux2_m4_session7_h100x2.log, mode one): Flux.2-dev int8
        # 1024², batch 4 one sample at a time, 54 of 56 blocks streamed, capped at 12.03 GB with 0.5 GB kept free
        # (11.17 GB predicted with the moments): step 2 asked for 486 MiB (a single block's fused projection output,
        # 4608 tokens x 55296 x 2 bytes, the plan's largest tensor) with 9.00 GiB allocated and 1.98 GiB reserved but
        # unusable. Allocated + holes + request = 12.30 GB: the margin must cover 1.13 GB beyond the predicted peak,
        # 2.2x the largest tensor (tests/test_plan_margin.py). 2.5, as Flux.1's (the same kind of hole: a wide tensor
        # asked right after narrower ones were freed). Not yet re-run at 2.5; chunked single blocks cut the tensor.
        fragmentation=2.5,
        # The time / guidance embedding and the global modulation it feeds (Flux2Modulation: linear(silu(temb))).
        step_constants=StepConstants(source="time_guidance_embed", modules={
            "double_stream_modulation_img.linear": "silu", "double_stream_modulation_txt.linear": "silu",
            "single_stream_modulation.linear": "silu", "norm_out.linear": "silu"}),
    )
    schedule = Flux2Schedule()
    lora = LoraForm(
        targets={"transformer_blocks": DOUBLE_BLOCK_TARGETS, "single_transformer_blocks": SINGLE_BLOCK_TARGETS},
        architecture="flux2/lora",
    )

    # --- identity ----------------------------------------------------------------------------

    def looks_like_single_file(self, keys: set[str]) -> bool:
        # What ComfyUI's model_detection keys on for Flux.2 (global modulation).
        return "double_stream_modulation_img.lin.weight" in keys

    def variant_from_name(self, variant: str, name: str, keys: frozenset[str] | set[str] = frozenset()) -> str:
        """klein 9B KV (``FLUX.2-klein-9b-kv``, a klein 9B transformer trained to see its references FIRST at a fixed
        timestep, Flux2KleinKVPipeline) is refused by name: its references would be trained here in the other
        order (after the target, at the target's timestep)."""
        words = name.lower().replace("_", "-").replace(".", "-").split("-")
        if "klein" in words and "kv" in words:
            raise ConfigError(f"'{name}' looks like FLUX.2 klein 9B KV, which takes its reference images first, at a "
                              f"fixed timestep, with a KV cache; lowvram-lora trains references after the target (the "
                              f"klein 9B / base 9B layout). Use flux-2-klein-9b or flux-2-klein-base-9b")
        size = KLEIN_SIZE.get(variant)
        if size is None:
            return variant  # dev, the tiny model, or a custom config
        return f"flux2-klein-base-{size}" if "base" in words else f"flux2-klein-{size}"

    def param_table(self, config: dict[str, Any]):
        hidden = config["num_attention_heads"] * config["attention_head_dim"]
        return flux2_param_table(
            num_double=config["num_layers"], num_single=config["num_single_layers"], hidden=hidden,
            mlp_hidden=int(hidden * config.get("mlp_ratio", 3.0)), head_dim=config["attention_head_dim"],
            guidance=bool(config.get("guidance_embeds", True)),
            out_channels=config.get("out_channels") or config.get("in_channels", 128),
        )

    # --- text ------------------------------------------------------------------------------

    def text_encoder_specs(self, variant: str) -> tuple[TextEncoderSpec, ...]:
        if KLEIN_SIZE.get(variant) == "4b":
            return (_qwen3("qwen3-4b"),)
        if KLEIN_SIZE.get(variant) == "9b":
            return (_qwen3("qwen3-8b"),)
        if variant == "flux2-tiny":
            return (_mistral(16, (1, 2, 3)),)
        if variant == "flux2-klein-tiny":  # the tiny Qwen3 has 4 layers; 32 tokens hold the template and a caption
            return (_qwen3("", 32, (1, 2, 3)),)
        return (_mistral(),)

    def text_widths(self, config: dict) -> dict[str, int]:
        """Width of each cached embedding the transformer takes: the stacked hidden states (dev 15360,
        klein 4B 7680, klein 9B 12288)."""
        return {"prompt_embeds": int(config["joint_attention_dim"])}

    # --- latents -----------------------------------------------------------------------------

    def vae_for(self, variant: str | None) -> VaeSpec:
        return FLUX2_VAE

    def latent_shape(self, model, width: int, height: int, frames: int = 1) -> tuple[int, int, int]:
        """(C, h, w) of the (patchified) latents of a width x height image."""
        image_only(self, frames)
        return (model.config.in_channels, height // 16, width // 16)

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

    def control_images(self, variant: str) -> ControlImages:
        """Every variant edits with 1..n reference images (``references.py``), optionally: a dataset is pairs only
        where it has control images. The references never enter the text encoder."""
        from .references import IDENT, encode_references, reference_size

        return ControlImages(max_count=None, ident=IDENT, size=reference_size,
                             encode_latents=lambda vae, images: encode_references(vae, images, FLUX2_VAE),
                             optional=True)

    # --- training ----------------------------------------------------------------------------

    def model_inputs(self, model: nn.Module, latents: torch.Tensor, embeds: dict[str, torch.Tensor],
                     sigmas: torch.Tensor, guidance: float) -> dict[str, Any]:
        """Keyword arguments for ``Flux2Transformer2DModel.forward`` on noisy latents (B, C, h, w). Reference latents
        in ``embeds`` (``control_latents_0``, ... each (B, C, h_k, w_k)) follow the target's tokens with their ids
        (``references.reference_ids``), as Flux2Pipeline appends ``image_latents``; ``unpack_prediction`` keeps the
        target's tokens, so the loss covers the target only."""
        from .references import reference_ids

        b, c, h, w = latents.shape
        dtype = latents.dtype
        prompt = embeds["prompt_embeds"].to(dtype)  # (B, L, joint_attention_dim)
        refs = [r.to(latents.device, dtype) for r in control_latents(embeds)]
        check_control_batch("Flux.2 reference", refs, latents)
        hidden = torch.cat([x.reshape(b, c, -1).permute(0, 2, 1) for x in [latents] + refs], dim=1)
        ids = self.image_ids(h, w, latents.device, dtype)
        if refs:
            ids = torch.cat([ids, reference_ids(refs, latents.device, dtype)], dim=0)
        inputs = {
            "hidden_states": hidden,
            "encoder_hidden_states": prompt,
            "timestep": self.schedule.prediction.model_timestep(sigmas).to(dtype),  # sigma; the model scales by 1000
            "img_ids": ids,
            "txt_ids": self.text_ids(prompt.shape[1], latents.device, dtype),
            "return_dict": False,
        }
        if model.config.guidance_embeds:
            inputs["guidance"] = torch.full((b,), guidance, device=latents.device, dtype=dtype)
        return inputs

    def unpack_prediction(self, output: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The target's tokens (the first h * w; an edit forward also answers for the references) as (B, C, h, w)."""
        b, c, h, w = latents.shape
        return output[:, : h * w].permute(0, 2, 1).reshape(b, c, h, w)

    def guidance(self, variant: str) -> Guidance:
        """dev is guidance-distilled (an embedding, 4 by default); the distilled klein samples without guidance;
        the base klein with classifier-free guidance as ``Flux2KleinPipeline(is_distilled=False)`` does: its defaults,
        scale 4 and 50 steps, ``neg + 4 (pos - neg)`` with the empty prompt (and an edit's references in both)."""
        if variant in ("flux2-dev", "flux2-tiny"):
            return Guidance("embedded", 4.0)
        if variant.startswith("flux2-klein-base-") or variant == "flux2-klein-tiny":
            return Guidance(mode="cfg", scale=4.0, steps=50, formula="standard")
        return Guidance("none")



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
