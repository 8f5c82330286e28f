"""Masked loss on clips: a mask clip per clip, one mask frame per frame, cropped like the frames, cached per window and
brought to the latent grid by area in space and the VAE's causal grouping in time; wrong frame counts are named."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from lowvram_lora.engine.caching import DatasetCache, entries
from lowvram_lora.engine.caching.keys import CacheKeys
from lowvram_lora.engine.caching.records import ClipSource, record_source
from lowvram_lora.engine.callbacks import TrainingCallback
from lowvram_lora.engine.config import DataConfig
from lowvram_lora.engine.data import VideoConfig, make_buckets
from lowvram_lora.engine.data.clip_masks import latent_clip_mask
from lowvram_lora.engine.data.options import DatasetOptions
from lowvram_lora.engine.errors import ConfigError, DatasetError
from lowvram_lora.engine.train.flow_matching import mask_weights, weighted_mse

av = pytest.importorskip("av")

S = 64


def _write_mp4(path: Path, frames) -> None:
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264rgb", rate=16, options={"crf": "0", "qp": "0"})  # lossless
        s.width, s.height, s.pix_fmt = S, S, "rgb24"
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def _mask_frames(n: int) -> list[np.ndarray]:
    """Frame k: white in the first 6 k + 4 columns, black elsewhere (each frame its own mask)."""
    out = []
    for k in range(n):
        a = np.zeros((S, S, 3), dtype=np.uint8)
        a[:, : 6 * k + 4] = 255
        out.append(a)
    return out


def _clip(folder: Path, name: str, n: int, mask_frames: int | None = None, still: bool = False) -> None:
    rng = np.random.default_rng(len(name))
    _write_mp4(folder / f"{name}.mp4", [rng.integers(0, 256, (S, S, 3), dtype=np.uint8) for _ in range(n)])
    (folder / f"{name}.txt").write_text(f"{name} moves")
    if still:
        Image.fromarray(_mask_frames(3)[2]).save(folder / f"{name}_mask.png")
    elif mask_frames:
        _write_mp4(folder / f"{name}_mask.mp4", _mask_frames(mask_frames))


def _source(data: Path, **options) -> ClipSource:
    cfg = DataConfig(path=str(data), resolution=S, bucket_step=16)
    return ClipSource(None, cfg, VideoConfig(frame_counts=(5,), fps=16, window="uniform", windows_per_clip=2),
                      DatasetOptions(mask_source="beside", **options))


def test_the_temporal_rule_is_the_vaes_grouping_and_the_area_in_space():
    g = torch.Generator().manual_seed(0)
    mask = torch.randint(0, 256, (1, 9, 16, 16), generator=g, dtype=torch.uint8)
    got = latent_clip_mask(mask, (3, 2, 2))
    m = mask.double().numpy()[0] / 255.0
    cells = m.reshape(9, 2, 8, 2, 8).mean(axis=(2, 4))  # (9, 2, 2): area over each 8x8 latent cell
    want = np.stack([cells[0], cells[1:5].mean(0), cells[5:9].mean(0)])  # frame 0 alone, then groups of 4
    np.testing.assert_allclose(got[0].numpy(), want, rtol=1e-6)
    still = latent_clip_mask(mask[:, :1], (3, 2, 2))
    np.testing.assert_allclose(still[0].numpy(), np.stack([cells[0]] * 3), rtol=1e-6)
    with pytest.raises(DatasetError, match="a clip mask of 8 frames does not fit 3 latent frames"):
        latent_clip_mask(mask[:, :8], (3, 2, 2))
    # the loss weights each latent frame by its own mask: a hand-computed masked MSE
    pred, target = torch.randn(1, 4, 3, 2, 2, generator=g), torch.randn(1, 4, 3, 2, 2, generator=g)
    w = mask_weights(mask, (3, 2, 2), 0.25)
    hand = ((pred - target) ** 2 * (0.25 + 0.75 * torch.from_numpy(want).float())[None, None]).mean()
    torch.testing.assert_close(weighted_mse(pred, target, w), hand)


def test_mask_clips_are_cached_per_window_frame_by_frame(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    _clip(data, "walk", 9, mask_frames=9)
    _clip(data, "run", 5, still=True)
    source = _source(data)
    records = source.scan(print)
    assert sorted({r.path.name for r in records}) == ["run.mp4", "walk.mp4"]  # the mask clips are no training clips
    items = source.items(records, make_buckets(S, 16), CacheKeys("t", "v", 0), True)
    walk = [i for i in items if i.image.endswith("walk.mp4")]
    assert [i.frames for i in walk] == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8]]
    assert len({i.mask_key for i in items}) == 3 and all(i.mask_key for i in items)
    stats: dict = {}
    entries.build_masks(tmp_path / "cache", items, True, "beside", TrainingCallback(), stats)
    assert stats == {"masks_reused": 0, "masks_built": 3}
    frames = _mask_frames(9)
    for item in walk:
        entry = load_file(str(tmp_path / "cache" / "masks" / f"{item.mask_key}.safetensors"))
        want = torch.from_numpy(np.stack([frames[i][..., 0] for i in item.frames]))  # (5, S, S)
        assert torch.equal(entry["mask"], want)
        assert torch.equal(entry["mask_flipped"], want.flip(-1))
    cache = DatasetCache(tmp_path / "cache", tmp_path / "m.json", "h", "wan", "t2v", items, mask_source="beside")
    (run_item,) = [i for i in items if i.image.endswith("run.mp4")]
    still = cache.load_mask(run_item)
    assert still.shape == (5, S, S) and torch.equal(still[0], still[4])  # a still mask: the same on every frame
    masks = torch.stack([cache.load_mask(walk[0]), still])  # one batch of two windows: (B, F, H, W)
    assert mask_weights(masks, (2, S // 8, S // 8), 0.0).shape == (2, 2, S // 8, S // 8)


def test_missing_and_wrong_frame_count_masks_are_named(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    _clip(data, "walk", 9, mask_frames=8)
    _clip(data, "jump", 5)
    _clip(data, "run", 5, mask_frames=5)
    with pytest.raises(DatasetError, match=r"2 clip\(s\) have no usable mask: jump.mp4: no mask \('jump_mask.mp4'.*"
                                           r"walk.mp4: its mask walk_mask.mp4 has 8 frames, the clip 9"):
        _source(data).scan(print)
    said = []
    kept = _source(data, missing_mask="skip").scan(said.append)
    assert {r.path.name for r in kept} == {"run.mp4"}
    assert any("skipping walk.mp4: its mask walk_mask.mp4 has 8 frames" in s for s in said)
    models = SimpleNamespace(family=SimpleNamespace(display_name="Wan", control_images=lambda variant: None),
                             variant="t2v", specs=[])
    with pytest.raises(ConfigError, match="mask_source='alpha' reads an image's alpha channel; clips carry"):
        record_source(models, DataConfig(path=str(data)), VideoConfig(), (), DatasetOptions(mask_source="alpha"))



def test_a_masked_wan_window_trains_through_the_loop(tmp_path):
    """The training loop on the tiny Wan transformer over a cache of one 5-frame window (random latent and text, as
    the cache holds them): an all-white mask clip trains as no mask, an all-black one gives no loss at all."""
    from safetensors.torch import save_file

    from lowvram_lora.engine.caching import CachedItem
    from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.families import default_max_sequence_length, get_family
    from lowvram_lora.engine.families.tiny import tiny_transformer
    from lowvram_lora.engine.train import train_lora

    family = get_family("wan")
    model = tiny_transformer(family)
    variant = family.variant_for_config(dict(model.config))
    g = torch.Generator().manual_seed(0)
    for sub in ("latents", "text", "masks"):
        (tmp_path / sub).mkdir()
    save_file({"latent": torch.randn(family.latent_shape(model, 64, 48, frames=5), generator=g)},
              str(tmp_path / "latents" / "lat.safetensors"))
    widths, length = family.text_widths(dict(model.config)), default_max_sequence_length(family, variant)
    save_file({s.cache_key: torch.randn(length, widths[s.cache_key], generator=g)
               for s in family.text_encoder_specs(variant)}, str(tmp_path / "text" / "txt.safetensors"))

    def run(value):
        save_file({"mask": torch.full((5, 48, 64), value, dtype=torch.uint8)},
                  str(tmp_path / "masks" / f"m{value}.safetensors"))
        item = CachedItem("clip.mp4", "a clip", (64, 48), "txt", "lat", frames=list(range(5)), mask_key=f"m{value}")
        cache = DatasetCache(tmp_path, tmp_path / "m.json", f"h{value}", "wan", variant, [item],
                             mask_source="beside")
        return train_lora(ModelConfig(family="wan"), cache, LoraSettings(rank=4),
                          TrainConfig(steps=2, learning_rate=1e-2, seed=5, device="cpu"),
                          preloaded=(model, family, variant)).loss_history

    white, black = run(255), run(0)
    assert white[0] > 0 and black == [0.0, 0.0]
