"""Measure what the planner needs: block sizes, the rest of the model, LoRA size, tokens.

From a loaded model, or, before loading anything, from the checkpoint's config on
the meta device (so an impossible budget is refused in a second, not after minutes
of reading 24 GB).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..config import LoraSettings
from ..families import default_max_sequence_length
from .host import STEP_CONSTANT, frozen_bytes, step_constant_tensors
from .plan import ModelFootprint, Workload


def named_blocks(model: nn.Module, family) -> list[tuple[str, nn.Module]]:
    """The family's transformer blocks, flattened in execution order, with their module names."""
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for blocks in family.memory.block_lists_of(model):
        prefix = names[id(blocks)]
        out += [(f"{prefix}.{i}", b) for i, b in enumerate(blocks)]
    return out


def measure_footprint(model: nn.Module, family, name: str = "",
                      trainable_params: Optional[int] = None) -> ModelFootprint:
    """Sizes as they are now: frozen tensors of each block and of the rest; trainable = LoRA."""
    blocks = named_blocks(model, family)
    block_bytes = [frozen_bytes(b) for _, b in blocks]
    # The modulation window's weights (``STEP_CONSTANT``) are neither a block's nor on the GPU: the window holds them
    # on the host and brings one module in for its call (engine/train/step_window.py; ``host_extra`` counts them).
    in_blocks = step_constant_tensors(model) | {id(t) for _, b in blocks
                                                for t in list(b.parameters()) + list(b.buffers())}
    other = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())
                if id(t) not in in_blocks and not t.requires_grad)
    if trainable_params is None:
        trainable_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    from ..slab.source import slab_source_of
    from .units import unit_bytes

    return ModelFootprint(
        name=name or type(model).__name__, block_names=[n for n, _ in blocks], block_bytes=block_bytes,
        other_bytes=other, trainable_params=trainable_params, hidden_size=family.memory.hidden_size(dict(model.config)),
        unit_bytes=[unit_bytes(family, b, frozen_bytes) for _, b in blocks],
        activation_scale=family.memory.activation_scale, parts_activation_scale=family.memory.parts_activation_scale,
        chunked_activation_scale=family.memory.chunked_activation_scale,
        compiled_activation_scale=family.memory.compiled_activation_scale,
        parts_chunked=family.memory.parts_chunked,
        chunkable=family.memory.chunked_recompute, block_params=[frozen_elements(b) for _, b in blocks],
        block_token_params=[linear_params_by_tokens(family, n, b) for n, b in blocks],
        block_attention_tokens=[family.memory.block_tokens(n) for n, _ in blocks],
        outer_bytes=sum(frozen_bytes(m) for _, m in outer_modules(model, family)),
        # Loaded from an int8 slab (engine/slab/source.py records it): its int8 weights are the file map's pages, and
        # its blocks can be read from the file (the disk tier).
        file_backed=slab_source_of(model) is not None, disk_capable=slab_source_of(model) is not None,
        widest_features=max((widest_token_linear(family, n, b) for n, b in blocks), default=0),
        fragmentation=family.memory.fragmentation, parts_fragmentation=family.memory.parts_fragmentation,
        token_modulation=family.memory.token_modulation(dict(model.config)),
    )


def outer_modules(model: nn.Module, family) -> list[tuple[str, nn.Module]]:
    """The large layers outside the blocks (the family's ``int8_extra_linears``, those the model has) with no
    trainable tensor: what ``outer_on_host`` may hold in host memory (engine/offload/outer.py)."""
    named = dict(model.named_modules())
    return [(n, named[n]) for n in family.memory.int8_extra_linears
            if n in named and not any(p.requires_grad for p in named[n].parameters())
            and not named[n].__dict__.get(STEP_CONSTANT)]  # the modulation window holds those


def linear_params_by_tokens(family, block_name: str, block: nn.Module) -> dict[str, int]:
    """The block's frozen Linear weights (in x out, whatever their storage: bf16, int8 slab layers, under a peft
    LoRA wrapper) summed by the rows they multiply (``family.memory.linear_tokens``)."""
    out: dict[str, int] = {}
    for name, m in block.named_modules():
        if not isinstance(m, nn.Linear) or any(p.requires_grad for p in m.parameters(recurse=False)):
            continue  # LoRA's own A and B are trainable: not the frozen model's FLOPs
        name = name.removesuffix(".base_layer")  # peft keeps the frozen Linear as ``<name>.base_layer``
        kind = family.memory.linear_tokens(block_name, name)
        out[kind] = out.get(kind, 0) + m.in_features * m.out_features
    return out


def widest_token_linear(family, block_name: str, block: nn.Module) -> int:
    """The widest frozen Linear of a block (in or out features) whose rows are tokens: its activation is the largest
    tensor the block makes per token (the allocator margin, plan.allocator_margin). The modulation's Linears multiply
    one row per sample (``linear_tokens`` "vector"); the modulation window's are not the block's."""
    widest = 0
    for name, m in block.named_modules():
        if (not isinstance(m, nn.Linear) or any(p.requires_grad for p in m.parameters(recurse=False))
                or m.__dict__.get(STEP_CONSTANT)):
            continue
        if family.memory.linear_tokens(block_name, name.removesuffix(".base_layer")) == "vector":
            continue
        widest = max(widest, m.in_features, m.out_features)
    return widest


def frozen_elements(module: nn.Module) -> int:
    """Elements of a module's frozen tensors (its weights' FLOPs per token are twice this); a packed tensor counts
    the weights it holds (an int4 slab layer's ``weight_int4``: two per byte)."""
    from ..slab.int4_linear import Int4Linear

    per = {id(m.weight_int4): 2 for m in module.modules() if isinstance(m, Int4Linear)}
    return sum(t.numel() * per.get(id(t), 1)
               for t in list(module.parameters()) + list(module.buffers()) if not t.requires_grad)


def lora_param_count(model: nn.Module, family, lora: LoraSettings) -> int:
    """Elements an adapter of ``lora`` adds (its type's ``param_count`` per targeted Linear: rank x (in + out) for
    LoRA) (peft's name matching: the full module name or a dotted suffix of it)."""
    from ..lora_io.adapters import get_adapter

    adapter = get_adapter(lora.adapter.type)
    targets = lora.target_modules or family.lora.target_modules(model)
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            total += adapter.param_count(module.in_features, module.out_features, lora)
    return total


def footprint_before_loading(checkpoint, dtype: torch.dtype, lora: LoraSettings, family_id: str = "auto"):
    """(footprint, family, variant) of a checkpoint from its header and config alone, no weights.
    ``checkpoint``: a ``CheckpointIdentity`` (made once per run) or a path. The model is built on the meta device
    as its kind of checkpoint loads it (a slab: int8 block Linears, 1 byte per weight + fp32 row scales)."""
    from ..checkpoint import CheckpointIdentity, identify

    ident = checkpoint if isinstance(checkpoint, CheckpointIdentity) else identify(checkpoint, family_id)
    family, variant, form = ident.family, ident.variant, ident.form
    model = form.meta_model(ident, dtype)  # frozen, as loaded: only LoRA will train
    trainable = lora_param_count(model, family, lora)  # from the float Linears' shapes, before a slab's swap
    form.as_loaded(model, family, ident)
    note = form.note_for(ident)
    label = f"{family.display_name} ({variant}{', ' + note if note else ''})"
    fp = measure_footprint(model, family, label, trainable_params=trainable)
    fp.file_backed = fp.disk_capable = form.file_backed  # a slab: weights are file pages, blocks readable from it
    return fp, family, variant


def workload_for(dataset, family, variant: str, batch: int) -> Workload:
    """The largest item of a dataset cache as tokens: its bucket's (``family.memory.image_tokens`` per latent frame, times
    the clip's latent frames: ``family.memory.latent_frames``) plus, for an edit model, its control images' (reference
    latents join the image tokens), the text length the cache was built with, and the most audio tokens of an item (a
    joint audio-video model: ``family.memory.audio_tokens``; 0 for the others)."""
    def tokens(it) -> int:
        w, h = it.bucket
        own = family.memory.image_tokens(w, h, variant) * family.memory.latent_frames(len(it.frames))
        return own + sum(family.memory.image_tokens(int(cw), int(ch), variant) for cw, ch in it.control_sizes)

    item = max(dataset.items, key=tokens)
    (w, h), frames, controls = item.bucket, len(item.frames), len(item.control_sizes)
    label = f"{w}x{h}" + (f"x{frames}f" if frames > 1 else "") + (f"+{controls} control" if controls else "")
    references = sum(family.memory.image_tokens(int(cw), int(ch), variant) for cw, ch in item.control_sizes)
    audio = max(family.memory.audio_tokens(family.memory.latent_frames(len(it.frames))) for it in dataset.items)
    # Image-to-video is the cache's choice (it holds the first frames); the model's variant, told by shape, is T2V's.
    held = per_token_timestep(family, variant) or per_token_timestep(family, dataset.variant)
    return Workload(batch=batch, image_tokens=tokens(item),
                    text_tokens=default_max_sequence_length(family, variant), label=label, reference_tokens=references,
                    audio_tokens=audio, timestep_tokens=tokens(item) if held else 0)


def per_token_timestep(family, variant: str) -> bool:
    """The variant gives tokens timesteps of their own: its first-frame condition holds the first frames clean at
    timestep 0 (``FirstFrameCondition.held``), the others at the sample's (``Workload.timestep_tokens``)."""
    condition = family.first_frame(variant) if variant else None
    return bool(condition is not None and condition.held)
