"""Shared test and demo fixtures: a small captioned image dataset, the families' tiny models, and a counter of the
bytes tensors hold (``LiveBytes``).

Each family's tiny pipeline and files are built by its own folder's ``fixtures.py``
(``family_fixtures(get_family(id))``); the names below are the ones the tests and the demo have always used.
Nothing is downloaded.
"""
from __future__ import annotations

import random
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .families.flux1.fixtures import build_tiny_pipeline as build_tiny_flux1_pipeline  # noqa: F401
from .families.flux1.fixtures import write_single_file as write_bfl_single_file  # noqa: F401
from .families.flux1.fixtures import write_text_and_vae_files as write_flux1_single_files  # noqa: F401
from .families.flux2.fixtures import build_tiny_pipeline as build_tiny_flux2_pipeline  # noqa: F401
from .families.flux2.fixtures import tiny_tekken_json, write_comfy_mistral_file  # noqa: F401
from .families.flux2.fixtures import write_single_file as write_flux2_single_file  # noqa: F401
from .families.flux2.fixtures import write_text_and_vae_files as write_flux2_text_and_vae_files  # noqa: F401
from .families.tiny import COLORS, SHAPES


class LiveBytes(TorchDispatchMode):
    """Inside ``with LiveBytes() as mode``: ``peak``, the most bytes of storages the ops made that were alive at once,
    and ``largest``, the largest one (inputs and parameters made outside are not counted; a view's storage counts once,
    until its last tensor is gone). ``device``: only storages on that device type (e.g. ``"meta"`` standing in for the
    GPU in a CPU test). What the memory tests and ``bench/parts_working_set.py`` measure on the CPU, where no allocator
    reports it."""

    def __init__(self, device: str | None = None):
        super().__init__()
        self.device, self.live, self.peak, self.largest, self.seen = device, 0, 0, 0, set()

    def _free(self, key, nbytes):
        self.live -= nbytes
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and (self.device is None or t.device.type == self.device):
                storage = t.untyped_storage()
                key, nbytes = id(storage), storage.nbytes()
                if key not in self.seen and nbytes:
                    self.seen.add(key)
                    self.live += nbytes
                    self.largest = max(self.largest, nbytes)
                    weakref.finalize(storage, self._free, key, nbytes)
        self.peak = max(self.peak, self.live)
        return out


def draw_shape(draw, shape: str, cx: int, cy: int, r: int, fill) -> None:
    """A circle, square or triangle of radius ``r`` centred at (cx, cy) on a PIL ``ImageDraw`` (the synthetic
    datasets' shapes, one drawing for all of them)."""
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)


def build_tiny_pipeline(family_id: str, folder: str | Path, seed: int = 0) -> Path:
    """The tiny pipeline folder of any registered family (its folder's ``fixtures.build_tiny_pipeline``)."""
    from .families import family_fixtures, get_family

    return family_fixtures(get_family(family_id)).build_tiny_pipeline(folder, seed=seed)


def make_tiny_dataset(folder: str | Path, count: int = 6, seed: int = 0, sizes=((128, 128), (160, 112), (112, 160))) -> Path:
    """Synthetic captioned images: a coloured shape on a coloured background, with a
    caption that says so, at a few aspect ratios (exercises the buckets)."""
    from PIL import Image, ImageDraw

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    names = list(COLORS)
    for i in range(count):
        w, h = sizes[i % len(sizes)]
        fg, bg = rng.sample(names, 2)
        shape = SHAPES[i % len(SHAPES)]
        img = Image.new("RGB", (w, h), COLORS[bg])
        draw = ImageDraw.Draw(img)
        r = min(w, h) // 3
        cx, cy = w // 2 + rng.randint(-8, 8), h // 2 + rng.randint(-8, 8)
        draw_shape(draw, shape, cx, cy, r, COLORS[fg])
        img.save(folder / f"img_{i:03d}.png")
        (folder / f"img_{i:03d}.txt").write_text(f"a {fg} {shape} on a {bg} background")
    return folder


def make_tiny_video_dataset(folder: str | Path, count: int = 3, frames: int = 9, size: tuple[int, int] = (64, 48),
                            fps: int = 16, seed: int = 0) -> Path:
    """Synthetic captioned clips next to ``make_tiny_dataset``'s images: a coloured shape moving across a
    coloured background, ``frames`` frames at ``fps``, written as lossless H.264 ``.mp4`` with PyAV, with a
    caption that says what moves where (the demo-sized video dataset of the tests)."""
    import av
    import numpy as np
    from PIL import Image, ImageDraw

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    names = list(COLORS)
    w, h = size
    for i in range(count):
        fg, bg = rng.sample(names, 2)
        shape = SHAPES[i % len(SHAPES)]
        direction = ("right", "left")[i % 2]
        path = folder / f"clip_{i:03d}.mp4"
        with av.open(str(path), "w") as container:
            stream = container.add_stream("libx264", rate=fps, options={"qp": "0", "preset": "ultrafast"})
            stream.width, stream.height, stream.pix_fmt = w, h, "yuv444p"
            r = min(w, h) // 4
            for f in range(frames):
                img = Image.new("RGB", (w, h), COLORS[bg])
                draw = ImageDraw.Draw(img)
                t = f / max(frames - 1, 1)
                cx = int(r + (w - 2 * r) * (t if direction == "right" else 1 - t))
                draw_shape(draw, shape, cx, h // 2, r, COLORS[fg])
                frame = av.VideoFrame.from_ndarray(np.asarray(img), format="rgb24")
                for packet in stream.encode(frame):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        (folder / f"clip_{i:03d}.txt").write_text(f"a {fg} {shape} moving {direction} on a {bg} background")
    return folder
