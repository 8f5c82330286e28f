"""Dataset Options: what the cache build does beyond images and captions (masks, a held-out validation split).

Torch-free, so the node and the CLI can build it cheaply. Each field carries its help text once; the
"Dataset Options" node's tooltips read it (``config.field_help``). Only what changes cached data is here: a
control that only changes training (the unmasked area's weight, how often validation runs) is a Train LoRA
option (``engine/train/loss_options.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import ConfigError

#: Where a training image's loss mask comes from (``engine/data/masks.py``).
MASK_SOURCES = ("none", "beside", "folder", "alpha")
#: What to do with an image whose mask is missing or of another size.
MISSING_MASK = ("error", "skip")


@dataclass
class DatasetOptions:
    """Optional controls of the dataset cache (the "Dataset Options" node)."""

    mask_source: str = field(default="none", metadata={"help": (
        "Masked loss: where each image's mask comes from. none: no mask (every pixel trains). beside: "
        "'<name>_mask.png' next to '<name>.png'. folder: 'masks/<name>.png' inside the dataset folder. alpha: the "
        "image's own alpha channel. White (opaque) trains, black (transparent) does not; grey is a weight. The mask "
        "is cropped like its image and averaged over each latent cell (area resize, as sd-scripts). Clips (video "
        "datasets): a mask clip '<name>_mask.mp4' (or a '<name>_mask/' frames folder; 'masks/<name>.mp4' for folder) "
        "with one frame per clip frame, or a still '<name>_mask.png' for every frame; each latent frame weighs the mean "
        "of the mask frames it encodes (alpha is for images only). Edit pairs: the target's mask; the control "
        "images are never masked."
    )})
    missing_mask: str = field(default="error", metadata={"help": (
        "An image without a mask (or with one of another size than the image): error stops with the list of "
        "such images; skip leaves them out of training and names them in the log. Never a silent full mask."
    )})
    validation_fraction: float = field(default=0.0, metadata={"help": (
        "Hold this fraction of the images out of training as a validation split (0: none). Which images is fixed "
        "by their file names (not the seed), so the split stays the same run to run."
    )})
    validation_folder: str = field(default="", metadata={"help": (
        "A folder of captioned images used only for validation (instead of validation_fraction). Empty: none."
    )})

    reg_folder: str = field(default="", metadata={"help": (
        "Regularization (prior preservation): a folder of captioned images of the subject's class (e.g. other "
        "dogs), with their own .txt captions (no trigger word is added). Train LoRA mixes them in by reg_ratio, "
        "their loss weighted by prior_loss_weight (Loss & Validation Options). Empty: none."
    )})
    resolutions: tuple = field(default=(), metadata={"help": (
        "Multi-resolution training: more sizes (pixels, the side of the square area) each training image is also "
        "cached at, beside Cache Text Embeds' resolution, each into its own aspect buckets: '512, 768' with "
        "resolution 1024 trains every image at all three. A batch holds one size; the memory plan is made for the "
        "largest. Validation and regularization images stay at the resolution. Empty: one size."
    )})
    preservation_prompt: str = field(default="", metadata={"help": (
        "Differential output preservation: the class prompt (e.g. 'a photo of a woman' for a LoRA of one woman), "
        "encoded into the cache with the captions. Loss & Validation Options' preservation_weight turns it on: the "
        "base model's answer on this prompt is the target for the adapter's. Empty: none."
    )})
    caption_dropout: float = field(default=0.0, metadata={"help": (
        "Train this fraction of steps' images on the empty caption instead of their own (0: never; 0.05-0.1 is "
        "common), so the LoRA also works without its words. The empty caption is encoded once into the cache."
    )})
    shuffle_tags: bool = field(default=False, metadata={"help": (
        "Shuffle the comma-separated tags of each caption (after the first keep_tags). Text encoders run only "
        "while caching, so the cache holds caption_variants orders of each caption and each step picks one."
    )})
    keep_tags: int = field(default=1, metadata={"help": (
        "With shuffle_tags: how many leading tags stay in place. The trigger word is the first tag, so 1 keeps it "
        "in front."
    )})
    caption_variants: int = field(default=4, metadata={"help": (
        "With shuffle_tags: how many orders of each caption are cached (the caption as written and the rest "
        "shuffled). Each costs one caption's text encoding and cache entry; a rebuild encodes only new ones."
    )})

    def __post_init__(self) -> None:
        if self.mask_source not in MASK_SOURCES:
            raise ConfigError(f"mask_source={self.mask_source!r} is not one of {', '.join(MASK_SOURCES)}")
        if self.missing_mask not in MISSING_MASK:
            raise ConfigError(f"missing_mask={self.missing_mask!r} is not one of {', '.join(MISSING_MASK)}")
        v = self.validation_fraction
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0.0 <= v < 1.0:
            raise ConfigError(f"validation_fraction={v!r} must be a number in [0, 1); 0.1 holds out a tenth")
        d = self.caption_dropout
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d) or not 0.0 <= d < 1.0:
            raise ConfigError(f"caption_dropout={d!r} must be a number in [0, 1)")
        if self.keep_tags < 0:
            raise ConfigError(f"keep_tags={self.keep_tags} must be >= 0")
        if not 2 <= self.caption_variants <= 64:
            raise ConfigError(f"caption_variants={self.caption_variants} must be between 2 and 64 (the caption as "
                              f"written and at least one shuffle)")
        self.resolutions = tuple(self.resolutions)
        for size in self.resolutions:
            if isinstance(size, bool) or not isinstance(size, int) or size < 64 or size % 16:
                raise ConfigError(f"resolutions: {size!r} must be a whole number of pixels >= 64 and a multiple of 16 "
                                  f"(e.g. '512, 768')")
        if v > 0 and self.validation_folder.strip():
            raise ConfigError("set validation_fraction or validation_folder, not both: the split comes from one of "
                              "them")

    @property
    def masked(self) -> bool:
        return self.mask_source != "none"

    @property
    def captions_vary(self) -> bool:
        return self.shuffle_tags or self.caption_dropout > 0

    @property
    def validates(self) -> bool:
        return self.validation_fraction > 0 or bool(self.validation_folder.strip())


def parse_resolutions(text: str) -> tuple[int, ...]:
    """'512, 768 1024' -> (512, 768, 1024): sizes separated by commas or spaces; a token that is not a whole number
    is named."""
    sizes = []
    for token in text.replace(",", " ").split():
        try:
            sizes.append(int(token))
        except ValueError:
            raise ConfigError(f"resolutions: {token!r} is not a whole number of pixels; write sizes like '512, 768'") \
                from None
    return tuple(sizes)
