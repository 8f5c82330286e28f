"""LoRA training."""
from .loop import train_lora
from ..lora_io.trained import TrainedLora

__all__ = ["TrainedLora", "train_lora"]
