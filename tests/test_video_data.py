"""Video data: tiny real clips written with PyAV (and Pillow for GIF/WebP) in tmp_path, decoded back and compared
with the frames that were encoded; fps resampling against independently computed indices; windows, 4k+1 counts,
buckets, and every skip / error message. CPU, a few seconds."""
from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lowvram_lora.engine.config import DataConfig
from lowvram_lora.engine.data import (
    ClipTooShortError,
    EmptyClipError,
    UnreadableClipError,
    VideoConfig,
    assign_bucket,
    assign_frame_count,
    assign_video_bucket,
    check_frame_counts,
    clip_windows,
    load_clip_tensor,
    make_buckets,
    probe_clip,
    resample_to_fps,
    scan_video_dataset,
    window_starts,
)
from lowvram_lora.engine.data.video_config import help_text
from lowvram_lora.engine.errors import ConfigError, DatasetError

av = pytest.importorskip("av")

W, H = 48, 32


def _frames(n: int, w: int = W, h: int = H, seed: int = 0) -> list[np.ndarray]:
    """n distinct frames of flat 8x8 blocks (colours codecs keep well), each frame's blocks shifted by its index
    so that every frame differs from every other."""
    rng = np.random.default_rng(seed)
    palette = rng.integers(0, 256, (64, 3), dtype=np.uint8)
    out = []
    for k in range(n):
        ids = (np.arange(h)[:, None] // 8 * 7 + np.arange(w)[None, :] // 8 + 5 * k) % 64
        out.append(palette[ids])
    return out


def _write_av(path: Path, frames, codec: str, pix_fmt: str, fps: int = 16, options=None, pts=None, rotation=0):
    """Encode ``frames`` (H, W, 3 uint8) with PyAV; ``pts`` in 1/1000 s for variable frame timing."""
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=fps, options=options or {})
        s.width, s.height, s.pix_fmt = frames[0].shape[1], frames[0].shape[0], pix_fmt
        if pts is not None:
            s.codec_context.time_base = Fraction(1, 1000)
        if rotation:
            s.set_display_rotation(rotation)
        for i, f in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(f, format="rgb24")
            if pts is not None:
                frame.pts, frame.time_base = pts[i], Fraction(1, 1000)
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def _lossless_mp4(path: Path, frames, **kw) -> Path:
    return _write_av(path, frames, "libx264rgb", "rgb24", options={"crf": "0", "qp": "0"}, **kw)


def _pixels(t: torch.Tensor) -> np.ndarray:
    """(3, F, H, W) in [-1, 1] -> (F, H, W, 3) 0..255 as int."""
    return ((t + 1) * 127.5).round().permute(1, 2, 3, 0).numpy().astype(int)


def _reference(frames, indices) -> np.ndarray:
    return np.stack([frames[i] for i in indices]).astype(int)


# ---------------------------------------------------------------- decoding, per format


@pytest.mark.parametrize("suffix,codec,pix_fmt,options,tolerance", [
    (".mp4", "libx264rgb", "rgb24", {"crf": "0", "qp": "0"}, 0),   # lossless H.264 in RGB: exact
    (".mov", "png", "rgb24", {}, 0),                                # PNG frames in QuickTime: exact
    (".webm", "libvpx-vp9", "yuv444p", {"lossless": "1"}, 3),      # lossless VP9, but RGB<->YUV rounds by <= 3
    (".mp4", "libx264", "yuv420p", {"crf": "10"}, 40),              # ordinary lossy H.264 (4:2:0 chroma): see mean
])
def test_container_decodes_to_encoded_pixels(tmp_path, suffix, codec, pix_fmt, options, tolerance):
    frames = _frames(9)
    path = _write_av(tmp_path / f"clip{suffix}", frames, codec, pix_fmt, options=options)
    info = probe_clip(path)
    assert (info.kind, info.width, info.height, info.frame_count) == ("container", W, H, 9)
    # WebM stores times in ms: 1/16 s is 0.063 there.
    assert info.timestamps == pytest.approx([k / 16 for k in range(9)], abs=1e-3)
    assert info.end == pytest.approx(9 / 16, abs=1e-3)
    picked = [0, 3, 3, 8]  # repeats allowed, order kept
    t = load_clip_tensor(path, picked, (W, H))
    assert t.shape == (3, 4, H, W) and t.dtype == torch.float32
    assert t.min() >= -1 and t.max() <= 1
    err = np.abs(_pixels(t) - _reference(frames, picked))
    assert err.max() <= tolerance
    if tolerance > 3:  # lossy: 4:2:0 chroma smears colour edges of these random 8x8 blocks (the worst case for it),
        assert err.mean() < 6.0  # but on average a frame is within 6 of 255 (a wrong frame is ~79 off)


@pytest.mark.parametrize("suffix,codec,pix_fmt,options", [
    (".mp4", "libx264rgb", "rgb24", {"crf": "0", "qp": "0", "g": "3", "bf": "2"}),  # keyframe every 3, B-frames
    (".webm", "libvpx-vp9", "yuv444p", {"lossless": "1", "g": "3"}),
])
def test_window_late_in_a_clip_starts_at_a_keyframe(tmp_path, suffix, codec, pix_fmt, options):
    """Windows after the start seek to the keyframe before them; every frame must still be the right one."""
    frames = _frames(30)
    path = _write_av(tmp_path / f"gop{suffix}", frames, codec, pix_fmt, options=options)
    for picked in ([17, 18, 19, 20, 21], [29], [4, 10, 25]):
        err = np.abs(_pixels(load_clip_tensor(path, picked, (W, H))) - _reference(frames, picked))
        assert err.max() <= 3, picked


def test_gif_and_webp_decode_with_their_frame_delays(tmp_path):
    # GIF: a palette format, so frames use a few exact colours; WebP written lossless. Per-frame delays in ms.
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)]
    frames = []
    for k in range(4):
        a = np.zeros((H, W, 3), np.uint8)
        a[:, : W // 2] = colours[k]
        a[:, W // 2:] = colours[(k + 1) % 4]
        frames.append(a)
    delays = [100, 200, 100, 300]
    for suffix, extra in ((".gif", {}), (".webp", {"lossless": True})):
        path = tmp_path / f"anim{suffix}"
        imgs = [Image.fromarray(f) for f in frames]
        imgs[0].save(path, save_all=True, append_images=imgs[1:], duration=delays, loop=0, **extra)
        info = probe_clip(path)
        assert (info.kind, info.width, info.height) == ("animated", W, H)
        assert info.timestamps == pytest.approx([0.0, 0.1, 0.3, 0.4])
        assert info.end == pytest.approx(0.7)
        t = load_clip_tensor(path, [0, 1, 2, 3], (W, H))
        assert np.array_equal(_pixels(t), _reference(frames, range(4))), suffix
        # At 10 fps the frame on screen at 0, .1, ..., .6 s: frame 1 shows for two ticks, frame 3 for three.
        assert resample_to_fps(info.timestamps, info.end, 10) == [0, 1, 1, 2, 3, 3, 3]


def test_frames_folder_and_still_image(tmp_path):
    frames = _frames(6)
    folder = tmp_path / "walk"
    folder.mkdir()
    for k, f in enumerate(frames):  # names sort as frame order; a hidden file is not a frame
        Image.fromarray(f).save(folder / f"f{k:03d}.png")
    (folder / ".DS_Store").write_bytes(b"junk")
    info = probe_clip(folder, frames_folder_fps=8)
    assert (info.kind, info.frame_count, info.end) == ("frames", 6, pytest.approx(6 / 8))
    assert info.timestamps == pytest.approx([k / 8 for k in range(6)])
    assert np.array_equal(_pixels(load_clip_tensor(folder, [5, 0], (W, H))), _reference(frames, [5, 0]))

    still = tmp_path / "still.png"
    Image.fromarray(frames[2]).save(still)
    info = probe_clip(still)
    assert (info.kind, info.frame_count) == ("image", 1)
    t = load_clip_tensor(still, [0], (W, H))
    assert t.shape == (3, 1, H, W) and np.array_equal(_pixels(t), _reference(frames, [2]))


def test_bucket_resize_and_flip_match_the_image_path(tmp_path):
    """A frame is scaled and cropped exactly as an image is (load_image_tensor), and flip mirrors it."""
    from lowvram_lora.engine.data import load_image_tensor

    frames = _frames(2, 64, 40)
    path = _lossless_mp4(tmp_path / "c.mp4", frames)
    Image.fromarray(frames[1]).save(tmp_path / "f1.png")
    bucket = (32, 32)
    t = load_clip_tensor(path, [1], bucket, flip=True)
    ref = load_image_tensor(tmp_path / "f1.png", bucket, flip=True)
    assert torch.equal(t[:, 0], ref)


@pytest.mark.skipif(not hasattr(av.video.stream.VideoStream, "set_display_rotation"),
                    reason="this PyAV cannot write a display rotation")
def test_display_rotation_is_applied(tmp_path):
    frames = _frames(2)
    path = _lossless_mp4(tmp_path / "phone.mp4", frames, rotation=90)
    info = probe_clip(path)
    assert (info.width, info.height) == (H, W)  # displayed portrait
    t = load_clip_tensor(path, [0], (H, W))
    # PyAV's rotation is counter-clockwise (its documented convention), as numpy's rot90 with k=1.
    assert np.array_equal(_pixels(t)[0], np.rot90(frames[0], k=1).astype(int))


# ---------------------------------------------------------------- fps resampling by timestamps


def test_fps_resampling_picks_frames_by_timestamp(tmp_path):
    frames = _frames(20)
    path = _write_av(tmp_path / "c30.mp4", frames, "libx264rgb", "rgb24", fps=30, options={"crf": "0", "qp": "0"})
    info = probe_clip(path)
    for fps in (10, 16, 24, 30, 45):
        # Independently: target time k / fps shows source frame floor(k * 30 / fps), for k / fps < 20 / 30.
        expected = [k * 30 // fps for k in range(10 * fps) if k * 30 < 20 * fps]
        assert resample_to_fps(info.timestamps, info.end, fps) == expected, fps
    assert resample_to_fps(info.timestamps, info.end, 0) == list(range(20))
    idx = resample_to_fps(info.timestamps, info.end, 10)
    assert np.array_equal(_pixels(load_clip_tensor(path, idx, (W, H))), _reference(frames, idx))


def test_variable_frame_timing(tmp_path):
    frames = _frames(5)
    pts_ms = [0, 100, 150, 400, 500]  # a stall after frame 2, as phones record
    path = _write_av(tmp_path / "vfr.mp4", frames, "libx264rgb", "rgb24", options={"crf": "0", "qp": "0"}, pts=pts_ms)
    info = probe_clip(path)
    assert info.timestamps == pytest.approx([p / 1000 for p in pts_ms], abs=1e-3)
    idx = resample_to_fps(info.timestamps, info.end, 20)  # every 50 ms until the end
    end_ms = round(info.end * 1000)
    expected = [max(i for i, p in enumerate(pts_ms) if p <= t) for t in range(0, end_ms, 50)]
    assert idx == expected
    assert np.array_equal(_pixels(load_clip_tensor(path, idx, (W, H))), _reference(frames, idx))


# ---------------------------------------------------------------- windows, counts, buckets


def test_window_starts():
    assert window_starts(20, 5, "head", 1, 0, "a.mp4") == [0]
    assert window_starts(20, 5, "uniform", 3, 0, "a.mp4") == list(np.linspace(0, 15, 3).astype(int))
    assert window_starts(20, 5, "uniform", 1, 0, "a.mp4") == [0]
    assert window_starts(6, 5, "uniform", 4, 0, "a.mp4") == [0, 1]  # only two distinct starts exist
    a = window_starts(100, 17, "random", 4, 7, "a.mp4")
    assert a == window_starts(100, 17, "random", 4, 7, "a.mp4")  # reproducible
    assert len(set(a)) == 4 and a == sorted(a) and all(0 <= s <= 83 for s in a)
    others = {tuple(window_starts(100, 17, "random", 4, seed, key)) for seed, key in
              [(8, "a.mp4"), (7, "b.mp4"), (9, "c.mp4")]}
    assert tuple(a) not in others  # the seed and the clip's name both move the windows
    assert window_starts(17, 17, "random", 3, 0, "x") == [0]


def test_clip_windows_use_resampled_frames():
    ts = [k / 30 for k in range(90)]  # 3 s at 30 fps
    available, count, wins = clip_windows(ts, 3.0, 10, (9, 17, 33), "uniform", 2, 0, "c")
    assert (available, count) == (30, 17)
    assert wins == [tuple(range(0, 51, 3)), tuple(range(39, 90, 3))]  # starts 0 and 13 of the 30 resampled
    assert clip_windows(ts[:6], 0.2, 10, (5,), "head", 1, 0, "c") == (2, 0, [])


def test_frame_counts_are_4k_plus_1():
    assert check_frame_counts([33, 17, 33, 1]) == (1, 17, 33)
    with pytest.raises(ConfigError, match=r"frame count 32 is not of the form 4k\+1.*use 29 or 33"):
        check_frame_counts([17, 32])
    with pytest.raises(ConfigError, match="frame_counts is empty"):
        check_frame_counts([])
    with pytest.raises(ConfigError, match="not of the form 4k"):
        VideoConfig(frame_counts=(16,))
    assert VideoConfig(frame_counts=[81, 33]).frame_counts == (33, 81)
    with pytest.raises(ConfigError, match="head' takes one window"):
        VideoConfig(window="head", windows_per_clip=2)
    with pytest.raises(ConfigError, match="window='middle' is not one of head, uniform, random"):
        VideoConfig(window="middle")
    with pytest.raises(ConfigError, match="fps=-1"):
        VideoConfig(fps=-1)
    assert "4k+1" in help_text("frame_counts") and "timestamps" in help_text("fps")


def test_frame_and_resolution_buckets():
    assert assign_frame_count(40, (17, 33, 81)) == 33
    assert assign_frame_count(81, (17, 33, 81)) == 81
    assert assign_frame_count(16, (17, 33)) is None
    buckets = make_buckets(512, 64)
    assert assign_video_bucket(1920, 1080, 33, buckets) == (*assign_bucket(1920, 1080, buckets), 33)


# ---------------------------------------------------------------- the dataset scan: skips and errors


def _caption(path: Path, text: str = "a clip") -> None:
    path.write_text(text, encoding="utf-8")


def test_scan_skips_bad_clips_by_name_and_keeps_the_rest(tmp_path):
    _lossless_mp4(tmp_path / "good.mp4", _frames(40))                  # 2.5 s at 16 fps
    _lossless_mp4(tmp_path / "short.mp4", _frames(5))                  # 5 frames < 9
    (tmp_path / "broken.mp4").write_bytes(b"\x00\x01 not a video at all" * 50)
    with av.open(str(tmp_path / "empty.mp4"), "w") as c:               # a recording with no frame
        s = c.add_stream("libx264rgb", rate=16)
        s.width, s.height, s.pix_fmt = W, H, "rgb24"
        c.start_encoding()
    (tmp_path / "noframes").mkdir()
    Image.fromarray(_frames(1)[0]).save(tmp_path / "photo.png")
    for name in ("good", "short", "broken", "empty", "noframes", "photo"):
        _caption(tmp_path / f"{name}.txt", f"{name} caption")
    lines: list[str] = []
    video = VideoConfig(frame_counts=(9, 17), fps=16, window="uniform", windows_per_clip=2)
    records = scan_video_dataset(DataConfig(path=str(tmp_path), trigger_word="sks"), video, log=lines.append)

    assert [(r.path.name, r.frame_count, r.window) for r in records] == [
        ("good.mp4", 17, 0), ("good.mp4", 17, 1), ("photo.png", 1, 0)]
    assert records[0].frames == tuple(range(17)) and records[1].frames == tuple(range(23, 40))
    assert records[0].caption == "sks, good caption" and (records[0].width, records[0].height) == (W, H)
    text = "\n".join(lines)
    assert len(lines) == 4, text
    assert "skipped 'broken.mp4': the video cannot be read" in text
    assert "skipped 'empty.mp4': the file has no video frames" in text
    assert "skipped 'noframes': the folder holds no frame images" in text
    assert "skipped 'short.mp4': it has 5 frames at 16 fps (0.31 s), fewer than the smallest frame count 9" in text


def test_named_errors_for_one_clip(tmp_path):
    (tmp_path / "broken.webm").write_bytes(b"garbage" * 100)
    with pytest.raises(UnreadableClipError, match="broken.webm.*cannot be read.*re-export it or remove it"):
        probe_clip(tmp_path / "broken.webm")
    (tmp_path / "zero.mov").write_bytes(b"")
    with pytest.raises(EmptyClipError, match=r"zero.mov.*the file is empty \(0 bytes\)"):
        probe_clip(tmp_path / "zero.mov")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EmptyClipError, match="'empty'.*no frame images"):
        probe_clip(tmp_path / "empty")
    odd = tmp_path / "odd"
    odd.mkdir()
    Image.new("RGB", (32, 32)).save(odd / "0.png")
    Image.new("RGB", (16, 32)).save(odd / "1.png")
    with pytest.raises(UnreadableClipError, match="frames differ in size: 0.png is 32x32, 1.png is 16x32"):
        probe_clip(odd)
    bad = tmp_path / "bad"
    bad.mkdir()
    Image.new("RGB", (32, 32)).save(bad / "0.png")
    (bad / "1.png").write_bytes(b"not a png")
    with pytest.raises(UnreadableClipError, match=r"clip 'bad'.*frame 1.png: the image cannot be read"):
        probe_clip(bad)
    path = _lossless_mp4(tmp_path / "c.mp4", _frames(3))
    with pytest.raises(UnreadableClipError, match=r"frames \[7\] could not be decoded"):
        load_clip_tensor(path, [0, 7], (W, H))
    assert issubclass(ClipTooShortError, DatasetError)


def test_no_usable_clip_is_an_error_naming_the_fix(tmp_path):
    _lossless_mp4(tmp_path / "short.mp4", _frames(5))
    (tmp_path / "bad.mov").write_bytes(b"nope" * 10)
    for name in ("short", "bad"):
        _caption(tmp_path / f"{name}.txt")
    lines = []
    with pytest.raises(DatasetError, match=r"no usable clip in .*bad.mov \(the video cannot be read.*short.mp4 \(it "
                                           r"has 5 frames.*lower frame_counts \(smallest now 33\) or fps \(now 16"):
        scan_video_dataset(DataConfig(path=str(tmp_path)), VideoConfig(), log=lines.append)
    assert len(lines) == 2


def test_missing_captions_and_empty_folder(tmp_path):
    with pytest.raises(DatasetError, match="no clips or images found"):
        scan_video_dataset(DataConfig(path=str(tmp_path)), VideoConfig(), log=print)
    _lossless_mp4(tmp_path / "a.mp4", _frames(9))
    with pytest.raises(DatasetError, match=r"1 clip\(s\) have no caption.*a.mp4.*next to each clip"):
        scan_video_dataset(DataConfig(path=str(tmp_path)), VideoConfig(frame_counts=(9,)), log=print)
    records = scan_video_dataset(DataConfig(path=str(tmp_path), default_caption="x"), VideoConfig(frame_counts=(9,)))
    assert [r.caption for r in records] == ["x"]


def test_skip_is_printed_when_no_log_is_given(tmp_path, capsys):
    _lossless_mp4(tmp_path / "a.mp4", _frames(9))
    (tmp_path / "b.mp4").write_bytes(b"x" * 64)
    for name in ("a", "b"):
        _caption(tmp_path / f"{name}.txt")
    scan_video_dataset(DataConfig(path=str(tmp_path)), VideoConfig(frame_counts=(9,)))
    assert "skipped 'b.mp4'" in capsys.readouterr().out
