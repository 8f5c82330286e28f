"""The pack's nodes, each a V3-style node (nodes/schema.py: ``define_schema`` + classmethod ``execute``).

Inside ComfyUI they are registered through ``comfy_entrypoint`` (package root), turned into
``io.ComfyNode`` classes by nodes/v3.py. ``NODE_CLASS_MAPPINGS`` here is for our own executor
(``lowvram-lora run`` / ``serve``) and the tests; the package root does not export it, because ComfyUI
prefers ``NODE_CLASS_MAPPINGS`` over ``comfy_entrypoint`` when a pack has both, and every ComfyUI the pack
supports (``requires-comfyui >= 0.3.64``) has the V3 API. Nothing here imports ComfyUI or torch.
"""
from .adapter_options import LowVRAMLoraAdapter
from .cache_embeds import LowVRAMCacheTextEmbeds
from .dataset_options import LowVRAMDatasetOptions
from .dual_gpu import LowVRAMDualGPUSplit
from .image_dataset import LowVRAMImagesToDataset
from .load_model import LowVRAMLoadQuantizedSlab
from .loss_options import LowVRAMLossOptions
from .offload_config import LowVRAMOffloadConfig
from .offload_tuning import LowVRAMOffloadTuning
from .prompt_conditioning import LowVRAMSamplePromptConditioning
from .save_lora import LowVRAMSaveLoRA
from .train_lora import LowVRAMTrainLoRA
from .training_options import LowVRAMPreviewOptions, LowVRAMTrainingOptions

#: In the order the editor lists them; each class is named as its node id (``Schema.node_id``).
NODES = [LowVRAMLoadQuantizedSlab, LowVRAMCacheTextEmbeds, LowVRAMOffloadConfig, LowVRAMDualGPUSplit,
         LowVRAMTrainLoRA, LowVRAMSaveLoRA, LowVRAMLoraAdapter, LowVRAMDatasetOptions, LowVRAMLossOptions,
         LowVRAMTrainingOptions, LowVRAMPreviewOptions, LowVRAMOffloadTuning, LowVRAMSamplePromptConditioning,
         LowVRAMImagesToDataset]

NODE_CLASS_MAPPINGS = {cls.__name__: cls for cls in NODES}


def __getattr__(name: str):
    # Display names live in each schema; computed on first use (a schema lists model files).
    if name == "NODE_DISPLAY_NAME_MAPPINGS":
        return {cls.__name__: cls.GET_SCHEMA().display_name for cls in NODES}
    raise AttributeError(name)
