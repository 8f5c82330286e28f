"""ComfyUI's own nodes that the train-and-try template uses, declared as ComfyUI 0.33 declares them.

Only their declarations: the template builder (``host/templates.py``) needs each node's inputs in order (the UI
format stores widget values by position) and its outputs; ComfyUI runs them. Copied from ``nodes.py`` and
``comfy_extras/nodes_train.py`` of ComfyUI 0.33 (the model lists are whatever the template names: ComfyUI fills
them from its folders). Our own executor (``lowvram-lora run``) does not run these: the train-and-try template is
for ComfyUI; ``demo_tiny_lora`` is the headless demo.
"""
from __future__ import annotations

_DTYPES = ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"]


class UNETLoader:
    DISPLAY_NAME = "Load Diffusion Model"

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802 (ComfyUI's name)
        return {"required": {"unet_name": ([],), "weight_dtype": (_DTYPES, {"advanced": True})}}

    RETURN_TYPES = ("MODEL",)


class VAELoader:
    DISPLAY_NAME = "Load VAE"

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802
        return {"required": {"vae_name": ([],)}}

    RETURN_TYPES = ("VAE",)


class LoraModelLoader:
    DISPLAY_NAME = "Load LoRA Model"

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802
        return {"required": {"model": ("MODEL",), "lora": ("LORA_MODEL",),
                             "strength_model": ("FLOAT", {"default": 1.0, "min": -100.0, "max": 100.0}),
                             "bypass": ("BOOLEAN", {"default": False})}}

    RETURN_TYPES = ("MODEL",)


class EmptyLatentImage:
    DISPLAY_NAME = "Empty Latent Image"

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802
        return {"required": {"width": ("INT", {"default": 512, "min": 16, "step": 8}),
                             "height": ("INT", {"default": 512, "min": 16, "step": 8}),
                             "batch_size": ("INT", {"default": 1, "min": 1})}}

    RETURN_TYPES = ("LATENT",)


class ConditioningZeroOut:
    DISPLAY_NAME = "ConditioningZeroOut"

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802
        return {"required": {"conditioning": ("CONDITIONING",)}}

    RETURN_TYPES = ("CONDITIONING",)


class KSampler:
    DISPLAY_NAME = "KSampler"

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802
        return {"required": {
            "model": ("MODEL",),
            "seed": ("INT", {"default": 0, "min": 0, "control_after_generate": True}),
            "steps": ("INT", {"default": 20, "min": 1}),
            "cfg": ("FLOAT", {"default": 8.0, "min": 0.0, "step": 0.1}),
            "sampler_name": (["euler"],), "scheduler": (["simple"],),
            "positive": ("CONDITIONING",), "negative": ("CONDITIONING",), "latent_image": ("LATENT",),
            "denoise": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0}),
        }}

    RETURN_TYPES = ("LATENT",)


class VAEDecode:
    DISPLAY_NAME = "VAE Decode"

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802
        return {"required": {"samples": ("LATENT",), "vae": ("VAE",)}}

    RETURN_TYPES = ("IMAGE",)


class PreviewImage:
    DISPLAY_NAME = "Preview Image"

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802
        return {"required": {"images": ("IMAGE",)}}

    RETURN_TYPES = ()


COMFY_NODES = {cls.__name__: cls for cls in (UNETLoader, VAELoader, LoraModelLoader, EmptyLatentImage,
                                             ConditioningZeroOut, KSampler, VAEDecode, PreviewImage)}
