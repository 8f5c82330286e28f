"""engine/data/pairs.py: edit datasets (target + instruction + control images) on tiny PNGs, in the layouts
lowvram-lora documents (docs/edit_datasets.md) and those ai-toolkit and musubi-tuner users already have."""
import pytest
from PIL import Image

from lowvram_lora.engine.config import DataConfig
from lowvram_lora.engine.data.pairs import scan_pairs
from lowvram_lora.engine.errors import DatasetError


def _png(path, size=(24, 16)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (10, 200, 30)).save(path)
    return path


def _target(folder, stem, text="make it blue", ext=".png"):
    _png(folder / f"{stem}{ext}")
    (folder / f"{stem}.txt").write_text(text)


def test_control_folder_inside_the_dataset_single_and_numbered(tmp_path):
    """control/cat.jpg for cat.png; control/dog_0.png, dog_1.png (musubi's numbering) for dog in order; a target
    named like a numbered control (dog_1 would be) keeps its own; the control folder is not reported as skipped."""
    for stem in ("cat", "dog", "cow_1"):
        _target(tmp_path, stem)
    _png(tmp_path / "control" / "cat.jpg")
    _png(tmp_path / "control" / "dog_1.png")
    _png(tmp_path / "control" / "dog_0.png")
    _png(tmp_path / "control" / "cow_1.png")
    logs = []
    pairs = {p.target.image_path.stem: p for p in scan_pairs(DataConfig(path=str(tmp_path)), log=logs.append)}
    assert [c.name for c in pairs["cat"].controls] == ["cat.jpg"]
    assert [c.name for c in pairs["dog"].controls] == ["dog_0.png", "dog_1.png"]
    assert [c.name for c in pairs["cow_1"].controls] == ["cow_1.png"]
    assert pairs["cat"].caption == "make it blue" and logs == []


def test_ai_toolkit_control_paths_one_folder_per_control(tmp_path):
    """ai-toolkit: control_path and control_path2 beside the targets, each file named as its target."""
    data, c1, c2 = tmp_path / "images", tmp_path / "ctrl", tmp_path / "ctrl2"
    _target(data, "a")
    _png(c1 / "a.png")
    _png(c2 / "a.webp")
    _png(c1 / "unused.png")
    logs = []
    (pair,) = scan_pairs(DataConfig(path=str(data)), control_dirs=[c1, c2], log=logs.append)
    assert [c.parent.name + "/" + c.name for c in pair.controls] == ["ctrl/a.png", "ctrl2/a.webp"]
    assert "unused.png" in logs[0]


def test_musubi_four_digit_numbering(tmp_path):
    _target(tmp_path / "img", "x")
    for i in (1, 0, 2):
        _png(tmp_path / "ctl" / f"x_{i:04d}.png")
    (pair,) = scan_pairs(DataConfig(path=str(tmp_path / "img")), control_dirs=[tmp_path / "ctl"])
    assert [c.name for c in pair.controls] == ["x_0000.png", "x_0001.png", "x_0002.png"]


def test_a_target_without_control_is_an_error_naming_it_and_the_fix(tmp_path):
    _target(tmp_path, "cat")
    _target(tmp_path, "dog")
    _png(tmp_path / "control" / "cat.png")
    with pytest.raises(DatasetError, match=r"1 target image\(s\) have no control image: dog.png.*dog_0.png"):
        scan_pairs(DataConfig(path=str(tmp_path)))


def test_layout_errors(tmp_path):
    """No control folder at all; a missing explicit folder; both forms for one target; a gap in the numbering;
    more controls than the model takes (Qwen-Image-Edit: 1)."""
    _target(tmp_path, "cat")
    with pytest.raises(DatasetError, match="put them in .*control"):
        scan_pairs(DataConfig(path=str(tmp_path)))
    with pytest.raises(DatasetError, match="does not exist"):
        scan_pairs(DataConfig(path=str(tmp_path)), control_dirs=[tmp_path / "nope"])
    _png(tmp_path / "control" / "cat.png")
    _png(tmp_path / "control" / "cat_0.png")
    with pytest.raises(DatasetError, match="both a same-name control"):
        scan_pairs(DataConfig(path=str(tmp_path)))
    (tmp_path / "control" / "cat.png").unlink()
    _png(tmp_path / "control" / "cat_2.png")
    with pytest.raises(DatasetError, match="skip a number"):
        scan_pairs(DataConfig(path=str(tmp_path)))
    _png(tmp_path / "control" / "cat_1.png")
    assert len(scan_pairs(DataConfig(path=str(tmp_path)))[0].controls) == 3
    with pytest.raises(DatasetError, match="has 3 control images .* takes 1"):
        scan_pairs(DataConfig(path=str(tmp_path)), max_controls=1)
