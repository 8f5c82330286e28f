"""Save LoRA: write the trained LoRA (and its loss curve) to the output folder."""
from __future__ import annotations

from pathlib import Path

from .load_model import CATEGORY
from .paths import output_dir


def next_free_path(root: Path, prefix: str) -> Path:
    """``<root>/<prefix>_00001_.safetensors``, counting up past existing files (ComfyUI's
    convention), so nothing on disk is ever replaced."""
    prefix = prefix.strip().replace("\\", "/") or "lowvram_lora"
    target = (root / prefix).resolve()
    if root.resolve() not in target.parents:
        raise ValueError(f"filename_prefix '{prefix}' must stay inside the output folder {root}")
    target.parent.mkdir(parents=True, exist_ok=True)
    n = 1
    while (target.parent / f"{target.name}_{n:05d}_.safetensors").exists():
        n += 1
    return target.parent / f"{target.name}_{n:05d}_.safetensors"


class LowVRAMSaveLoRA:
    DESCRIPTION = (
        "Saves the LoRA as .safetensors in the output folder (plus a loss-curve PNG beside it). The 'comfyui' "
        "format loads in ComfyUI's LoRA loaders; 'diffusers' loads with diffusers' load_lora_weights and in ComfyUI."
    )
    CATEGORY = CATEGORY
    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "save"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "lora": ("LOWVRAM_LORA", {"tooltip": "The trained LoRA from Train LoRA."}),
                "filename_prefix": ("STRING", {
                    "default": "loras/flux_lora",
                    "tooltip": "Path inside the output folder; a counter is added, existing files are never replaced. "
                               "Copy the file to models/loras to use it.",
                }),
                "format": (["comfyui", "diffusers"], {
                    "default": "comfyui",
                    "tooltip": "comfyui: one LoRA per projection under 'transformer.' names with an explicit alpha "
                               "tensor (scale 1); ComfyUI maps every key into its fused layers, and diffusers loads "
                               "it too. diffusers: the same names without alpha tensors (diffusers' own layout; "
                               "ComfyUI reads it at scale 1 as well). Both are the same size.",
                }),
                "dtype": (["bf16", "fp16", "fp32"], {
                    "default": "bf16",
                    "tooltip": "Precision of the saved weights. bf16 halves the file with no visible loss.",
                }),
            }
        }

    def save(self, lora, filename_prefix: str = "loras/flux_lora", format: str = "comfyui", dtype: str = "bf16"):
        from ..engine.lora_io import save_lora
        from ..engine.plotting import save_loss_curve

        path = save_lora(lora, next_free_path(output_dir(), filename_prefix), fmt=format, dtype=dtype)
        curve = save_loss_curve(lora.loss_history, path.with_name(path.stem + "_loss.png"))
        print(f"[lowvram-lora] saved LoRA: {path}\n[lowvram-lora] loss curve: {curve}")
        # filename/subfolder/type entries are what ComfyUI clients (comfy run --wait) list as outputs.
        root = output_dir().resolve()
        files = [{"filename": p.name, "subfolder": p.parent.resolve().relative_to(root).as_posix(), "type": "output"}
                 for p in (path, curve)]
        return {"ui": {"text": [str(path)], "loss_curve": [str(curve)], "files": files}, "result": ()}
