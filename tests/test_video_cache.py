"""Video latents cached per window: each window of a clip is one cache entry holding the 5-D VAE latent of exactly
its frames, compared with diffusers' tiny AutoencoderKLWan (built from a config) encoding the frames that were
written into the clip. CPU, a few seconds."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from lowvram_lora.engine.caching import cache as cache_mod
from lowvram_lora.engine.caching import entries, open_dataset_cache
from lowvram_lora.engine.caching.keys import CacheKeys
from lowvram_lora.engine.caching.records import ClipSource
from lowvram_lora.engine.callbacks import TrainingCallback
from lowvram_lora.engine.config import DataConfig
from lowvram_lora.engine.data import VideoConfig, make_buckets, scan_video_dataset

av = pytest.importorskip("av")
diffusers = pytest.importorskip("diffusers")

S = 64  # clips at the bucket size: the pixels the VAE sees are exactly the frames written


def _window_items(records, buckets, text_ident: str, vae_ident: str):
    """The clip source's keys phase alone (no model needed: the identities are given)."""
    return ClipSource(None, None, None).items(records, buckets, CacheKeys(text_ident, vae_ident, 0), False)


class _WanNormalised:
    """The Wan latent normalisation the family will declare (diffusers' Wan pipelines:
    ``(z - latents_mean) / latents_std`` per channel), on a 5-D latent."""

    class_name = "AutoencoderKLWan"

    def to_model(self, vae, mean: torch.Tensor) -> torch.Tensor:  # (1, C, F_lat, h, w)
        m = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        s = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        return (mean - m) / s


def _tiny_wan_vae():
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
                                     latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0])
    return vae.eval()


def _frames(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    base = rng.integers(0, 256, (S, S, 3), dtype=np.uint8)
    return [np.roll(base, 3 * k, axis=1) for k in range(n)]


def _write_mp4(path: Path, frames) -> None:
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264rgb", rate=16, options={"crf": "0", "qp": "0"})  # lossless
        s.width, s.height, s.pix_fmt = S, S, "rgb24"
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def _pixels(frames, indices) -> torch.Tensor:
    """The reference input, from the written arrays: (1, 3, F, H, W) in [-1, 1]."""
    a = np.stack([frames[i] for i in indices])  # (F, H, W, 3)
    return torch.from_numpy(a).permute(3, 0, 1, 2)[None].float() / 127.5 - 1


def test_video_latents_are_cached_per_window(tmp_path):
    frames = _frames(7)
    data = tmp_path / "data"
    data.mkdir()
    _write_mp4(data / "walk.mp4", frames)
    Image.fromarray(frames[4]).save(data / "still.png")
    for name in ("walk", "still"):
        (data / f"{name}.txt").write_text(f"{name} caption")
    # (flip's pixels are checked in test_video_data; here it would only double the encodes)
    data_cfg = DataConfig(path=str(data), resolution=64, bucket_step=16)
    video = VideoConfig(frame_counts=(5, 9), fps=16, window="uniform", windows_per_clip=2)

    records = scan_video_dataset(data_cfg, video, log=print)
    items = _window_items(records, make_buckets(64, 16), "text-id", "vae-id")
    assert [(Path(i.image).name, i.bucket, i.frames) for i in items] == [
        ("still.png", (64, 64), [0]), ("walk.mp4", (64, 64), [0, 1, 2, 3, 4]), ("walk.mp4", (64, 64), [2, 3, 4, 5, 6])]
    assert len({i.latent_key for i in items}) == 3  # one entry per window

    vae = _tiny_wan_vae()
    from lowvram_lora.engine.families.wan.vae import WAN21_VAE

    family = SimpleNamespace(vae=WAN21_VAE, vae_for=lambda variant: WAN21_VAE)  # the Wan family's VAE spec
    stats: dict = {}
    entries.build_latents(tmp_path / "cache", family, items, False, torch.device("cpu"), torch.float32,
                          TrainingCallback(), stats, vae_loader=lambda: vae)
    assert stats == {"latents_reused": 0, "latents_built": 3}

    norm = _WanNormalised()
    for item, indices in zip(items, ([4], range(0, 5), range(2, 7))):  # the still is a copy of frame 4
        entry = load_file(str(tmp_path / "cache" / "latents" / f"{item.latent_key}.safetensors"))
        with torch.no_grad():
            want = norm.to_model(vae, vae.encode(_pixels(frames, indices)).latent_dist.mean)[0]
        f_lat = (len(indices) - 1) // 4 + 1  # causal VAE: (F - 1) / 4 + 1 latent frames
        assert entry["latent"].shape == (4, f_lat, S // 8, S // 8)
        torch.testing.assert_close(entry["latent"], want, rtol=1e-4, atol=1e-5)
    a, b = (load_file(str(tmp_path / "cache" / "latents" / f"{i.latent_key}.safetensors"))["latent"] for i in items[1:])
    assert not torch.allclose(a, b)

    stats = {}
    entries.build_latents(tmp_path / "cache", family, items, False, torch.device("cpu"), torch.float32,
                          TrainingCallback(), stats, vae_loader=lambda: vae)
    assert stats == {"latents_reused": 3}


def test_window_keys_follow_frames_and_content(tmp_path):
    frames = _frames(13)
    data = tmp_path / "data"
    data.mkdir()
    _write_mp4(data / "walk.mp4", frames)
    (data / "walk.txt").write_text("walk")
    cfg = DataConfig(path=str(data), resolution=64, bucket_step=16)
    buckets = make_buckets(64, 16)

    def keys(video):
        recs = scan_video_dataset(cfg, video, log=print)
        return [i.latent_key for i in _window_items(recs, buckets, "t", "v")]

    head = keys(VideoConfig(frame_counts=(9,)))
    assert head == keys(VideoConfig(frame_counts=(9,)))  # stable
    assert head[0] in keys(VideoConfig(frame_counts=(9,), window="uniform", windows_per_clip=2))  # same frames
    assert head != keys(VideoConfig(frame_counts=(5,)))  # other frames, other entry
    _write_mp4(data / "walk.mp4", frames[::-1])
    assert head != keys(VideoConfig(frame_counts=(9,)))  # other content, other entry


def test_manifest_round_trip_keeps_frames(tmp_path):
    """open_dataset_cache reads a window's frames back (and an older manifest without them as an image item)."""
    (tmp_path / "latents").mkdir()
    (tmp_path / "text").mkdir()
    (tmp_path / "datasets").mkdir()
    for sub, key in (("latents", "L"), ("text", "T"), ("latents", "L0"), ("text", "T0")):
        (tmp_path / sub / f"{key}.safetensors").write_bytes(b"x")
    item = {"image": "walk.mp4", "caption": "c", "bucket": [64, 64], "text_key": "T", "latent_key": "L",
            "frames": [4, 5, 6, 7, 8]}
    old = {"image": "a.png", "caption": "c", "bucket": [64, 64], "text_key": "T0", "latent_key": "L0"}
    manifest = {"version": cache_mod.MANIFEST_VERSION, "dataset_hash": "h", "family": "flux1", "variant": "x",
                "items": [item, old], "repeats": 1, "flip": False}
    path = tmp_path / "datasets" / "h.json"
    path.write_text(json.dumps(manifest))
    ds = open_dataset_cache(path)
    assert ds.items[0].frames == [4, 5, 6, 7, 8] and ds.items[1].frames == []
