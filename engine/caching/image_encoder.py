"""The image encoder of an image-to-video model's first frame (``ImageEncoderSpec``; Wan 2.1 I2V: CLIP ViT-H/14).

Where it comes from: a diffusers pipeline folder's ``image_encoder/`` (``CLIPVisionModel``) and ``image_processor/``
(``CLIPImageProcessor``), or ComfyUI's single file (``clip_vision_h.safetensors``: HF names
``vision_model.encoder.layers.N...``, maybe a ``visual_projection`` the states do not use) with the config and
processor settings of its companion folder (``clip_vision_h/`` beside the file), else the shipped ones of
``spec.architecture`` (``engine/families/configs/image/<name>/``: laion's
CLIP-ViT-H-14-laion2B-s32B-b79K, the image encoder diffusers' Wan 2.1 I2V pipelines ship). What is kept: the hidden
state ``spec.hidden_state`` (-2: the penultimate, as ``WanImageToVideoPipeline.encode_image`` takes it).
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

from ..errors import ModelLoadError

def load_image_encoder(spec, dtype: torch.dtype, pipeline: Path | None = None, file: Path | None = None):
    """(model, processor) from the pipeline folder's parts or the single ``file``; safetensors only."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    if file is None:
        if pipeline is None or not (pipeline / spec.subfolder / "config.json").exists():
            raise ModelLoadError(f"this image-to-video model needs its image encoder: '{pipeline}' has no "
                                 f"{spec.subfolder}/ folder; use the model's full diffusers folder, or give "
                                 f"{spec.file_help} with the single files")
        model = CLIPVisionModel.from_pretrained(pipeline / spec.subfolder, torch_dtype=dtype, local_files_only=True,
                                                use_safetensors=True)
        processor = CLIPImageProcessor.from_pretrained(pipeline / spec.processor_subfolder, local_files_only=True)
        return model.requires_grad_(False).eval(), processor
    from safetensors.torch import load_file

    from .single_files import companion_dir

    own = companion_dir(file)
    shipped = resources.files(__package__.rpartition(".")[0]).joinpath("families", "configs", "image",
                                                                        spec.architecture)
    with resources.as_file(own if (own / "config.json").exists() else shipped) as folder:
        config = CLIPVisionConfig.from_pretrained(folder, local_files_only=True)
        processor = CLIPImageProcessor.from_pretrained(folder, local_files_only=True)
    # ComfyUI's file keeps the tower under ``vision_model.``; transformers 5's CLIPVisionModel names it without.
    state = {k[len("vision_model."):]: v for k, v in load_file(str(file)).items() if k.startswith("vision_model.")}
    with torch.device("meta"):
        model = CLIPVisionModel(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise ModelLoadError(f"'{file}' is not {spec.file_help}: {len(missing)} tensors missing (e.g. "
                             f"{missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]})")
    for name, buffer in list(model.named_buffers()):  # the non-persistent position ids: made, not read
        if buffer.is_meta and name.endswith("position_ids"):
            owner = model.get_submodule(name.rpartition(".")[0])
            owner.register_buffer("position_ids", torch.arange(buffer.shape[-1]).expand(buffer.shape).clone(),
                                  persistent=False)
    return model.to(dtype).requires_grad_(False).eval(), processor


@torch.no_grad()
def encode_first_frames(model, processor, spec, images: list, device, dtype) -> list[torch.Tensor]:
    """PIL images -> each one's (tokens, width) hidden state ``spec.hidden_state``, fp32 on the CPU."""
    model = model.to(device)
    out = []
    for img in images:
        pixels = processor(images=img, return_tensors="pt")["pixel_values"].to(device, dtype)
        states = model(pixel_values=pixels, output_hidden_states=True).hidden_states[spec.hidden_state]
        out.append(states[0].float().cpu())
    return out


def frame_image(pixels: torch.Tensor):
    """A window's first frame (pixels (3, F, H, W) or (3, H, W) in [-1, 1]) as the PIL image the encoder sees."""
    from PIL import Image

    frame = pixels[:, 0] if pixels.dim() == 4 else pixels
    array = ((frame.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
    return Image.fromarray(array)
