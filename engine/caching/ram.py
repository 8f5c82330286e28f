"""The caching pass's host RAM: what Cache Text Embeds holds while it encodes, checked before any model loads.

The pass runs its models one after the other, each freed before the next (``entries.build_text``, then
``build_latents``), so its peak is the process beside the largest of them as it sits in host memory:

* a text encoder read whole (T5-XXL, CLIP, umT5: ``from_pretrained`` or a single file converted to the cache's dtype):
  its elements at that dtype, whatever the file stores (an fp8 file is converted on load);
* a decoder LLM (Mistral, Qwen, Gemma: ``TextEncoderKind.host_loads_whole`` False) runs layer-major from the file's
  memory map: one layer at the dtype (the map's pages are clean page cache the kernel may drop);
* the VAE, on the CPU at the dtype.

Sizes come from the safetensors headers (no tensor is read). Activations between an encoder's layers (a group of
captions) and the tokenizer are small beside these and sit in the process figure (``PROCESS_BASE_BYTES``, measured).
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Optional

from ..callbacks import TrainingCallback
from ..checkpoint.files import SafetensorsFile
from ..errors import ConfigError
from ..offload.hostmem import resolve_ram_budget
from ..offload.plan import GB, PROCESS_BASE_BYTES
from .encoders import encoder_kind
from .model_sources import CacheModels

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _files(path: Optional[Path]) -> list[Path]:
    if path is None:
        return []
    return sorted(path.glob("*.safetensors")) if path.is_dir() else [path] if path.exists() else []


def _elements(files: list[Path], per_layer: bool, only=None) -> int:
    """Tensor elements of ``files``: all of them, or (``per_layer``) the largest ``layers.<n>.`` group's; ``only``:
    just the tensors it accepts (a name -> bool)."""
    groups: dict[str, int] = {}
    for f in files:
        for name, e in SafetensorsFile(f).entries.items():
            if only is not None and not only(name):
                continue
            m = _LAYER.search(name) if per_layer else None
            key = m.group(1) if m else ("" if not per_layer else "other")
            groups[key] = groups.get(key, 0) + math.prod(e.shape)
    if not per_layer:
        return sum(groups.values())
    return max((v for k, v in groups.items() if k != "other"), default=groups.get("other", 0))


def caching_host_bytes(models: CacheModels) -> dict[str, int]:
    """Host bytes of each model the pass holds (by name: "text_encoder (T5-XXL)", "vae"), at the cache's dtype."""
    itemsize = models.dtype.itemsize
    parts = {}
    for spec in models.specs:
        kind = encoder_kind(spec.kind)
        path = (models.singles.text_encoders.get(spec.subfolder) if models.singles is not None
                else models.pipeline / spec.subfolder)
        whole = kind.host_loads_whole
        companions = sum(_elements(_files(models.pipeline / name), per_layer=False)
                         for name in kind.companion_folders(spec)) if models.pipeline is not None else 0
        ckpt = models.singles.checkpoint if models.singles is not None else None
        if ckpt is not None:  # what an all-in-one checkpoint holds for the encoder (LTX-2.3's connectors)
            held = set(kind.checkpoint_companions(spec, list(SafetensorsFile(ckpt).entries)))
            companions += _elements([ckpt], per_layer=False, only=held.__contains__) if held else 0
        parts[f"{spec.subfolder} ({kind.display_name}{'' if whole else ', one layer at a time'})"] = (
            (_elements(_files(path), per_layer=not whole) + companions) * itemsize)
    vae = models.singles.vae if models.singles is not None else models.pipeline / "vae"
    bundled = models.singles is not None and vae == models.singles.checkpoint  # only its VAE's tensors
    prefix = models.family.vae_for(models.variant).checkpoint_prefix
    parts["vae"] = _elements(_files(vae), per_layer=False,
                             only=(lambda n: n.startswith(prefix)) if bundled else None) * itemsize
    return parts


def check_caching_ram(models: CacheModels, cb: Optional[TrainingCallback] = None,
                      ram_budget_gb: float = 0.0) -> int:
    """The pass's predicted host peak (the process and its largest model), logged; raises ConfigError naming the
    need and the fixes when it exceeds the RAM budget (``ram_budget_gb``; 0: auto, 85% of what is free now)."""
    parts = caching_host_bytes(models)
    largest = max(parts, key=parts.get)
    peak = PROCESS_BASE_BYTES + parts[largest]
    budget = resolve_ram_budget(ram_budget_gb)
    shown = ", ".join(f"{k} {v / GB:.2f}" for k, v in parts.items())
    if cb is not None:
        cb.log(f"caching: predicted host RAM peak {peak / GB:.1f} GB of a {budget.bytes / GB:.1f} GB RAM budget "
               f"(process {PROCESS_BASE_BYTES / GB:.1f} + the largest model, one at a time: {shown} GB)")
    if peak > budget.bytes:
        need = math.ceil(peak / GB * 10) / 10
        raise ConfigError(
            f"caching needs {need:.1f} GB of host RAM ({largest}: {parts[largest] / GB:.1f} GB at "
            f"{str(models.dtype).removeprefix('torch.')}, beside the process) but the RAM budget is "
            f"{budget.bytes / GB:.1f} GB ({budget.describe()}). Free host RAM (close other programs) and run it again; "
            f"the cache is kept and reused, so it can also be built once on a machine with more RAM and copied")
    return peak
