"""Attach a peft adapter (LoRA, LoHa, LoKr or DoRA: engine/lora_io/adapters/) to a frozen transformer and read it
back out."""
from __future__ import annotations

import torch
from torch import nn

from ..config import LoraSettings
from ..families import ModelFamily
from ..lora_io.adapters import get_adapter

ADAPTER = "default"


def attach_lora(model: nn.Module, family: ModelFamily, settings: LoraSettings, seed: int) -> list[nn.Parameter]:
    """Inject the adapter ``settings.adapter.type`` (via peft, through diffusers' add_adapter) and return the
    trainable parameters, kept in fp32: bf16 adapter weights lose small updates."""
    targets = settings.target_modules or family.lora.target_modules(model)
    adapter = get_adapter(settings.adapter.type)
    adapter.check_targets(family, {k: v for k, v in dict(model.config).items() if not k.startswith("_")}, targets)
    config = adapter.peft_config(settings, targets)
    # Adapter weights are random-initialised from the global RNG: seed it without disturbing the caller's.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.add_adapter(config, adapter_name=ADAPTER)
    if settings.adapter.continue_from:  # the file's weights instead of the fresh init (continue_from.py)
        from peft.utils import set_peft_model_state_dict

        from .continue_from import load_into

        try:
            state = load_into(model, family, settings, lora_state_dict(model))
            set_peft_model_state_dict(model, state, adapter_name=ADAPTER)
        except BaseException:
            detach_lora(model)
            raise
    params = []
    for _, p in adapter_parameters(model):
        p.data = p.data.float()
        params.append(p)
    return params


def adapter_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every trainable adapter weight, in ``named_parameters`` order: peft leaves only these
    with ``requires_grad`` (the base model is frozen)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    tuner = {id(p) for m in model.modules() if isinstance(m, BaseTunerLayer)
             for n, p in m.named_parameters() if not n.startswith("base_layer.")}
    return [(n, p) for n, p in model.named_parameters() if id(p) in tuner and p.requires_grad]


def lora_state_dict(model: nn.Module, settings: LoraSettings | None = None) -> dict[str, torch.Tensor]:
    """Adapter weights with peft/diffusers module names (``...to_q.lora_A.weight``, ``...to_q.hada_w1_a``), fp32
    on CPU, plus what the type's saved file needs beyond them (``AdapterType.export``: DoRA's dora_scale)."""
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=ADAPTER)
    state = {k: v.detach().float().cpu().clone() for k, v in state.items()}
    if settings is not None:
        state = get_adapter(settings.adapter.type).export(model, state, settings.alpha / settings.rank)
    return state


def detach_lora(model: nn.Module) -> None:
    """Put the original Linear layers back (peft has no public unload for models it was
    injected into through diffusers' add_adapter), so a preloaded base can train again."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.get_base_layer())
    if hasattr(model, "peft_config"):
        del model.peft_config
    model._hf_peft_config_loaded = False


def skip_lora_input_cast(model: nn.Module) -> None:
    """Under autocast, peft's cast of each LoRA input to the fp32 LoRA dtype is undone by
    autocast right away: a copy of every LoRA layer's input for nothing. Measured on the
    H100 at 1024x1024: 0.968 -> 0.939 s/step, 0.4 GB less peak (bitwise-identical
    results). Only valid when the forward runs under autocast."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer) and hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = False
