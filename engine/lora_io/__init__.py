"""LoRA files: ComfyUI (kohya/BFL) and diffusers/PEFT formats, both ways."""
from .files import FORMATS, LoadedLora, load_lora, save_lora

__all__ = ["FORMATS", "LoadedLora", "load_lora", "save_lora"]
