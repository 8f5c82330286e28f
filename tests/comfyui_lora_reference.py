"""Reference port of how ComfyUI maps and applies LoRA keys for a Flux.1 model.

Purpose: let our tests check that a LoRA file we write is mapped *completely*
by ComfyUI's loader, without ComfyUI installed (it is not on PyPI and the test
machines have no network). Only the parts that matter for a plain LoRA on a
Flux.1 model are ported; everything else raises OutsidePortError instead of
guessing.

Sources (GPL-3.0 ComfyUI; re-implemented here, not copied wholesale), read via a
stored index of public GitHub repositories:

* Comfy-Org/ComfyUI  comfy/lora.py                @ ec93dcacb96b922f7cb1417b3ba22bccb082df32
      load_lora(), model_lora_keys_unet() -- the "latest" variant below.
* comfyanonymous/ComfyUI comfy/lora.py            @ 41444b5236c613ee5ff7d09aa620f94b702f30eb
      the older revision (load_lora still inline, calculate_weight "lora"
      branch in lora.py) -- the "legacy" variant below.
* Comfy-Org/ComfyUI  comfy/weight_adapter/lora.py @ 6f98b150e065f1ffc788558574a887835068bd40
  (same LoRAAdapter.load/calculate_weight as comfyanonymous/ComfyUI @ 6fd406fb14ca663225b88c6f75d7a7f2b997e5a0)
      LoRAAdapter.load (accepted up/down name pairs) and calculate_weight
      (scale = alpha / down.shape[0], or 1.0 when there is no alpha).
* comfyanonymous/ComfyUI comfy/weight_adapter/__init__.py @ 0bca89ebbb08bbebdf79247bdb2a0f8d05f0d9ed
      adapter order: LoRA, LoHa, LoKr, GLoRA, OFT, BOFT.
* Comfy-Org/ComfyUI  comfy/utils.py               @ b3be02d6e766a8d3743dcf99cc967118f3ec8e3e
      flux_to_diffusers() (diffusers name -> BFL name, or (name, (dim, offset, size))
      slice, or (name, None, swap_scale_shift)).
* Comfy-Org/ComfyUI  comfy/model_patcher.py       @ e59d85a0f377f50b0fac62f406491d95476bece4
      ModelPatcher.add_patches (tuple targets: (key, offset[, function]); targets whose
      key is not in the model's state dict are dropped -> "NOT LOADED" in comfy/sd.py).
* Comfy-Org/ComfyUI  comfy/lora_convert.py        @ 2bffe2f4ce5763dcb83df6a670657b6d5c8f85a5
      convert_lora(), run by comfy/sd.py load_lora_for_models() before load_lora();
      it is a no-op for ordinary kohya/diffusers Flux LoRAs (see _convert_lora_trigger).

Version differences in model_lora_keys_unet() that matter for Flux (see variant=):

* legacy (comfyanonymous @ 41444b52, 2024): for every diffusion_model.X.weight it
  maps "lora_unet_X_", "lora_prior_unet_X_" and the bare "diffusion_model.X"; the
  Flux branch maps "transformer.<diffusers>", "lycoris_<diffusers_>" and
  "lora_transformer_<diffusers_>" only.  A diffusers name WITHOUT the
  "transformer." prefix (e.g. "transformer_blocks.0.attn.to_q") is NOT mapped:
  every such key is reported "lora key not loaded".
* latest (Comfy-Org @ ec93dcac): "lora_prior_unet_" only for StableCascade; the
  Flux branch additionally maps the bare diffusers name
  (``key_map[k[:-len(".weight")]] = to  #DiffSynth lora format``) and, for every
  single_blocks.N.linear1.weight, "diffusion_model.single_blocks.N.linear1_qkv" ->
  (linear1.weight, (0, 0, 3*hidden)) (USO LoRAs).  An intermediate revision seen in
  the index has linear1_qkv but not the bare DiffSynth names.
* flux_to_diffusers() grew aliases over time: "ff.linear_in/linear_out" (LyCORIS
  LoKr) and the Flux.2 single-block aliases "attn.to_qkv_mlp_proj" -> linear1,
  "attn.to_out" -> linear2.  In Comfy-Org @ b3be02d6 the q/k-norm targets end in
  ".weight" (e.g. img_attn.norm.query_norm.weight) while the BFL/ComfyUI Flux
  parameter is ".scale", so a LoRA on the norms is mapped but then dropped by
  add_patches ("NOT LOADED"); some derived copies use ".scale".

Facts worth knowing when reading the port:

* hidden_size in ComfyUI comes from unet_config (model_detection hard-codes 3072 and
  mlp_ratio 4.0 for Flux.1); flux_to_diffusers slices proj_mlp as
  (0, 3*hidden, 4*hidden), i.e. it assumes mlp_hidden == 4*hidden.
* ComfyUI only reports unmatched LoRA keys with logging.warning("lora key not
  loaded: ..."); it does not fail.  A target that is mapped but absent from the
  model is dropped with "NOT LOADED ..."; a LoRA whose up@down cannot be reshaped
  to the (sliced) weight is skipped with logging.error("ERROR lora ...").
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Callable

import torch


class OutsidePortError(ValueError):
    """The file uses a LoRA kind this reference does not model (LoHa, LoKr, DoRA, files
    ComfyUI rewrites first). Our writer never produces those; a test that meets one must
    fail loudly rather than let the reference guess."""

VARIANT_LATEST = "latest"
VARIANT_LEGACY = "legacy"
_VARIANTS = (VARIANT_LATEST, VARIANT_LEGACY)

PREFIX = "diffusion_model."


# ---------------------------------------------------------------------------
# Model keys
# ---------------------------------------------------------------------------

def flux_bfl_model_keys(
    num_double: int,
    num_single: int,
    hidden: int,
    mlp_hidden: int,
    *,
    in_channels: int = 64,
    out_channels: int | None = None,
    context_in_dim: int = 4096,
    vec_in_dim: int = 768,
    time_in_dim: int = 256,
    guidance_embed: bool = True,
) -> dict[str, tuple]:
    """State-dict keys (with ComfyUI's ``diffusion_model.`` prefix) and shapes of
    the Linear layers of a BFL-layout Flux.1 model, as ComfyUI's Flux holds them.

    ``in_channels``/``out_channels`` are the packed (patch 2x2) widths, 64 for
    Flux.1. The RMSNorm ``.scale`` parameters are not included.
    """
    h, m = hidden, mlp_hidden
    out_channels = in_channels if out_channels is None else out_channels
    keys: dict[str, tuple] = {}

    def linear(name: str, out_f: int, in_f: int) -> None:
        keys[f"{PREFIX}{name}.weight"] = (out_f, in_f)
        keys[f"{PREFIX}{name}.bias"] = (out_f,)

    linear("img_in", h, in_channels)
    linear("time_in.in_layer", h, time_in_dim)
    linear("time_in.out_layer", h, h)
    linear("vector_in.in_layer", h, vec_in_dim)
    linear("vector_in.out_layer", h, h)
    if guidance_embed:
        linear("guidance_in.in_layer", h, time_in_dim)
        linear("guidance_in.out_layer", h, h)
    linear("txt_in", h, context_in_dim)
    for i in range(num_double):
        b = f"double_blocks.{i}"
        for s in ("img", "txt"):
            linear(f"{b}.{s}_mod.lin", 6 * h, h)
            linear(f"{b}.{s}_attn.qkv", 3 * h, h)
            linear(f"{b}.{s}_attn.proj", h, h)
            linear(f"{b}.{s}_mlp.0", m, h)
            linear(f"{b}.{s}_mlp.2", h, m)
    for i in range(num_single):
        b = f"single_blocks.{i}"
        linear(f"{b}.linear1", 3 * h + m, h)
        linear(f"{b}.linear2", h, h + m)
        linear(f"{b}.modulation.lin", 3 * h, h)
    linear("final_layer.linear", out_channels, h)
    linear("final_layer.adaLN_modulation.1", 2 * h, h)
    return keys


# ---------------------------------------------------------------------------
# comfy/utils.py: flux_to_diffusers
# ---------------------------------------------------------------------------

def swap_scale_shift(weight: torch.Tensor) -> torch.Tensor:
    """comfy.utils.swap_scale_shift: swap the two halves along dim 0."""
    shift, scale = weight.chunk(2, dim=0)
    return torch.cat([scale, shift], dim=0)


def flux_to_diffusers(depth: int, depth_single_blocks: int, hidden_size: int,
                      output_prefix: str = "") -> dict[str, Any]:
    """Port of comfy.utils.flux_to_diffusers (Comfy-Org @ b3be02d6).

    Values are a BFL key (str), ``(key, (dim, offset, size))`` for a slice of a
    fused weight, or ``(key, None, swap_scale_shift)``.
    """
    key_map: dict[str, Any] = {}
    for index in range(depth):
        prefix_from = f"transformer_blocks.{index}"
        prefix_to = f"{output_prefix}double_blocks.{index}"
        for end in ("weight", "bias"):
            k = f"{prefix_from}.attn."
            qkv = f"{prefix_to}.img_attn.qkv.{end}"
            key_map[f"{k}to_q.{end}"] = (qkv, (0, 0, hidden_size))
            key_map[f"{k}to_k.{end}"] = (qkv, (0, hidden_size, hidden_size))
            key_map[f"{k}to_v.{end}"] = (qkv, (0, hidden_size * 2, hidden_size))
            qkv = f"{prefix_to}.txt_attn.qkv.{end}"
            key_map[f"{k}add_q_proj.{end}"] = (qkv, (0, 0, hidden_size))
            key_map[f"{k}add_k_proj.{end}"] = (qkv, (0, hidden_size, hidden_size))
            key_map[f"{k}add_v_proj.{end}"] = (qkv, (0, hidden_size * 2, hidden_size))
        block_map = {
            "attn.to_out.0.weight": "img_attn.proj.weight",
            "attn.to_out.0.bias": "img_attn.proj.bias",
            "norm1.linear.weight": "img_mod.lin.weight",
            "norm1.linear.bias": "img_mod.lin.bias",
            "norm1_context.linear.weight": "txt_mod.lin.weight",
            "norm1_context.linear.bias": "txt_mod.lin.bias",
            "attn.to_add_out.weight": "txt_attn.proj.weight",
            "attn.to_add_out.bias": "txt_attn.proj.bias",
            "ff.net.0.proj.weight": "img_mlp.0.weight",
            "ff.net.0.proj.bias": "img_mlp.0.bias",
            "ff.net.2.weight": "img_mlp.2.weight",
            "ff.net.2.bias": "img_mlp.2.bias",
            "ff_context.net.0.proj.weight": "txt_mlp.0.weight",
            "ff_context.net.0.proj.bias": "txt_mlp.0.bias",
            "ff_context.net.2.weight": "txt_mlp.2.weight",
            "ff_context.net.2.bias": "txt_mlp.2.bias",
            "ff.linear_in.weight": "img_mlp.0.weight",  # LyCoris LoKr
            "ff.linear_in.bias": "img_mlp.0.bias",
            "ff.linear_out.weight": "img_mlp.2.weight",
            "ff.linear_out.bias": "img_mlp.2.bias",
            "ff_context.linear_in.weight": "txt_mlp.0.weight",
            "ff_context.linear_in.bias": "txt_mlp.0.bias",
            "ff_context.linear_out.weight": "txt_mlp.2.weight",
            "ff_context.linear_out.bias": "txt_mlp.2.bias",
            # ".weight" as in Comfy-Org @ b3be02d6 (the model parameter is ".scale").
            "attn.norm_q.weight": "img_attn.norm.query_norm.weight",
            "attn.norm_k.weight": "img_attn.norm.key_norm.weight",
            "attn.norm_added_q.weight": "txt_attn.norm.query_norm.weight",
            "attn.norm_added_k.weight": "txt_attn.norm.key_norm.weight",
        }
        for k, v in block_map.items():
            key_map[f"{prefix_from}.{k}"] = f"{prefix_to}.{v}"

    for index in range(depth_single_blocks):
        prefix_from = f"single_transformer_blocks.{index}"
        prefix_to = f"{output_prefix}single_blocks.{index}"
        for end in ("weight", "bias"):
            k = f"{prefix_from}.attn."
            qkv = f"{prefix_to}.linear1.{end}"
            key_map[f"{k}to_q.{end}"] = (qkv, (0, 0, hidden_size))
            key_map[f"{k}to_k.{end}"] = (qkv, (0, hidden_size, hidden_size))
            key_map[f"{k}to_v.{end}"] = (qkv, (0, hidden_size * 2, hidden_size))
            # mlp width hard-coded as 4 * hidden (Flux.1 mlp_ratio).
            key_map[f"{prefix_from}.proj_mlp.{end}"] = (qkv, (0, hidden_size * 3, hidden_size * 4))
        block_map = {
            "norm.linear.weight": "modulation.lin.weight",
            "norm.linear.bias": "modulation.lin.bias",
            "proj_out.weight": "linear2.weight",
            "proj_out.bias": "linear2.bias",
            "attn.norm_q.weight": "norm.query_norm.weight",
            "attn.norm_k.weight": "norm.key_norm.weight",
            "attn.to_qkv_mlp_proj.weight": "linear1.weight",  # Flux 2
            "attn.to_out.weight": "linear2.weight",  # Flux 2
        }
        for k, v in block_map.items():
            key_map[f"{prefix_from}.{k}"] = f"{prefix_to}.{v}"

    map_basic = [
        ("final_layer.linear.bias", "proj_out.bias"),
        ("final_layer.linear.weight", "proj_out.weight"),
        ("img_in.bias", "x_embedder.bias"),
        ("img_in.weight", "x_embedder.weight"),
        ("time_in.in_layer.bias", "time_text_embed.timestep_embedder.linear_1.bias"),
        ("time_in.in_layer.weight", "time_text_embed.timestep_embedder.linear_1.weight"),
        ("time_in.out_layer.bias", "time_text_embed.timestep_embedder.linear_2.bias"),
        ("time_in.out_layer.weight", "time_text_embed.timestep_embedder.linear_2.weight"),
        ("txt_in.bias", "context_embedder.bias"),
        ("txt_in.weight", "context_embedder.weight"),
        ("vector_in.in_layer.bias", "time_text_embed.text_embedder.linear_1.bias"),
        ("vector_in.in_layer.weight", "time_text_embed.text_embedder.linear_1.weight"),
        ("vector_in.out_layer.bias", "time_text_embed.text_embedder.linear_2.bias"),
        ("vector_in.out_layer.weight", "time_text_embed.text_embedder.linear_2.weight"),
        ("guidance_in.in_layer.bias", "time_text_embed.guidance_embedder.linear_1.bias"),
        ("guidance_in.in_layer.weight", "time_text_embed.guidance_embedder.linear_1.weight"),
        ("guidance_in.out_layer.bias", "time_text_embed.guidance_embedder.linear_2.bias"),
        ("guidance_in.out_layer.weight", "time_text_embed.guidance_embedder.linear_2.weight"),
        ("final_layer.adaLN_modulation.1.bias", "norm_out.linear.bias", swap_scale_shift),
        ("final_layer.adaLN_modulation.1.weight", "norm_out.linear.weight", swap_scale_shift),
        ("pos_embed_input.bias", "controlnet_x_embedder.bias"),
        ("pos_embed_input.weight", "controlnet_x_embedder.weight"),
    ]
    for k in map_basic:
        if len(k) > 2:
            key_map[k[1]] = (f"{output_prefix}{k[0]}", None, k[2])
        else:
            key_map[k[1]] = f"{output_prefix}{k[0]}"
    return key_map


# ---------------------------------------------------------------------------
# comfy/lora.py: model_lora_keys_unet (Flux model)
# ---------------------------------------------------------------------------

def _count_blocks(keys: Iterable[str], prefix: str) -> int:
    """comfy.model_detection.count_blocks."""
    keys = list(keys)
    count = 0
    while any(k.startswith(prefix.format(count)) for k in keys):
        count += 1
    return count


def _shape_of(v: Any) -> tuple:
    if isinstance(v, torch.Tensor):
        return tuple(v.shape)
    return tuple(v)


def comfyui_flux_key_map(
    model_keys: Mapping[str, Any] | Iterable[str],
    *,
    hidden_size: int | None = None,
    variant: str = VARIANT_LATEST,
) -> dict[str, Any]:
    """Port of ``model_lora_keys_unet`` for a ``comfy.model_base.Flux`` model.

    ``model_keys``: the model's state-dict keys with the ``diffusion_model.``
    prefix, as a mapping to shapes/tensors (see :func:`flux_bfl_model_keys`) or
    a plain iterable. ``hidden_size`` (ComfyUI: unet_config["hidden_size"]) is
    read from ``diffusion_model.img_in.weight`` when not given.

    Returns {lora_prefix: target}; target is a model key, ``(key, (dim, offset,
    size))`` or ``(key, None, function)`` exactly as ComfyUI builds it.
    """
    if variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {_VARIANTS}, not {variant!r}")
    sdk = list(model_keys.keys() if isinstance(model_keys, Mapping) else model_keys)
    if not any(k.startswith(PREFIX) for k in sdk):
        raise ValueError("model keys must carry ComfyUI's 'diffusion_model.' prefix")
    if hidden_size is None:
        if not isinstance(model_keys, Mapping) or f"{PREFIX}img_in.weight" not in model_keys:
            raise ValueError("hidden_size not given and diffusion_model.img_in.weight shape unknown")
        hidden_size = _shape_of(model_keys[f"{PREFIX}img_in.weight"])[0]

    key_map: dict[str, Any] = {}
    # Generic mappings for every model.
    for k in sdk:
        if k.startswith(PREFIX):
            if k.endswith(".weight"):
                key_lora = k[len(PREFIX):-len(".weight")].replace(".", "_")
                key_map[f"lora_unet_{key_lora}"] = k
                if variant == VARIANT_LEGACY:
                    key_map[f"lora_prior_unet_{key_lora}"] = k  # cascade lora, all models then
                key_map[k[:-len(".weight")]] = k  # generic lora format without any weird key names
            else:
                key_map[k] = k  # generic lora format for not .weight keys
    # comfy.utils.unet_to_diffusers(unet_config) is {} for Flux (no "num_res_blocks").

    # Flux branch.
    depth = _count_blocks(sdk, PREFIX + "double_blocks.{}.")
    depth_single = _count_blocks(sdk, PREFIX + "single_blocks.{}.")
    diffusers_keys = flux_to_diffusers(depth, depth_single, hidden_size, output_prefix=PREFIX)
    for k, to in diffusers_keys.items():
        if k.endswith(".weight"):
            base = k[:-len(".weight")]
            key_map[f"transformer.{base}"] = to  # simpletrainer / diffusers flux lora format
            key_map[f"lycoris_{base.replace('.', '_')}"] = to  # simpletrainer lycoris
            key_map[f"lora_transformer_{base.replace('.', '_')}"] = to  # onetrainer
            if variant == VARIANT_LATEST:
                key_map[base] = to  # DiffSynth lora format (bare diffusers name)
    if variant == VARIANT_LATEST:
        for k in sdk:
            if k.endswith(".weight") and ".linear1." in k:
                key_map[k.replace(".linear1.weight", ".linear1_qkv")] = (k, (0, 0, hidden_size * 3))
    return key_map


# ---------------------------------------------------------------------------
# comfy/lora.py: load_lora + weight_adapter/lora.py LoRAAdapter.load
# ---------------------------------------------------------------------------

class LoraPatch(tuple):
    """``(up, down, alpha_or_None)``; ``.mid`` and ``.dora_scale`` ride along.

    Mirrors LoRAAdapter.weights = (mat1=up, mat2=down, alpha, mid, dora_scale, reshape).
    """

    def __new__(cls, up: torch.Tensor, down: torch.Tensor, alpha: float | None,
                mid: torch.Tensor | None = None, dora_scale: torch.Tensor | None = None):
        self = super().__new__(cls, (up, down, alpha))
        self.mid = mid
        self.dora_scale = dora_scale
        return self

    @property
    def up(self) -> torch.Tensor:
        return self[0]

    @property
    def down(self) -> torch.Tensor:
        return self[1]

    @property
    def alpha(self) -> float | None:
        return self[2]

    @property
    def rank(self) -> int:
        return self[1].shape[0]

    @property
    def scale(self) -> float:
        """What calculate_weight multiplies up@down by (before strength)."""
        return self[2] / self[1].shape[0] if self[2] is not None else 1.0


# (up name, down name, mid name or None), tried in this order by LoRAAdapter.load.
# Legacy (41444b52) accepted the same list minus mochi and qwen_default.
_LORA_NAME_PAIRS: tuple[tuple[str, str, str | None], ...] = (
    ("{}.lora_up.weight", "{}.lora_down.weight", "{}.lora_mid.weight"),  # regular (kohya)
    ("{}_lora.up.weight", "{}_lora.down.weight", None),  # diffusers
    ("{}.lora_B.weight", "{}.lora_A.weight", None),  # diffusers2 (peft)
    ("{}.lora.up.weight", "{}.lora.down.weight", None),  # diffusers3
    ("{}.lora_B", "{}.lora_A", None),  # mochi
    ("{}.lora_linear_layer.up.weight", "{}.lora_linear_layer.down.weight", None),  # transformers
    ("{}.lora_B.default.weight", "{}.lora_A.default.weight", None),  # qwen default
)
_LEGACY_SKIP = {"{}.lora_B", "{}.lora_B.default.weight"}

# Keys that other adapters / patch kinds consume; not ported here.
_UNPORTED_SUFFIXES = (
    ".hada_w1_a", ".hada_w1_b", ".hada_w2_a", ".hada_w2_b", ".hada_t1", ".hada_t2",
    ".lokr_w1", ".lokr_w2", ".lokr_w1_a", ".lokr_w1_b", ".lokr_w2_a", ".lokr_w2_b", ".lokr_t2",
    ".a1.weight", ".a2.weight", ".b1.weight", ".b2.weight",
    ".oft_blocks", ".oft_diag", ".rescale",
    ".w_norm", ".b_norm", ".diff", ".diff_b", ".set_weight", ".reshape_weight", ".row_offset",
)


def _convert_lora_trigger(sd: Mapping[str, Any]) -> str | None:
    """Which comfy.lora_convert.convert_lora rewrite (if any) would change ``sd``."""
    import re

    if "img_in.lora_A.weight" in sd and "single_blocks.0.norm.key_norm.scale" in sd:
        return "convert_lora_bfl_control"
    if "lora_unet__blocks_0_cross_attn_k.lora_down.weight" in sd:
        return "convert_lora_wan_fun"
    if "single_blocks.37.processor.qkv_lora.up.weight" in sd and "double_blocks.18.processor.qkv_lora2.up.weight" in sd:
        return "convert_uso_lora"
    fused = re.compile(r"(.*attn[._]to_)qkv(?=\.|$)")
    if any(fused.search(k) is not None and ("text_fusion" in k or "transformer_blocks" in k) for k in sd):
        return "convert_fused_qkv_lora (Krea2)"
    if any(k.startswith("t_embedder.") for k in sd):
        return "twinflow_z_image_lora_to_diffusers"
    return None


def comfyui_load_lora(
    lora_sd: Mapping[str, torch.Tensor],
    key_map: Mapping[str, Any],
    *,
    variant: str = VARIANT_LATEST,
) -> tuple[dict[Any, LoraPatch], set[str]]:
    """Port of ``comfy.lora.load_lora`` for plain LoRAs.

    Returns ``(patches, unmatched)``: patches maps each target (a model key or
    ComfyUI's tuple target) to ``LoraPatch(up, down, alpha_or_None)``;
    unmatched is the set of LoRA keys ComfyUI would log as
    "lora key not loaded: <key>".
    """
    if variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {_VARIANTS}, not {variant!r}")
    trigger = _convert_lora_trigger(lora_sd)
    if trigger is not None:
        raise OutsidePortError(f"ComfyUI would first rewrite this LoRA with {trigger}; outside this port")
    unported = sorted(k for k in lora_sd if k.endswith(_UNPORTED_SUFFIXES))
    if unported:
        raise OutsidePortError(f"non-plain-LoRA keys (other adapter kinds) are outside this port: {unported[:3]}")

    patches: dict[Any, LoraPatch] = {}
    loaded: set[str] = set()
    for x, target in key_map.items():
        alpha = None
        alpha_name = f"{x}.alpha"
        if alpha_name in lora_sd:
            alpha = lora_sd[alpha_name].item()
            loaded.add(alpha_name)
        dora_scale = None
        dora_name = f"{x}.dora_scale"
        if dora_name in lora_sd:
            dora_scale = lora_sd[dora_name]
            loaded.add(dora_name)

        for up_fmt, down_fmt, mid_fmt in _LORA_NAME_PAIRS:
            if variant == VARIANT_LEGACY and up_fmt in _LEGACY_SKIP:
                continue
            up_name = up_fmt.format(x)
            if up_name not in lora_sd:
                continue
            down_name = down_fmt.format(x)
            mid = None
            if mid_fmt is not None and mid_fmt.format(x) in lora_sd:
                mid = lora_sd[mid_fmt.format(x)]
                loaded.add(mid_fmt.format(x))
            # ComfyUI indexes lora[B_name] unguarded: a missing down raises KeyError there too.
            patches[target] = LoraPatch(lora_sd[up_name], lora_sd[down_name], alpha, mid, dora_scale)
            loaded.add(up_name)
            loaded.add(down_name)
            break

    unmatched = {k for k in lora_sd if k not in loaded}
    return patches, unmatched


def comfyui_not_loaded(patches: Mapping[Any, Any], model_keys: Iterable[str]) -> list[Any]:
    """Targets ``ModelPatcher.add_patches`` would drop (comfy/sd.py logs "NOT LOADED")."""
    keys = set(model_keys.keys() if isinstance(model_keys, Mapping) else model_keys)
    return [t for t in patches if (t if isinstance(t, str) else t[0]) not in keys]


# ---------------------------------------------------------------------------
# Applying: ModelPatcher.add_patches + calculate_weight + LoRAAdapter.calculate_weight
# ---------------------------------------------------------------------------

def _split_target(target: Any) -> tuple[str, tuple | None, Callable | None]:
    if isinstance(target, str):
        return target, None, None
    key, offset = target[0], target[1]
    function = target[2] if len(target) > 2 else None
    return key, offset, function


def comfyui_apply_lora(
    weights: Mapping[str, torch.Tensor],
    patches: Mapping[Any, LoraPatch],
    strength: float = 1.0,
    *,
    strength_model: float = 1.0,
    strict: bool = True,
) -> dict[str, torch.Tensor]:
    """Patched copies of ``weights`` as ComfyUI computes them.

    Per target: ``W[slice] += function(strength * (alpha/rank if alpha else 1.0)
    * (up @ down).reshape(W[slice].shape))``, computed in float32 (ComfyUI's
    lora intermediate dtype) and cast back to the weight's dtype (ComfyUI uses
    stochastic rounding for low-precision dtypes; here plain ``.to``).

    ``strict``: raise where ComfyUI only logs -- a target missing from
    ``weights`` ("NOT LOADED") or a shape mismatch ("ERROR lora ...").  With
    ``strict=False`` those patches are skipped, like ComfyUI does.
    """
    temp: dict[str, torch.Tensor] = {}
    for target, patch in patches.items():
        key, offset, function = _split_target(target)
        if key not in weights:
            if strict:
                raise KeyError(f"NOT LOADED {target!r}: {key} is not a model weight")
            continue
        if key not in temp:
            temp[key] = weights[key].detach().to(torch.float32, copy=True)
        weight = temp[key]
        view = weight.narrow(*offset) if offset is not None else weight
        if function is None:
            function = lambda a: a  # noqa: E731
        if strength_model != 1.0:
            view *= strength_model

        up, down, alpha = patch[0], patch[1], patch[2]
        mid = getattr(patch, "mid", None)
        if getattr(patch, "dora_scale", None) is not None:
            raise OutsidePortError("DoRA (dora_scale) is outside this port")
        mat1 = up.to(torch.float32)
        mat2 = down.to(torch.float32)
        scale = alpha / mat2.shape[0] if alpha is not None else 1.0
        if mid is not None:
            # locon mid (Tucker) weights, ComfyUI's math; only meaningful for conv.
            mat3 = mid.to(torch.float32)
            final_shape = [mat2.shape[1], mat2.shape[0], mat3.shape[2], mat3.shape[3]]
            mat2 = torch.mm(mat2.transpose(0, 1).flatten(start_dim=1),
                            mat3.transpose(0, 1).flatten(start_dim=1)).reshape(final_shape).transpose(0, 1)
        try:
            lora_diff = torch.mm(mat1.flatten(start_dim=1), mat2.flatten(start_dim=1)).reshape(view.shape)
        except RuntimeError as e:
            if strict:
                raise ValueError(f"ERROR lora {target!r} {e}") from e
            continue
        view += function(((strength * scale) * lora_diff).type(view.dtype))

    out = dict(weights)
    for key, w in temp.items():
        out[key] = w.to(weights[key].dtype)
    return out


def comfyui_check_flux_lora(
    lora_sd: Mapping[str, torch.Tensor],
    model_keys: Mapping[str, Any],
    *,
    hidden_size: int | None = None,
    variant: str = VARIANT_LATEST,
) -> tuple[dict[Any, LoraPatch], set[str], list[Any]]:
    """key map -> load -> add_patches in one go: ``(patches, unmatched, not_loaded)``.

    A LoRA is mapped completely by ComfyUI when ``unmatched`` and
    ``not_loaded`` are both empty.
    """
    key_map = comfyui_flux_key_map(model_keys, hidden_size=hidden_size, variant=variant)
    patches, unmatched = comfyui_load_lora(lora_sd, key_map, variant=variant)
    return patches, unmatched, comfyui_not_loaded(patches, model_keys)


__all__ = [
    "VARIANT_LATEST",
    "VARIANT_LEGACY",
    "LoraPatch",
    "flux_bfl_model_keys",
    "flux_to_diffusers",
    "swap_scale_shift",
    "comfyui_flux_key_map",
    "comfyui_load_lora",
    "comfyui_not_loaded",
    "comfyui_apply_lora",
    "comfyui_check_flux_lora",
]
