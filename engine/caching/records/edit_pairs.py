"""Record source: an edit model's pairs (Qwen-Image-Edit, Flux.2, Kontext; ``data.pairs.scan_pairs``): each target image with its
instruction and control images. The target's latent is cached as an image's; the text entry holds the multimodal
prompt and the control latents (``edit_cache.py``). With masked loss (``DatasetOptions.mask_source``) the TARGET's
mask weighs the loss, found and checked as an image dataset's (``images.with_masks``: a missing or wrong-size mask is
a named error or a named skip of the pair); the control images are never masked: the loss covers the target's tokens
only, and a reference is the model's input, not something it predicts."""
from __future__ import annotations

from typing import Sequence

from ...data.options import DatasetOptions
from ...errors import ConfigError
from .. import edit_cache
from ..entries import atomic_save, usable
from ..items import CachedItem, SampleItems
from .images import ImageSource, with_masks


class EditPairSource:
    label = "images"

    def __init__(self, models, data_cfg, control_dirs: Sequence, options: DatasetOptions | None = None):
        family, variant = models.family, models.variant
        if data_cfg.flip:  # a flipped target with unflipped controls would teach the LoRA to mirror the image
            raise ConfigError(f"flip is not supported for an edit model ({family.display_name} {variant}): the "
                              f"target would be mirrored but not its control images; turn flip off")
        self.models, self.data_cfg, self.control_dirs = models, data_cfg, control_dirs
        self.options = options or DatasetOptions()
        self.targets = ImageSource(models, data_cfg, self.options)  # the targets' latents (and masks)

    def scan(self, log):
        from ...data.pairs import scan_pairs

        max_controls = self.models.family.control_images(self.models.variant).max_count
        pairs = scan_pairs(self.data_cfg, self.control_dirs, max_controls=max_controls, log=log)
        source = self.options.mask_source
        if source == "none":
            return pairs
        return with_masks(pairs, source, self.options.missing_mask, log, image_of=lambda p: p.target,
                          what="target image")

    def items(self, records, buckets, keys, flip):
        targets = self.targets.items([p.target for p in records], buckets, keys, flip)
        return edit_cache.attach_controls(targets, records, keys.text, keys.vae, self.models.family,
                                          self.models.variant)

    def samples(self, prompts, records, keys) -> SampleItems:
        family, variant = self.models.family, self.models.variant
        made, negatives = edit_cache.sample_items(prompts, records, keys.text, keys.vae, family, variant, CachedItem)
        return SampleItems(made, negatives=negatives if family.guidance(variant).mode == "cfg" else [])

    def build_text(self, cache_dir, models, keys, items, samples, cb, stats) -> None:
        vae_loader = models.load_vae
        if models.family.control_images(models.variant).encode_prompts is None:  # references outside the prompt
            edit_cache.build_reference_entries(cache_dir, models, keys, items + samples.prompts + samples.negatives,
                                               cb, stats)
            return
        edit_cache.build_edit_entries(cache_dir, models.family, models.variant, models.specs[0], models.pipeline,
                                      models.singles, items + samples.prompts + samples.negatives, models.device,
                                      models.dtype, vae_loader, atomic_save, usable, cb, stats)
