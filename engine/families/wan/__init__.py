"""Wan 2.1 / 2.2 (Wan-AI): text-to-video LoRAs (T2V 1.3B and 14B, the A14B experts, TI2V-5B)."""
from .family import WanFamily

FAMILY = WanFamily()
