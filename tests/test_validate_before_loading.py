"""A wrong dataset is refused when the graph is queued, before any node runs (issue 43, finding 3): with a real
20-60 GB checkpoint, finding it after the model loaded cost minutes. The check is Cache Text Embeds'
``validate_inputs``, which ComfyUI calls at queue time (and shows on the node) and our runner calls the same way."""
from __future__ import annotations

import argparse

import pytest

from lowvram_lora.nodes.cache_embeds import LowVRAMCacheTextEmbeds


def _run(tmp_path, assets, dataset, monkeypatch, extra=()):
    from lowvram_lora.host.run_command import run_workflow_command
    from lowvram_lora.host.templates import WORKFLOWS_DIR
    from lowvram_lora.nodes import NODE_CLASS_MAPPINGS
    from lowvram_lora.nodes.paths import configure_standalone_dirs

    def never(*a, **k):
        raise AssertionError("a node ran: the dataset was not checked first")

    for cls in NODE_CLASS_MAPPINGS.values():
        monkeypatch.setattr(cls, "execute", classmethod(never))
    args = argparse.Namespace(
        workflow=str(WORKFLOWS_DIR / "demo_tiny_lora.json"), models_dir=str(assets["models"]),
        output_dir=str(tmp_path / "out"), no_progress=True, traceback=False,
        overrides=[f"2.dataset_path={dataset}", *extra])
    return run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs)


@pytest.fixture
def assets(tmp_path):
    from lowvram_lora.demo import ensure_demo_assets

    return ensure_demo_assets(tmp_path / "demo", trained=False)


def test_a_missing_dataset_folder_fails_before_any_node_runs(tmp_path, assets, monkeypatch, capsys):
    assert _run(tmp_path, assets, tmp_path / "no_such_folder", monkeypatch) == 1
    err = capsys.readouterr().err
    assert "no_such_folder" in err and "was not found" in err and "Put the images" in err, err


def test_images_without_captions_fail_before_any_node_runs(tmp_path, assets, monkeypatch, capsys):
    data = tmp_path / "uncaptioned"
    data.mkdir()
    for f in assets["dataset"].glob("*.png"):
        (data / f.name).write_bytes(f.read_bytes())
    assert _run(tmp_path, assets, data, monkeypatch) == 1
    err = capsys.readouterr().err
    assert "img_000.png" in err and "caption" in err, err


def test_a_missing_control_folder_fails_before_any_node_runs(tmp_path, assets, monkeypatch, capsys):
    assert _run(tmp_path, assets, assets["dataset"], monkeypatch, [f"2.control_folder={tmp_path / 'ctl'}"]) == 1
    err = capsys.readouterr().err
    assert "control_folder" in err and "ctl" in err and "is not a folder" in err, err


def test_the_check_passes_a_good_dataset_and_a_linked_value(assets):
    assert LowVRAMCacheTextEmbeds.validate_inputs(dataset_path=str(assets["dataset"])) is True
    assert LowVRAMCacheTextEmbeds.validate_inputs(dataset_path=None) is True  # linked: known only when it runs
    assert "empty" in LowVRAMCacheTextEmbeds.validate_inputs(dataset_path="  ")


def test_masks_beside_their_images_are_not_uncaptioned_images(tmp_path):
    """A masked-loss dataset (``<name>_mask.png`` beside ``<name>.png``, Dataset Options' mask_source 'beside') passes
    the queue-time check: the scan never counts a mask as a training image, so it needs no caption."""
    from PIL import Image

    from lowvram_lora.nodes.cache_embeds import _dataset_problem

    Image.new("RGB", (32, 32)).save(tmp_path / "img_000.png")
    (tmp_path / "img_000.txt").write_text("a photo")
    Image.new("L", (32, 32)).save(tmp_path / "img_000_mask.png")
    assert _dataset_problem(tmp_path, None) is None
    Image.new("RGB", (32, 32)).save(tmp_path / "img_001.png")  # a real image without a caption is still named
    assert "img_001.png" in _dataset_problem(tmp_path, None)
