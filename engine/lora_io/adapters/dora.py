"""DoRA: LoRA plus a trained magnitude per output row (peft ``LoraConfig(use_dora=True)``):
W' = m / ||W + s B A||_row * (W + s B A).

Saved for ComfyUI as a LoRA with ``dora_scale`` (comfy/weight_adapter/base.py ``weight_decompose``). ComfyUI divides
by the row norms of the *base* weight W, not of W + delta as peft (and the DoRA paper) do, so the file's
``dora_scale`` is m * (||W|| + eps) / ||W + s B A||, computed from the base weights at export (``export``): ComfyUI then
builds exactly peft's merged weight, for the base weights the adapter was trained on (for an int8 slab, its
dequantized weights; the bf16 original differs from them by the quantization error, as every LoRA's base does).
diffusers reads peft's own form (``lora_magnitude_vector`` = m).

Glue for our quantized slab Linears (engine/slab/int8_linear.py, int4_linear.py): peft's DoRA reads the base weight through
``peft.utils.integrations.dequantize_module_weight``, which knows bitsandbytes, HQQ and torchao but would hand back
our raw int8 storage. ``DoraLinear`` (registered with ``LoraConfig._register_custom_module``) is peft's own
``lora.Linear`` whose DoRA layer sees an ``Int8Linear`` or ``Int4Linear`` base through a float view (its ``dequantized_weight()``); float Linears
pass through unchanged. Everything else (init, forward, the detached norm of section 4.3) is peft's code.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from ._base import Part, block_rows, scalar, stacked
from .lora import Lora

ADAPTER_NAME = "default"


class _FloatView:
    """What peft's DoRA code reads of a base layer: ``weight`` (dequantized to ``dtype``), ``bias``, ``parameters``."""

    def __init__(self, layer: nn.Module, dtype: torch.dtype):
        self.weight = layer.dequantized_weight(dtype)
        self.bias = layer.bias

    def parameters(self):  # peft gathers them (DeepSpeed ZeRO-3 only); a slab layer has none to gather
        return iter(())


def _float_view(layer: nn.Module, dtype: torch.dtype):
    from ...slab import Int8Linear
    from ...slab.int4_linear import Int4Linear

    return _FloatView(layer, dtype) if isinstance(layer, (Int8Linear, Int4Linear)) else layer


@functools.cache
def _dora_classes():
    """peft's DoRA layer, variant and LoRA Linear, each with the float view put in (built on first use: peft is a
    heavy import)."""
    from peft.tuners.lora.dora import DoraLinearLayer
    from peft.tuners.lora.layer import Linear
    from peft.tuners.lora.variants import DoraLinearVariant

    class QuantDoraLayer(DoraLinearLayer):
        def update_layer(self, *, base_layer, **kwargs):
            super().update_layer(base_layer=_float_view(base_layer, torch.float32), **kwargs)

        def forward(self, x, *, base_layer, **kwargs):
            return super().forward(x, base_layer=_float_view(base_layer, x.dtype), **kwargs)

    class QuantDoraVariant(DoraLinearVariant):
        @staticmethod
        def init(module, adapter_name, **kwargs):
            # peft's DoraLinearVariant.init with QuantDoraLayer (ephemeral GPU offload is not used here).
            if not module.lora_magnitude_vector:
                module.adapter_layer_names = module.adapter_layer_names[:] + ("lora_magnitude_vector",)
            layer = QuantDoraLayer(fan_in_fan_out=module.fan_in_fan_out)
            layer.update_layer(base_layer=module.get_base_layer(), lora_A=module.lora_A[adapter_name].weight,
                               lora_B=module.lora_B[adapter_name].weight, scaling=module.scaling[adapter_name])
            module.lora_magnitude_vector[adapter_name] = layer

    class DoraLinear(Linear):
        @property
        def lora_variants(self):
            return {**super().lora_variants, ("use_dora",): QuantDoraVariant}

    return DoraLinear


class Dora(Lora):
    name = "dora"
    suffixes = ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector", "dora_scale")
    diffusers_loads = True
    #: ``dora_scale`` is ComfyUI's; diffusers reads peft's names.
    diffusers_suffixes = ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector")

    def peft_config(self, settings, targets):
        config = super().peft_config(settings, targets, use_dora=True)
        config._register_custom_module({nn.Linear: _dora_classes()})
        return config

    def param_count(self, in_features, out_features, settings):
        return settings.rank * (in_features + out_features) + out_features

    def export(self, model, state, scale):
        """Adds ``<module>.dora_scale`` (out, 1): m * ||W|| / ||W + s B A||, ComfyUI's form (module doc)."""
        from peft.tuners.lora.layer import LoraLayer

        out = dict(state)
        for name, module in model.named_modules():
            if not isinstance(module, LoraLayer) or ADAPTER_NAME not in module.lora_magnitude_vector:
                continue
            base = _float_view(module.get_base_layer(), torch.float32).weight.detach()
            with torch.no_grad():
                w = base.float().cpu()
                a, b = state[f"{name}.lora_A.weight"].float(), state[f"{name}.lora_B.weight"].float()
                m = state[f"{name}.lora_magnitude_vector"].float()
                merged_norm = torch.linalg.norm(w + scale * (b @ a), dim=1)
                # ComfyUI adds fp32's eps to ||W|| (it patches in fp32): put it in too, so it cancels exactly.
                base_norm = torch.linalg.norm(w, dim=1) + torch.finfo(torch.float32).eps
                out[f"{name}.dora_scale"] = (m * base_norm / merged_norm)[:, None].contiguous()
        return out

    def fold(self, module_state, scale):
        return super().fold(module_state, scale)  # B only: m and dora_scale already describe the folded delta

    def comfyui(self, module_state):
        return {**super().comfyui(module_state), "dora_scale": module_state["dora_scale"]}

    def join(self, native: str, parts: list[Part]) -> dict[str, torch.Tensor]:
        """LoRA's join, with the parts' dora_scale rows one under another (a row's norm is its own): every part of
        the fused Linear must have a DoRA, or the rows without one would need their base weight's norms."""
        from ...errors import LoraFormatError

        if any(s is None for _, _, s in parts):
            raise LoraFormatError(f"DoRA on only some parts of the fused Linear '{native}' has no ComfyUI form; "
                                  f"target all of its parts (the default targets do)")
        rows = sum(r for _, r, _ in parts)
        down = stacked(parts, "lora_A.weight")
        return {"lora_A.weight": down, "lora_B.weight": block_rows(parts, "lora_B.weight", rows),
                "alpha": scalar(down.shape[0]), "dora_scale": torch.cat([s["dora_scale"] for _, _, s in parts])}


ADAPTER = Dora()
