"""Qwen-Image (Alibaba Qwen, 20B MMDiT): text-to-image, and the 2512 release of the same shape."""
from .family import QwenImageFamily

FAMILY = QwenImageFamily()
