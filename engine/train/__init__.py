"""LoRA training."""
from .loop import train_lora
from .trained_lora import TrainedLora

__all__ = ["TrainedLora", "train_lora"]
