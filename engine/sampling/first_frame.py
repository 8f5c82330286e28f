"""Previews of an image-to-video model (``FirstFrameCondition``): each sample prompt drawn from a first frame taken
from the dataset, as ``WanImageToVideoPipeline`` draws from its ``image``.

Sample prompt line i takes dataset item i's first frame (items in cache order: the first clip window first), as an
edit model's line i takes pair i's control images; more lines than items is an error. The frame is scaled to cover
the preview's size and center-cropped (as the dataset's windows are) and encoded with the VAE the sampler decodes
with, at the preview's frame count; the image encoder's states (Wan 2.1 I2V's CLIP) are the ones cached with that
window (the image encoder resizes to its own size either way). The negative branch gets the same conditioning, as the
pipeline runs both branches on one ``condition`` and ``image_embeds``.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ConfigError


def check_first_frames(dataset, prompts: int) -> None:
    if prompts > len(dataset.items):
        raise ConfigError(f"{prompts} sample prompts but the dataset has {len(dataset.items)} clip window(s): an "
                          f"image-to-video preview takes sample prompt line i's first frame from dataset item i; give "
                          f"at most {len(dataset.items)} lines")


def first_frame_pixels(item, width: int, height: int, frames: int) -> torch.Tensor:
    """(1, 3, frames, height, width) in [-1, 1]: the item's first frame, then zeros (they are not read)."""
    from ..data import load_clip_tensor, load_image_tensor

    if item.frames:
        first = load_clip_tensor(Path(item.image), item.frames[:1], (width, height))[:, 0]
    else:
        first = load_image_tensor(Path(item.image), (width, height))
    pixels = torch.zeros(1, 3, frames, height, width)
    pixels[0, :, 0] = first
    return pixels


@torch.no_grad()
def preview_conditions(dataset, family, vae, width: int, height: int, frames: int, device, dtype,
                       count: int) -> list[dict[str, torch.Tensor]]:
    """The first-frame conditioning of the first ``count`` sample prompts, each a batch of one."""
    condition = family.first_frame(dataset.variant)
    check_first_frames(dataset, count)
    out = []
    was = next(vae.parameters()).device
    vae.to(device)
    try:
        for item in dataset.items[:count]:
            pixels = first_frame_pixels(item, width, height, frames).to(device, dtype)
            cond = {k: v.float().cpu() for k, v in condition.encode_latents(vae, pixels).items()}
            if condition.image_encoder is not None:
                key = condition.image_encoder.cache_key
                cond[key] = dataset.load_item(item)[1][key][None].float()
            out.append(cond)
    finally:
        vae.to(was)
    return out
