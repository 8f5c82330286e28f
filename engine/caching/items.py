"""What a dataset cache holds, item by item: ``CachedItem`` (one image, clip window or edit pair with its cache
keys) and ``SampleItems`` (the sample prompts and their negatives, encoded with the captions)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class CachedItem:
    image: str
    caption: str
    bucket: tuple[int, int]  # (width, height) in pixels
    text_key: str
    latent_key: str
    # A video dataset's window: the clip's source frame indices (presentation order); empty for an image
    # dataset. Batches must group by (bucket, len(frames)), the frame count being the second bucket axis.
    frames: list[int] = field(default_factory=list)
    # An edit dataset's control images (in the model's order) and their (width, height) at the reference area;
    # empty otherwise. Their latents live in the text entry; batches group by control_sizes too.
    controls: list[str] = field(default_factory=list)
    control_sizes: list[list[int]] = field(default_factory=list)
    # Masked loss: the key of the image's mask entry (masks/<key>.safetensors, engine/data/masks.py); "" = none.
    mask_key: str = ""
    # Tag shuffle: the text keys of the caption's other cached orders (engine/data/captions.py); training picks one
    # of text_key and these at random. Empty: the caption as written only.
    text_variants: list[str] = field(default_factory=list)

    def batch_key(self) -> tuple:
        """Items of one key stack into one batch: the bucket, the frame count, the control latents' shapes."""
        return self.bucket, len(self.frames), tuple(tuple(s) for s in self.control_sizes)


@dataclass
class SampleItems:
    """The sample prompts' text entries (``prompts``), and what each is guided against: one empty prompt shared by
    all (``shared_negative``: a family sampled with classifier-free guidance) or one negative per prompt
    (``negatives``: an edit model's, each with its prompt's control images); neither for a family without CFG."""

    prompts: list[CachedItem] = field(default_factory=list)
    shared_negative: Optional[CachedItem] = None
    negatives: list[CachedItem] = field(default_factory=list)


def text_item(caption: str, text_key: str) -> CachedItem:
    """A text-only entry (a sample prompt, the empty prompt): no image, no latent."""
    return CachedItem(image="", caption=caption, bucket=(0, 0), text_key=text_key, latent_key="")
