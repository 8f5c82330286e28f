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
- "comfyui" for a family whose ``lora.comfyui_form`` is ``native_fused`` (Lumina 2):
  ComfyUI maps that family's diffusers names nowhere, so the file uses the native
  module names its generic loader maps (``diffusion_model.<native module>``, e.g.
  ``diffusion_model.layers.0.attention.qkv``) with ``lora_down/lora_up/alpha``.
  The parts of one fused native Linear (q/k/v -> ``qkv``) join exactly as in the
  kohya form: down = cat(A_q, A_k, A_v) (rank 3r), up = block-diagonal over the
  fused rows, alpha = total rank (scale 1; alpha/rank already in B).
  ``to_comfyui_form`` picks the form from the family.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from ..errors import LoraFormatError
from ..families.names import NativeParam

KOHYA_PREFIX = "lora_unet_"
NATIVE_PREFIX = "diffusion_model."


def fold_scale(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    return {k: (v * scale if ".lora_B." in k else v) for k, v in state.items()}


def lora_modules(state: dict[str, torch.Tensor]) -> list[str]:
    return sorted({k.split(".lora_A.")[0] for k in state if ".lora_A." in k})


def _fused_layout(table: list[NativeParam]) -> dict[str, tuple[str, list[tuple[str, int, int]]]]:
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


def to_comfyui(state: dict[str, torch.Tensor], table: list[NativeParam]) -> dict[str, torch.Tensor]:
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


def join_fused(state: dict[str, torch.Tensor], table: list[NativeParam],
               form: str = "ComfyUI's") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Folded peft state -> {native Linear: (down, up)}, scale 1. The parts of a fused native Linear
    join as one LoRA: down = cat of the parts' A (rank = the sum of their ranks), up = block-diagonal,
    each part's B in its row range of the native Linear (zeros where a part has no LoRA)."""
    layout = _fused_layout(table)
    by_native: dict[str, list[str]] = defaultdict(list)
    for module in lora_modules(state):
        if module not in layout:
            raise LoraFormatError(
                f"LoRA module '{module}' has no counterpart in {form} layout of this model; "
                f"save in the diffusers format instead, or train only the default target modules"
            )
        by_native[layout[module][0]].append(module)
    out = {}
    for native, present in sorted(by_native.items()):
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
        up = torch.zeros(total_rows, down.shape[0], dtype=down.dtype)  # (out, R_total)
        col = 0
        for offset, rows, b in blocks:
            up[offset:offset + rows, col:col + b.shape[1]] = b
            col += b.shape[1]
        out[native] = (down.contiguous(), up)
    return out


def split_fused(pairs: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
                table: list[NativeParam], form: str) -> dict[str, torch.Tensor]:
    """{native Linear: (down, up, alpha or None)} -> folded peft state. Fused LoRAs are split by rows of
    up; the columns of up that are zero for a part are dropped (exact), which recovers the per-module
    LoRAs of files we wrote and is still exact for anyone else's."""
    layout = {native: parts for native, parts in _fused_layout(table).values()}
    out: dict[str, torch.Tensor] = {}
    for native, (down, up, alpha) in sorted(pairs.items()):
        if native not in layout:
            raise LoraFormatError(f"LoRA key '{native}' ({form}) is not a module of this model")
        parts = layout[native]
        down, up = down.float(), up.float()
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


def _down_up_alpha(sd: dict[str, torch.Tensor], prefix: str, form: str):
    """{module (prefix stripped): (down, up, alpha)} of ``<prefix><module>.lora_down/lora_up/alpha`` keys
    (peft's ``lora_A``/``lora_B`` spellings too, as diffusion-pipe writes its native LoRAs)."""
    out = {}
    for key in sorted(sd):
        for down_s, up_s in ((".lora_down.weight", ".lora_up.weight"), (".lora_A.weight", ".lora_B.weight")):
            if key.startswith(prefix) and key.endswith(down_s):
                base = key[: -len(down_s)]
                if f"{base}{up_s}" not in sd:
                    raise LoraFormatError(f"LoRA key '{key}' ({form}) has no '{base}{up_s}' beside it")
                out[base[len(prefix):]] = (sd[key], sd[f"{base}{up_s}"], sd.get(f"{base}.alpha"))
    return out


def to_kohya_fused(state: dict[str, torch.Tensor], table: list[NativeParam]) -> dict[str, torch.Tensor]:
    """Folded peft state -> kohya/BFL keys with explicit alpha = rank (scale 1): the layout earlier
    versions wrote as "comfyui". Kept to read those files back in tests; not offered for saving."""
    out = {}
    for native, (down, up) in join_fused(state, table, "ComfyUI's Flux").items():
        key = KOHYA_PREFIX + native.replace(".", "_")
        out[f"{key}.lora_down.weight"] = down
        out[f"{key}.lora_up.weight"] = up
        out[f"{key}.alpha"] = torch.tensor(float(down.shape[0]), dtype=torch.float32)
    return out


def from_kohya_fused(sd: dict[str, torch.Tensor], table: list[NativeParam]) -> dict[str, torch.Tensor]:
    """kohya/BFL keys -> folded peft state (``split_fused``)."""
    by_kohya = {KOHYA_PREFIX + native.replace(".", "_"): native for native, _ in _fused_layout(table).values()}
    pairs = {}
    for key, value in _down_up_alpha(sd, KOHYA_PREFIX, "kohya").items():
        if KOHYA_PREFIX + key not in by_kohya:
            raise LoraFormatError(f"LoRA key '{KOHYA_PREFIX + key}' is not a Flux.1 module of this model")
        pairs[by_kohya[KOHYA_PREFIX + key]] = value
    return split_fused(pairs, table, "kohya")


def to_native_fused(state: dict[str, torch.Tensor], table: list[NativeParam]) -> dict[str, torch.Tensor]:
    """Folded peft state -> ``diffusion_model.<native module>.lora_down.weight`` / ``.lora_up.weight`` /
    ``.alpha`` (alpha = total rank, scale 1): what ComfyUI's generic key map loads for a family whose
    diffusers names it does not map (Lumina 2)."""
    out = {}
    for native, (down, up) in join_fused(state, table).items():
        key = NATIVE_PREFIX + native
        out[f"{key}.lora_down.weight"] = down
        out[f"{key}.lora_up.weight"] = up
        out[f"{key}.alpha"] = torch.tensor(float(down.shape[0]), dtype=torch.float32)
    return out


def to_native_names(state: dict[str, torch.Tensor], table: list[NativeParam]) -> dict[str, torch.Tensor]:
    """Folded peft state -> ``diffusion_model.<native module>.lora_A.weight`` / ``.lora_B.weight``, no ``.alpha``
    (scale 1 in ComfyUI; diffusers' FLUX.3 loader converts the names and takes alpha = rank): the ``native_names``
    form, for a model whose native Linears are each one diffusers Linear. ``load_lora`` reads it back
    (``from_native_fused``)."""
    out = {}
    for native, (down, up) in join_fused(state, table).items():
        out[f"{NATIVE_PREFIX}{native}.lora_A.weight"] = down
        out[f"{NATIVE_PREFIX}{native}.lora_B.weight"] = up.contiguous()
    return out


def from_native_fused(sd: dict[str, torch.Tensor], table: list[NativeParam]) -> dict[str, torch.Tensor]:
    """``diffusion_model.<native module>`` LoRA keys -> folded peft state (``split_fused``)."""
    return split_fused(_down_up_alpha(sd, NATIVE_PREFIX, "native"), table, "native")


def to_comfyui_form(state: dict[str, torch.Tensor], family, config: dict) -> dict[str, torch.Tensor]:
    """The "comfyui" file of ``family`` (its ``lora.comfyui_form``) from a folded peft state."""
    table = family.param_table(config)
    if family.lora.comfyui_form == "native_fused":
        return to_native_fused(state, table)
    if family.lora.comfyui_form == "native_names":
        return to_native_names(state, table)
    if family.lora.comfyui_form == "diffusers_names":
        return to_comfyui(state, table)
    raise LoraFormatError(f"{family.display_name} declares LoraForm comfyui_form={family.lora.comfyui_form!r}; "
                          f"known forms: diffusers_names, native_fused, native_names")


def to_diffusers(state: dict[str, torch.Tensor], adapter=None) -> dict[str, torch.Tensor]:
    """``transformer.``-prefixed peft names (an ``adapter`` type keeps only the tensors diffusers reads)."""
    if adapter is None:
        return {f"transformer.{k}": v.contiguous() for k, v in state.items()}
    return {f"transformer.{m}.{k}": v.contiguous() for m, ms in adapter.modules(state).items()
            for k, v in adapter.diffusers(ms).items()}


def fold_adapter(state: dict[str, torch.Tensor], adapter, scale: float) -> dict[str, torch.Tensor]:
    """``state`` of an adapter type with alpha/rank folded into its weights (``AdapterType.fold``)."""
    return {f"{m}.{k}": v for m, ms in adapter.modules(state).items() for k, v in adapter.fold(ms, scale).items()}


def adapter_to_comfyui_form(state: dict[str, torch.Tensor], adapter, family, config: dict) -> dict[str, torch.Tensor]:
    """The "comfyui" file of a LoHa, LoKr or DoRA (folded state): the keys ComfyUI's ``comfy/weight_adapter/`` reads
    for the type (``AdapterType.comfyui``), under the names its loader maps for the family: ``transformer.<diffusers
    module>`` (each a row slice of a fused BFL Linear) or ``diffusion_model.<native module>`` with the parts of a fused
    native Linear joined into one adapter (``AdapterType.join``, exact or refused)."""
    layout = _fused_layout(family.param_table(config))
    modules = adapter.modules(state)
    missing = [m for m in modules if m not in layout]
    if missing:
        raise LoraFormatError(f"adapter module '{missing[0]}' has no counterpart in ComfyUI's layout of this model; "
                              f"train only the default target modules")
    out = {}
    if family.lora.comfyui_form == "diffusers_names":
        for module, ms in modules.items():
            out.update({f"transformer.{module}.{k}": v for k, v in adapter.comfyui(ms).items()})
    elif family.lora.comfyui_form in ("native_fused", "native_names"):
        by_native: dict[str, list[tuple[str, int, int]]] = {}
        for module in modules:
            native, parts = layout[module]
            by_native[native] = parts
        for native, parts in sorted(by_native.items()):
            if len(parts) == 1:
                tensors = adapter.comfyui(modules[parts[0][0]])
            else:
                tensors = adapter.join(native, [(off, rows, modules.get(name)) for name, off, rows in parts])
            out.update({f"{NATIVE_PREFIX}{native}.{k}": v for k, v in tensors.items()})
    else:
        raise LoraFormatError(f"{family.display_name} declares LoraForm comfyui_form={family.lora.comfyui_form!r}; "
                              f"known forms: diffusers_names, native_fused")
    return {k: v.contiguous() for k, v in out.items()}


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
