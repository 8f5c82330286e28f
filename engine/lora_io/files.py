"""Write and read LoRA .safetensors files, atomically and with metadata."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import LoraFormatError
from ..fileio import atomic_write
from ..families import get_family
from .trained import TrainedLora
from ..version import VERSION
from .adapters import get_adapter
from .formats import (NATIVE_PREFIX, adapter_to_comfyui_form, fold_adapter, fold_scale, from_diffusers, from_kohya_fused,
                      from_native_fused, lora_modules, to_comfyui_form, to_diffusers)

FORMATS = ("comfyui", "diffusers")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class LoadedLora:
    state_dict: dict[str, torch.Tensor]  # folded peft names (scale 1)
    format: str
    metadata: dict[str, str] = field(default_factory=dict)
    adapter: str = "lora"  # the adapter type (engine/lora_io/adapters/)

    @property
    def rank(self) -> int:
        handler = get_adapter(self.adapter)
        return max(handler.rank_of(ms) for ms in handler.modules(self.state_dict).values())


def _metadata(lora: TrainedLora, fmt: str) -> dict[str, str]:
    final_loss = lora.loss_history[-1] if lora.loss_history else float("nan")
    return {
        "format": "pt",
        "modelspec.architecture": get_family(lora.family).lora.architecture_of(lora.variant),
        "lowvram_lora.version": VERSION,
        "lowvram_lora.format": fmt,
        "lowvram_lora.family": lora.family,
        "lowvram_lora.variant": lora.variant,
        "lowvram_lora.adapter": lora.adapter,
        "lowvram_lora.weights": lora.weights,  # "ema": the EMA of the weights (its own file, <name>_ema), or "last"
        "lowvram_lora.rank": str(lora.rank),
        "lowvram_lora.alpha": str(lora.alpha),
        "lowvram_lora.scale_folded": "true",  # B already holds alpha/rank; files load at scale 1
        "lowvram_lora.steps": str(lora.steps),
        "lowvram_lora.dataset_hash": lora.dataset_hash,
        "lowvram_lora.base_model": os.path.basename(lora.base_model.rstrip("/")),
        "lowvram_lora.final_loss": f"{final_loss:.6f}",
        "lowvram_lora.model_config": json.dumps(lora.model_config, sort_keys=True),
        # what trained it (adapter type and settings, EMA, the loop's settings): a snapshot says it too
        "lowvram_lora.settings": json.dumps({k: lora.settings[k] for k in ("lora", "train") if k in lora.settings},
                                            sort_keys=True, default=str),
    }


def lora_tensors(lora: TrainedLora, fmt: str = "comfyui", dtype: str = "bf16") -> dict[str, torch.Tensor]:
    """The tensors a LoRA file of ``fmt`` holds, scale folded in: what ``save_lora`` writes, and (``comfyui``) the
    LORA_MODEL that ComfyUI's LoraModelLoader applies, the same dict its LoraLoader reads from the saved file."""
    if fmt not in FORMATS:
        raise LoraFormatError(f"format={fmt!r} is not one of {', '.join(FORMATS)}")
    if dtype not in _DTYPES:
        raise LoraFormatError(f"dtype={dtype!r} is not one of {', '.join(_DTYPES)}")
    adapter = get_adapter(lora.adapter)
    if fmt == "diffusers" and not adapter.diffusers_loads:
        raise LoraFormatError(f"diffusers has no loader for {adapter.name} adapters; save this one in the comfyui "
                              f"format (ComfyUI reads it)")
    if adapter.name == "lora":
        folded = fold_scale(lora.state_dict, lora.scale)
        if fmt == "comfyui":  # the form ComfyUI's loader maps for this family (its LoraForm.comfyui_form)
            tensors = to_comfyui_form(folded, get_family(lora.family), lora.model_config)
        else:
            tensors = to_diffusers(folded)
    else:  # LoHa, LoKr, DoRA: the keys of comfy/weight_adapter/ (engine/lora_io/adapters/)
        folded = fold_adapter(lora.state_dict, adapter, lora.scale)
        if fmt == "comfyui":
            tensors = adapter_to_comfyui_form(folded, adapter, get_family(lora.family), lora.model_config)
        else:
            tensors = to_diffusers(folded, adapter)
    return {k: (v if k.endswith(".alpha") else v.to(_DTYPES[dtype])).contiguous() for k, v in tensors.items()}


def save_lora(lora: TrainedLora, path: str | Path, fmt: str = "comfyui", dtype: str = "bf16",
              overwrite: bool = False) -> Path:
    """Write ``lora`` to ``path``. Written to a temporary name, then renamed, so an existing
    file is never half-overwritten; an existing file is kept unless ``overwrite``."""
    if fmt not in FORMATS:
        raise LoraFormatError(f"format={fmt!r} is not one of {', '.join(FORMATS)}")
    if dtype not in _DTYPES:
        raise LoraFormatError(f"dtype={dtype!r} is not one of {', '.join(_DTYPES)}")
    if not lora.state_dict:
        raise LoraFormatError("this LoRA has no weights (training stopped before the first step)")
    path = Path(path)
    if path.suffix != ".safetensors":
        raise LoraFormatError(f"'{path}' must end in .safetensors")
    if path.exists() and not overwrite:
        raise LoraFormatError(f"'{path}' already exists; choose another name or allow overwriting")
    tensors = lora_tensors(lora, fmt, dtype)
    try:
        with atomic_write(path, "the LoRA file", overwrite=overwrite) as tmp:
            save_file(tensors, str(tmp), metadata=_metadata(lora, fmt))
    except FileExistsError:
        raise LoraFormatError(f"'{path}' already exists; choose another name or allow overwriting") from None
    return path


def load_lora(path: str | Path) -> LoadedLora:
    """Read a LoRA we (or a kohya/diffusers-style tool) wrote, into folded peft names."""
    path = Path(path)
    if not path.is_file():
        raise LoraFormatError(f"LoRA file '{path}' does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            sd = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:
        raise LoraFormatError(f"'{path}' is not a readable safetensors file ({exc})") from exc
    adapter = _adapter_of_file(sd)
    if adapter.name != "lora":
        return LoadedLora(_read_adapter(sd, meta, adapter, path), "comfyui", meta, adapter.name)
    if any(k.startswith("lora_unet_") for k in sd):  # kohya names on fused BFL modules (earlier versions)
        config = _model_config(meta, sd, path)
        state = from_kohya_fused(sd, get_family(meta.get("lowvram_lora.family", "flux1")).param_table(config))
        fmt = "comfyui"
    elif any(k.startswith(NATIVE_PREFIX) for k in sd):  # native module names (native_fused families)
        if "lowvram_lora.model_config" not in meta or "lowvram_lora.family" not in meta:
            raise LoraFormatError(f"'{path}' has native 'diffusion_model.' LoRA keys but no lowvram_lora.family / "
                                  f"model_config metadata, so its fused modules cannot be split; only files this "
                                  f"package wrote are read in this form")
        family = get_family(meta["lowvram_lora.family"])
        state = from_native_fused(sd, family.param_table(json.loads(meta["lowvram_lora.model_config"])))
        fmt = "comfyui"
    elif any(".lora_A." in k for k in sd):
        state = from_diffusers(sd)
        fmt = meta.get("lowvram_lora.format") or ("comfyui" if any(k.endswith(".alpha") for k in sd) else "diffusers")
    else:
        raise LoraFormatError(f"'{path}' has no LoRA keys in a known layout (kohya lora_unet_*, native diffusion_model.* "
                              f"or peft lora_A/lora_B)")
    if not lora_modules(state):
        raise LoraFormatError(f"'{path}' holds no LoRA modules")
    return LoadedLora(state, fmt, meta)


def _model_config(meta: dict[str, str], sd: dict[str, torch.Tensor], path: Path) -> dict:
    """Shapes needed to split fused modules: from our metadata, else from the tensors."""
    if "lowvram_lora.model_config" in meta:
        return json.loads(meta["lowvram_lora.model_config"])
    proj = [v for k, v in sd.items() if k.endswith("img_attn_proj.lora_up.weight")]
    if not proj:
        raise LoraFormatError(f"cannot tell the model width of '{path}' (no img_attn.proj LoRA and no metadata)")
    hidden = proj[0].shape[0]
    blocks = lambda tag: 1 + max((int(k.split("_")[4 if tag == "double" else 4]) for k in sd
                                  if k.startswith(f"lora_unet_{tag}_blocks_")), default=-1)
    return {"num_attention_heads": hidden // 128, "attention_head_dim": 128, "num_layers": blocks("double"),
            "num_single_layers": blocks("single"), "guidance_embeds": True}


def _adapter_of_file(sd: dict[str, torch.Tensor]):
    """The adapter type of a file's keys: LoHa/LoKr by their names, DoRA by ``dora_scale`` or peft's magnitude."""
    from .adapters import adapter_types

    for name in ("loha", "lokr"):
        if any(adapter_types()[name].owns(k) for k in sd):
            return adapter_types()[name]
    if any(k.endswith((".dora_scale", ".lora_magnitude_vector")) for k in sd):
        return get_adapter("dora")
    return get_adapter("lora")


def _read_adapter(sd: dict[str, torch.Tensor], meta: dict[str, str], adapter, path: Path) -> dict[str, torch.Tensor]:
    """A LoHa/LoKr/DoRA file we wrote -> folded peft state (scale 1): ``transformer.<diffusers module>`` names, or
    ``diffusion_model.<native module>`` names of native Linears that are one diffusers module each (Wan). ``alpha``
    is applied (alpha / the type's rank; none = 1). The parts of a fused native Linear are not split back."""
    from .formats import _fused_layout

    rename = {}
    if any(k.startswith(NATIVE_PREFIX) for k in sd):
        if "lowvram_lora.model_config" not in meta or "lowvram_lora.family" not in meta:
            raise LoraFormatError(f"'{path}' has native 'diffusion_model.' {adapter.name} keys but no lowvram_lora "
                                  f"family / model_config metadata; only files this package wrote are read in this form")
        layout = _fused_layout(get_family(meta["lowvram_lora.family"]).param_table(
            json.loads(meta["lowvram_lora.model_config"])))
        for module, (native, parts) in layout.items():
            if len(parts) == 1:
                rename[native] = module
    state = {}
    for key, value in sd.items():
        name = key.removeprefix("transformer.")
        if key.startswith(NATIVE_PREFIX):
            native = key[len(NATIVE_PREFIX):].rsplit(".", 1)[0]
            if native not in rename:
                raise LoraFormatError(f"'{path}': {adapter.name} key '{key}' is on a fused native Linear, which is not "
                                      f"split back into its parts; continue from a diffusers-named file instead")
            name = rename[native] + key[len(NATIVE_PREFIX) + len(native):]
        state[name] = value.float()
    alphas = {k[: -len(".alpha")]: float(v) for k, v in state.items() if k.endswith(".alpha")}
    out = {}
    for module, ms in adapter.modules(state).items():
        rank = adapter.rank_of(ms)
        scale = alphas[module] / rank if module in alphas and rank else 1.0
        out.update({f"{module}.{k}": v for k, v in adapter.fold(ms, scale).items()})
    if not out:
        raise LoraFormatError(f"'{path}' holds no {adapter.name} modules")
    return out
