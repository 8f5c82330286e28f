"""Random checkpoints of any size, written tensor by tensor (for tests and build benchmarks).

    write_random_checkpoint("flux1-dev.safetensors", "flux1", "flux1-dev")              # BFL single file
    write_random_checkpoint("mid/", "flux1", config=cfg, layout="diffusers", shard_bytes=1 << 30)

Gaussian weights (std 0.02), one tensor alive at a time: a full-size Flux.1-dev
file is written in a few GB of RAM.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from ..families import get_family
from .format import SafetensorsWriter, plan_layout
from .layout import meta_model


def _seed(name: str, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0, std: float = 0.02) -> torch.Tensor:
    """Deterministic per (seed, name): the same tensor whatever the file layout."""
    g = torch.Generator().manual_seed(_seed(name, seed))
    return (torch.randn(shape, generator=g) * std).to(dtype)


def write_random_checkpoint(
    out: str | Path, family_id: str = "flux1", variant: str | None = None, config: dict[str, Any] | None = None,
    layout: str = "bfl", dtype: torch.dtype = torch.bfloat16, seed: int = 0, shard_bytes: int = 5 << 30,
    prefix: str = "",
) -> Path:
    """A random checkpoint: ``layout="bfl"`` writes one BFL-named file at ``out``;
    ``layout="diffusers"`` writes a transformer folder (config.json + shards + index)."""
    family = get_family(family_id)
    if config is None:
        config = family.load_config(variant or next(iter(family.variants)))
    model = meta_model(family, config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()}
    out = Path(out)
    if layout == "bfl":
        table = family.param_table(config)
        entries = []
        for param in table:
            parts = [shapes[p.name] for p in param.parts]
            shape = (math.prod(parts[0]),) if param.flat else (sum(s[0] for s in parts),) + parts[0][1:]
            entries.append((prefix + param.name, dtype, shape))
        out.parent.mkdir(parents=True, exist_ok=True)
        _write(out, entries, seed, {"format": "pt"})
        return out
    if layout != "diffusers":
        raise ValueError(f"layout={layout!r} is not one of bfl, diffusers")
    out.mkdir(parents=True, exist_ok=True)
    shards, current, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, dtype, shape))
        size += nbytes
    shards.append(current)
    weight_map = {}
    for i, entries in enumerate(shards):
        fname = ("diffusion_pytorch_model.safetensors" if len(shards) == 1
                 else f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        _write(out / fname, entries, seed, {"format": "pt"})
        weight_map.update({name: fname for name, _, _ in entries})
    if len(shards) > 1:
        (out / "diffusion_pytorch_model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    cfg = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    cfg["_class_name"] = family.diffusers_class_name
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def _write(path: Path, entries, seed: int, metadata: dict[str, str]) -> None:
    header, planned = plan_layout(entries, metadata, align=1)  # a plain checkpoint: no padding tensors
    writer = SafetensorsWriter(path, header, planned)
    try:
        for name, dtype, shape in entries:
            writer.write(name, random_tensor(name, shape, dtype, seed))
        writer.finish()
    finally:
        writer.close()
