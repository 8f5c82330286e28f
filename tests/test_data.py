"""Dataset scanning, bucketing and image decoding (CPU, tiny synthetic images)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from lowvram_lora.engine.config import DataConfig
from lowvram_lora.engine.data import (
    ImageRecord,
    assign_bucket,
    expand_repeats,
    load_image_tensor,
    make_buckets,
    scan_dataset,
)
from lowvram_lora.engine.errors import ConfigError, DatasetError

RED = (255, 0, 0)
BLUE = (0, 0, 255)
GREEN = (0, 255, 0)


def _image(path: Path, size: tuple[int, int] = (32, 24), color=RED, mode: str = "RGB", **save) -> Path:
    Image.new(mode, size, color).save(path, **save)
    return path


def _caption(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _halves(path: Path, size: tuple[int, int], left=RED, right=BLUE) -> Path:
    """Image whose left half is ``left`` and right half is ``right``."""
    img = Image.new("RGB", size, left)
    img.paste(right, (size[0] // 2, 0, size[0], size[1]))
    img.save(path)
    return path


def _cfg(path: Path, **kw) -> DataConfig:
    return DataConfig(path=str(path), **kw)


def _color(t: torch.Tensor) -> torch.Tensor:
    """A (3,) [-1, 1] colour as 0..255."""
    return (t + 1) * 127.5


# ---------------------------------------------------------------- scan_dataset


def test_pairs_captions_sorted_with_sizes(tmp_path: Path) -> None:
    _image(tmp_path / "b.jpg", (40, 20))
    _caption(tmp_path / "b.txt", "a blue thing")
    _image(tmp_path / "a.PNG", (16, 48))
    _caption(tmp_path / "a.txt", "  line one\n\n  line two \r\n")
    _image(tmp_path / "c.webp", (8, 8))
    _caption(tmp_path / "c.txt", "third")
    (tmp_path / "notes.md").write_text("not an image")
    (tmp_path / "sub").mkdir()
    _image(tmp_path / "sub" / "nested.png")  # sub-folders are not searched

    records = scan_dataset(_cfg(tmp_path))

    assert [r.image_path.name for r in records] == ["a.PNG", "b.jpg", "c.webp"]
    assert [r.caption for r in records] == ["line one line two", "a blue thing", "third"]
    assert [(r.width, r.height) for r in records] == [(16, 48), (40, 20), (8, 8)]
    assert all(isinstance(r, ImageRecord) for r in records)
    with pytest.raises(AttributeError):
        records[0].caption = "x"  # frozen


def test_trigger_word_prepended(tmp_path: Path) -> None:
    _image(tmp_path / "a.png")
    _caption(tmp_path / "a.txt", "a photo of a dog")
    _image(tmp_path / "b.png")
    _caption(tmp_path / "b.txt", "")  # empty caption + default "" -> just the trigger
    records = scan_dataset(_cfg(tmp_path, trigger_word=" ohwx ", default_caption=""))
    assert [r.caption for r in records] == ["ohwx, a photo of a dog", "ohwx"]


def test_default_caption_used_for_missing_and_empty(tmp_path: Path) -> None:
    _image(tmp_path / "a.png")
    _image(tmp_path / "b.png")
    _caption(tmp_path / "b.txt", "   \n ")
    _image(tmp_path / "c.png")
    _caption(tmp_path / "c.txt", "own caption")
    records = scan_dataset(_cfg(tmp_path, default_caption="a photo", trigger_word="sks"))
    assert [r.caption for r in records] == ["sks, a photo", "sks, a photo", "sks, own caption"]


def test_caption_extension_and_bom(tmp_path: Path) -> None:
    _image(tmp_path / "a.png")
    (tmp_path / "a.caption").write_bytes("\ufeffcafé".encode("utf-8"))
    records = scan_dataset(_cfg(tmp_path, caption_extension="caption"))
    assert records[0].caption == "café"


def test_missing_captions_error_lists_names(tmp_path: Path) -> None:
    for i in range(25):
        _image(tmp_path / f"img{i:02d}.png", (8, 8))
    _caption(tmp_path / "img00.txt", "has one")
    with pytest.raises(DatasetError) as info:
        scan_dataset(_cfg(tmp_path))
    msg = str(info.value)
    assert "24 image(s)" in msg
    assert "img01.png" in msg and "img20.png" in msg
    assert "img21.png" not in msg and "and 4 more" in msg
    assert "img00.png" not in msg
    assert ".txt" in msg and "default_caption" in msg


def test_empty_path_error() -> None:
    with pytest.raises(DatasetError, match="empty"):
        scan_dataset(DataConfig(path=""))


def test_missing_path_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        scan_dataset(_cfg(tmp_path / "nope"))


def test_path_is_file_error(tmp_path: Path) -> None:
    f = _image(tmp_path / "a.png")
    with pytest.raises(DatasetError, match="not a folder"):
        scan_dataset(_cfg(f))


def test_folder_without_images_error(tmp_path: Path) -> None:
    _caption(tmp_path / "a.txt", "caption without image")
    _image(tmp_path / "a.gif", (8, 8))
    with pytest.raises(DatasetError) as info:
        scan_dataset(_cfg(tmp_path))
    msg = str(info.value)
    assert "no images" in msg
    for ext in ("png", "jpg", "jpeg", "webp"):
        assert ext in msg


def test_hidden_files_ignored(tmp_path: Path) -> None:
    (tmp_path / "._a.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    _image(tmp_path / "a.png")
    records = scan_dataset(_cfg(tmp_path, default_caption="x"))
    assert [r.image_path.name for r in records] == ["a.png"]


def test_corrupt_image_error_names_file(tmp_path: Path) -> None:
    _image(tmp_path / "good.png")
    (tmp_path / "broken.jpg").write_bytes(b"this is not a jpeg at all")
    with pytest.raises(DatasetError, match="broken.jpg"):
        scan_dataset(_cfg(tmp_path, default_caption="x"))


def test_truncated_image_fails_on_load(tmp_path: Path) -> None:
    path = tmp_path / "cut.png"
    img = Image.effect_noise((64, 64), 50).convert("RGB")
    img.save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DatasetError, match="cut.png"):
        load_image_tensor(path, (64, 64))


def test_exif_rotation_swaps_reported_size(tmp_path: Path) -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise when displayed
    _image(tmp_path / "r.jpg", (40, 20), exif=exif.tobytes())
    (record,) = scan_dataset(_cfg(tmp_path, default_caption="x"))
    assert (record.width, record.height) == (20, 40)
    assert load_image_tensor(record.image_path, (64, 128)).shape == (3, 128, 64)


def test_expand_repeats(tmp_path: Path) -> None:
    a = ImageRecord(tmp_path / "a.png", "a", 1, 1)
    b = ImageRecord(tmp_path / "b.png", "b", 1, 1)
    assert expand_repeats([a, b], 1) == [a, b]
    assert expand_repeats([a, b], 3) == [a, b, a, b, a, b]
    with pytest.raises(ConfigError):
        expand_repeats([a], 0)


# ---------------------------------------------------------------- buckets


@pytest.mark.parametrize("resolution", [512, 768, 1024])
@pytest.mark.parametrize("step", [16, 64])
def test_bucket_properties(resolution: int, step: int) -> None:
    buckets = make_buckets(resolution, step=step, max_aspect=2.0)
    area = resolution * resolution
    assert buckets == sorted(set(buckets))
    assert (resolution, resolution) in buckets
    for w, h in buckets:
        assert w % step == 0 and h % step == 0
        assert w * h <= area
        assert max(w, h) / min(w, h) <= 2.0
        # The short side is as large as the area allows for this long side.
        long_side, short_side = max(w, h), min(w, h)
        assert long_side * (short_side + step) > area
        # Both orientations are offered.
        assert (h, w) in buckets
    # Both orientations are actually used, not only the square.
    assert any(w > h for w, h in buckets) and any(h > w for w, h in buckets)


def test_bucket_area_close_to_target() -> None:
    for w, h in make_buckets(1024, 64, 2.0):
        assert w * h >= 0.85 * 1024 * 1024


def test_bucket_max_aspect_respected() -> None:
    narrow = make_buckets(1024, 64, max_aspect=1.3)
    assert all(max(w, h) / min(w, h) <= 1.3 for w, h in narrow)
    assert len(narrow) < len(make_buckets(1024, 64, max_aspect=2.0))
    assert make_buckets(1024, 64, max_aspect=1.0) == [(1024, 1024)]


def test_square_absent_when_resolution_off_grid() -> None:
    buckets = make_buckets(1040, 64)
    assert (1040, 1040) not in buckets
    assert all(w * h <= 1040 * 1040 for w, h in buckets)


def test_bucket_errors() -> None:
    with pytest.raises(ConfigError):
        make_buckets(64, step=128)


def test_assign_bucket() -> None:
    buckets = make_buckets(1024)
    assert assign_bucket(3000, 3000, buckets) == (1024, 1024)
    portrait = assign_bucket(2000, 3000, buckets)  # 2:3
    landscape = assign_bucket(3000, 2000, buckets)  # 3:2
    assert portrait[1] > portrait[0] and landscape[0] > landscape[1]
    assert portrait == landscape[::-1]
    assert portrait == (832, 1216)
    assert assign_bucket(100, 1000, buckets) == (704, 1408)  # clamps to the most extreme
    assert assign_bucket(1000, 100, buckets) == (1408, 704)


def test_assign_bucket_log_distance_and_tie() -> None:
    # 2:1 and 1:2 are equally far from 1:1 in log space; 1.5:1 image: log-nearest is 2:1.
    # (|ln 1.5 - ln 2| = 0.288 < |ln 1.5 - 0| = 0.405).
    assert assign_bucket(150, 100, [(64, 64), (128, 64)]) == (128, 64)
    # A square image is exactly as far (ln 2) from 1:2 as from 2:1: the larger bucket wins,
    # whichever orientation it has and whatever the list order.
    assert assign_bucket(500, 500, [(64, 128), (256, 128)]) == (256, 128)
    assert assign_bucket(500, 500, [(128, 256), (128, 64)]) == (128, 256)
    assert assign_bucket(500, 500, [(128, 64), (128, 256)]) == (128, 256)

# ---------------------------------------------------------------- load_image_tensor


def test_tensor_shape_dtype_range(tmp_path: Path) -> None:
    path = tmp_path / "noise.png"
    Image.effect_noise((90, 70), 80).convert("RGB").save(path)
    t = load_image_tensor(path, (64, 48))
    assert t.shape == (3, 48, 64) and t.dtype == torch.float32
    assert t.min() >= -1.0 and t.max() <= 1.0
    assert t.is_contiguous()


def test_solid_colours_map_to_range_ends(tmp_path: Path) -> None:
    t = load_image_tensor(_image(tmp_path / "r.png", (50, 30), RED), (32, 32))
    assert torch.allclose(t[:, 16, 16], torch.tensor([1.0, -1.0, -1.0]))


def test_crop_keeps_halves_and_flip_swaps(tmp_path: Path) -> None:
    path = _halves(tmp_path / "h.png", (300, 200))
    t = load_image_tensor(path, (128, 128))
    assert t.shape == (3, 128, 128)
    # Left quarter red, right quarter blue (away from the resampled boundary).
    assert torch.allclose(t[:, :, :48].mean(dim=(1, 2)), torch.tensor([1.0, -1.0, -1.0]), atol=0.02)
    assert torch.allclose(t[:, :, 80:].mean(dim=(1, 2)), torch.tensor([-1.0, -1.0, 1.0]), atol=0.02)
    flipped = load_image_tensor(path, (128, 128), flip=True)
    assert torch.equal(flipped, t.flip(-1))
    assert torch.allclose(flipped[:, :, :48].mean(dim=(1, 2)), torch.tensor([-1.0, -1.0, 1.0]), atol=0.02)


def test_center_crop_removes_top_and_bottom(tmp_path: Path) -> None:
    # 100x300: green top third, red middle third, green bottom third. Square crop = middle.
    img = Image.new("RGB", (100, 300), GREEN)
    img.paste(RED, (0, 100, 100, 200))
    img.save(tmp_path / "v.png")
    t = load_image_tensor(tmp_path / "v.png", (64, 64))
    inner = t[:, 4:-4, :]  # skip the resampling fringe at the crop edges
    assert torch.allclose(_color(inner.mean(dim=(1, 2))), torch.tensor([255.0, 0.0, 0.0]), atol=3)


def test_crop_is_centred_horizontally(tmp_path: Path) -> None:
    # 400x100 with a 100-px blue centre band; a 1:1 crop must be exactly that band.
    img = Image.new("RGB", (400, 100), RED)
    img.paste(BLUE, (150, 0, 250, 100))
    img.save(tmp_path / "c.png")
    t = load_image_tensor(tmp_path / "c.png", (32, 32))
    inner = t[:, :, 3:-3]
    assert torch.allclose(_color(inner.mean(dim=(1, 2))), torch.tensor([0.0, 0.0, 255.0]), atol=3)


def test_upscale_small_image(tmp_path: Path) -> None:
    t = load_image_tensor(_halves(tmp_path / "s.png", (20, 10)), (128, 64))
    assert t.shape == (3, 64, 128)
    assert _color(t[:, 32, 10]).round().tolist() == [255.0, 0.0, 0.0]
    assert _color(t[:, 32, 118]).round().tolist() == [0.0, 0.0, 255.0]


def test_alpha_composited_over_white(tmp_path: Path) -> None:
    path = _image(tmp_path / "a.png", (16, 16), (0, 0, 0, 0), mode="RGBA")
    t = load_image_tensor(path, (16, 16))
    assert torch.allclose(t, torch.ones(3, 16, 16))
    half = _image(tmp_path / "b.png", (16, 16), (0, 0, 0, 128), mode="RGBA")
    value = _color(load_image_tensor(half, (16, 16))[:, 8, 8])
    assert torch.allclose(value, torch.full((3,), 127.0), atol=2)


def test_greyscale_and_palette_become_rgb(tmp_path: Path) -> None:
    grey = _image(tmp_path / "g.png", (16, 16), 255, mode="L")
    assert torch.allclose(load_image_tensor(grey, (16, 16)), torch.ones(3, 16, 16))
    pal = Image.new("RGB", (16, 16), BLUE).convert("P")
    pal.save(tmp_path / "p.png")
    t = load_image_tensor(tmp_path / "p.png", (16, 16))
    assert torch.allclose(t[:, 0, 0], torch.tensor([-1.0, -1.0, 1.0]))


def test_sixteen_bit_greyscale_scaled_not_clipped(tmp_path: Path) -> None:
    path = tmp_path / "g16.png"
    Image.new("I;16", (16, 16), 32768).save(path)
    value = _color(load_image_tensor(path, (16, 16))[:, 8, 8])
    assert torch.allclose(value, torch.full((3,), 128.0), atol=2)


def test_exif_orientation_applied(tmp_path: Path) -> None:
    # Stored 40x20 with red left / blue right; orientation 6 shows it rotated 90 degrees
    # clockwise, so the displayed image is 20x40 with red on top.
    img = Image.new("RGB", (40, 20), RED)
    img.paste(BLUE, (20, 0, 40, 20))
    exif = Image.Exif()
    exif[0x0112] = 6
    img.save(tmp_path / "o.png", exif=exif.tobytes())
    t = load_image_tensor(tmp_path / "o.png", (32, 64))
    assert t.shape == (3, 64, 32)
    assert _color(t[:, 8, 16]).round().tolist() == [255.0, 0.0, 0.0]
    assert _color(t[:, 56, 16]).round().tolist() == [0.0, 0.0, 255.0]


def test_bad_bucket_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        load_image_tensor(_image(tmp_path / "a.png"), (0, 64))
