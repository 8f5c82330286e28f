"""Continue from an existing LoRA file: the freshly attached adapter takes the file's weights, or the run is refused
with the reason (``LoraMismatchError``) before any step.

The file is read by ``engine/lora_io`` (ours of any type; LoRAs in kohya / musubi, diffusers / ai-toolkit and
ComfyUI-native names), into folded peft names at scale 1; the run's adapter computes ``alpha/rank * delta``, so the
weights go in with that scale taken back out (``AdapterType.fold`` by rank/alpha). Checked, in this order: the family
the file was written for (our metadata), the type, that every module is one of this model's targets and every target
has one, the rank, and each tensor's shape (another model size).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..config import LoraSettings
from ..errors import LoraFormatError, LoraMismatchError
from ..lora_io import load_lora
from ..lora_io.adapters import get_adapter


def continue_file(settings: LoraSettings) -> Path:
    """The file to continue from; refused when it is not a file."""
    path = Path(settings.adapter.continue_from).expanduser()
    if not path.is_file():
        raise LoraMismatchError(f"continue_from='{path}' is not a file; give the path of a .safetensors LoRA")
    return path


def load_into(model: nn.Module, family, settings: LoraSettings, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Check the file against the attached adapter (``state``: its current peft state) and return the peft state to
    load: the file's weights divided by the run's scale."""
    path = continue_file(settings)
    try:
        loaded = load_lora(path)
    except LoraFormatError as exc:
        raise LoraMismatchError(f"cannot continue from '{path}': {exc}") from exc
    adapter = get_adapter(settings.adapter.type)
    written_for = loaded.metadata.get("lowvram_lora.family")
    if written_for and written_for != family.id:
        raise LoraMismatchError(f"'{path}' is a LoRA for {written_for}, this model is {family.id}; continue from a "
                                f"file trained on this family")
    if loaded.adapter != adapter.name:
        raise LoraMismatchError(f"'{path}' holds a {loaded.adapter} adapter and this run trains {adapter.name}; "
                                f"choose type {loaded.adapter} to continue it (an adapter cannot change its type)")
    theirs, ours = adapter.modules(loaded.state_dict), adapter.modules(state)
    unknown = sorted(set(theirs) - set(ours))
    if unknown:
        raise LoraMismatchError(f"'{path}' has a module '{unknown[0]}' that is not one of this run's targets "
                                f"({len(unknown)} in all): a file for another family or model, or other targets")
    missing = sorted(set(ours) - set(theirs))
    if missing:
        raise LoraMismatchError(f"'{path}' has no weights for the target '{missing[0]}' ({len(missing)} of "
                                f"{len(ours)} targets): it was trained on other modules")
    some = next(iter(theirs))
    if adapter.rank_of(theirs[some]) != adapter.rank_of(ours[some]):
        raise LoraMismatchError(f"'{path}' has rank {adapter.rank_of(theirs[some])} and this run rank "
                                f"{adapter.rank_of(ours[some])}; set rank={adapter.rank_of(theirs[some])} to continue it")
    if adapter.name == "dora" and not any(k.endswith(".lora_magnitude_vector") for k in loaded.state_dict):
        raise LoraMismatchError(f"'{path}' is a DoRA in ComfyUI's form (dora_scale); continue a DoRA from its "
                                f"diffusers-format file, which holds peft's magnitude")
    scale = settings.alpha / settings.rank
    out = {}
    for module, ms in theirs.items():
        for key, value in adapter.fold({k: v for k, v in ms.items() if k in adapter.diffusers(ms)}, 1 / scale).items():
            want = ours[module][key].shape
            if value.shape != want:
                raise LoraMismatchError(f"'{path}': '{module}.{key}' has shape {tuple(value.shape)}, this model's "
                                        f"{tuple(want)}: a file for another model size")
            out[f"{module}.{key}"] = value
    return out
