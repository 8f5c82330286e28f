"""ComfyUI node classes (classic style). They import nothing from ComfyUI or torch at
module level: the standalone runner and the tests use the very same classes."""
from .cache_embeds import LowVRAMCacheTextEmbeds
from .dual_gpu import LowVRAMDualGPUSplit
from .load_model import LowVRAMLoadQuantizedSlab
from .offload_config import LowVRAMOffloadConfig
from .save_lora import LowVRAMSaveLoRA
from .train_lora import LowVRAMTrainLoRA

NODE_CLASS_MAPPINGS = {
    "LowVRAMLoadQuantizedSlab": LowVRAMLoadQuantizedSlab,
    "LowVRAMCacheTextEmbeds": LowVRAMCacheTextEmbeds,
    "LowVRAMOffloadConfig": LowVRAMOffloadConfig,
    "LowVRAMDualGPUSplit": LowVRAMDualGPUSplit,
    "LowVRAMTrainLoRA": LowVRAMTrainLoRA,
    "LowVRAMSaveLoRA": LowVRAMSaveLoRA,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "LowVRAMLoadQuantizedSlab": "Load Quantized Slab",
    "LowVRAMCacheTextEmbeds": "Cache Text Embeds",
    "LowVRAMOffloadConfig": "Offload Config",
    "LowVRAMDualGPUSplit": "Dual-GPU Split",
    "LowVRAMTrainLoRA": "Train LoRA (LowVRAM)",  # ComfyUI has a built-in "Train LoRA"
    "LowVRAMSaveLoRA": "Save LoRA (LowVRAM)",
}
