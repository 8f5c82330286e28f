"""LoRA key layouts and conversions between them.

Internal form: peft names on the diffusers model, ``<module>.lora_A.weight``
(rank x in) and ``<module>.lora_B.weight`` (out x rank), with the scale
alpha/rank already folded into B. Folding makes a file mean the same thing in
every loader: ComfyUI uses scale 1 without ``.alpha``, diffusers uses alpha =
rank without metadata (and refuses files having both ``.alpha`` tensors and
``lora_adapter_metadata``).

File forms:
- "diffusers": ``transformer.<diffusers module>.lora_A/lora_B.weight``; loads in
  diffusers (``load_lora_adapter``) and in ComfyUI (``transformer.`` names).
- "comfyui": the same per-projection ``transformer.<diffusers module>`` names plus
  a float32 ``.alpha`` equal to the rank beside each module (scale 1, said
  explicitly, so no loader can guess another). ComfyUI maps each of these names
  into its row slice of the fused BFL Linear (``comfy/lora.py``
  ``model_lora_keys_unet`` via ``comfy.utils.flux_to_diffusers``: to_q/to_k/to_v
  into ``img_attn.qkv``, single blocks' q/k/v/proj_mlp into ``linear1``), in
  ComfyUI 0.3.64 and 0.33; diffusers loads the file too (float alphas, no
  ``lora_adapter_metadata``). Only modules that ComfyUI maps are accepted.

  Files of earlier versions used kohya names on the fused BFL modules
  (``lora_unet_double_blocks_0_img_attn_qkv``, q/k/v joined as a block-diagonal
  rank-3r LoRA); they are still read (``from_kohya_fused``) but no longer
  written: that form is exact too but 2.1x the size (194 vs 94 MB for a
  Flux.1-dev r16 LoRA).
"""
from __future__ import annotations

from collections import defaultdict

import torch

from ..errors import LoraFormatError
from ..families.names import NativeParam as BflParam

KOHYA_PREFIX = "lora_unet_"


def fold_scale(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    return {k: (v * scale if ".lora_B." in k else v) for k, v in state.items()}


def lora_modules(state: dict[str, torch.Tensor]) -> list[str]:
    return sorted({k.split(".lora_A.")[0] for k in state if ".lora_A." in k})


def _fused_layout(table: list[BflParam]) -> dict[str, tuple[str, list[tuple[str, int, int]]]]:
    """diffusers Linear -> (BFL Linear, [(diffusers Linear, row offset, rows) of all its parts])."""
    out = {}
    for param in table:
        if not param.name.endswith(".weight") or param.swap_halves:
            continue
        bfl = param.name[: -len(".weight")]
        parts = [(p.name[: -len(".weight")], p.offset, p.rows) for p in param.parts]
        for name, _, _ in parts:
            out[name] = (bfl, parts)
    return out


def to_comfyui(state: dict[str, torch.Tensor], table: list[BflParam]) -> dict[str, torch.Tensor]:
    """Folded peft state -> per-projection ``transformer.`` keys with explicit alpha = rank (scale 1).
    Every module must be one ComfyUI maps (a part of a BFL Linear in ``table``)."""
    layout = _fused_layout(table)
    out = {}
    for module in lora_modules(state):
        if module not in layout:
            raise LoraFormatError(
                f"LoRA module '{module}' has no counterpart in ComfyUI's layout of this model; "
                f"save in the diffusers format instead, or train only the default target modules"
            )
        down = state[f"{module}.lora_A.weight"]
        out[f"transformer.{module}.lora_A.weight"] = down.contiguous()
        out[f"transformer.{module}.lora_B.weight"] = state[f"{module}.lora_B.weight"].contiguous()
        out[f"transformer.{module}.alpha"] = torch.tensor(float(down.shape[0]), dtype=torch.float32)
    return out


def to_kohya_fused(state: dict[str, torch.Tensor], table: list[BflParam]) -> dict[str, torch.Tensor]:
    """Folded peft state -> kohya/BFL keys with explicit alpha = rank (scale 1): the layout earlier
    versions wrote as "comfyui". Kept to read those files back in tests; not offered for saving."""
    layout = _fused_layout(table)
    by_bfl: dict[str, list[str]] = defaultdict(list)
    for module in lora_modules(state):
        if module not in layout:
            raise LoraFormatError(
                f"LoRA module '{module}' has no counterpart in ComfyUI's Flux layout; "
                f"save in the diffusers format instead, or train only the default target modules"
            )
        by_bfl[layout[module][0]].append(module)
    out = {}
    for bfl, present in sorted(by_bfl.items()):
        parts = layout[present[0]][1]
        downs, blocks = [], []
        for name, offset, rows in parts:
            if name in present:
                downs.append(state[f"{name}.lora_A.weight"])
                blocks.append((offset, rows, state[f"{name}.lora_B.weight"]))
        down = torch.cat(downs, dim=0)  # (R_total, in)
        total_rows = sum(rows for _, _, rows in parts)
        if len(parts) == 1:
            total_rows = blocks[0][2].shape[0]
        up = torch.zeros(total_rows, down.shape[0], dtype=down.dtype)
        col = 0
        for offset, rows, b in blocks:
            up[offset:offset + rows, col:col + b.shape[1]] = b
            col += b.shape[1]
        key = KOHYA_PREFIX + bfl.replace(".", "_")
        out[f"{key}.lora_down.weight"] = down.contiguous()
        out[f"{key}.lora_up.weight"] = up
        out[f"{key}.alpha"] = torch.tensor(float(down.shape[0]), dtype=torch.float32)
    return out


def from_kohya_fused(sd: dict[str, torch.Tensor], table: list[BflParam]) -> dict[str, torch.Tensor]:
    """kohya/BFL keys -> folded peft state. Fused LoRAs are split by rows of up; the
    columns of up that are zero for a part are dropped (exact), which recovers the
    per-module LoRAs of files we wrote and is still exact for anyone else's."""
    layout = _fused_layout(table)
    by_kohya = {KOHYA_PREFIX + bfl.replace(".", "_"): (bfl, parts) for bfl, parts in layout.values()}
    out: dict[str, torch.Tensor] = {}
    for key in sorted(k for k in sd if k.endswith(".lora_down.weight")):
        base = key[: -len(".lora_down.weight")]
        if base not in by_kohya:
            raise LoraFormatError(f"LoRA key '{base}' is not a Flux.1 module of this model")
        _, parts = by_kohya[base]
        down, up = sd[key].float(), sd[f"{base}.lora_up.weight"].float()
        alpha = sd.get(f"{base}.alpha")
        up = up * (float(alpha) / down.shape[0] if alpha is not None else 1.0)
        if len(parts) == 1:
            out[f"{parts[0][0]}.lora_A.weight"], out[f"{parts[0][0]}.lora_B.weight"] = down, up
            continue
        for name, offset, rows in parts:
            block = up[offset:offset + rows]
            cols = block.abs().sum(dim=0).nonzero().flatten()
            if cols.numel():
                out[f"{name}.lora_A.weight"] = down[cols].contiguous()
                out[f"{name}.lora_B.weight"] = block[:, cols].contiguous()
    return out


def to_diffusers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"transformer.{k}": v.contiguous() for k, v in state.items()}


def from_diffusers(sd: dict[str, torch.Tensor], alpha_from_metadata: float | None = None) -> dict[str, torch.Tensor]:
    """``transformer.``-prefixed (or bare) peft keys -> folded peft state."""
    out = {}
    for k, v in sd.items():
        if k.endswith(".alpha"):
            continue
        name = k[len("transformer."):] if k.startswith("transformer.") else k
        out[name] = v.float()
    for module in lora_modules(out):
        alpha = sd.get(f"transformer.{module}.alpha", sd.get(f"{module}.alpha"))
        rank = out[f"{module}.lora_A.weight"].shape[0]
        a = float(alpha) if alpha is not None else alpha_from_metadata
        if a is not None:
            out[f"{module}.lora_B.weight"] = out[f"{module}.lora_B.weight"] * (a / rank)
    return out
