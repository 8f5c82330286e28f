"""``--no-progress`` (``lowvram-lora run`` and ``demo``): no progress bar at all, the nodes' own included; the log
lines and the final summary still come."""
import argparse

import pytest


@pytest.mark.parametrize("progress", [False, True])
def test_no_progress_draws_no_bars(tmp_path, capfd, progress):
    from lowvram_lora.demo import ensure_demo_assets
    from lowvram_lora.host.run_command import run_workflow_command
    from lowvram_lora.host.templates import WORKFLOWS_DIR
    from lowvram_lora.nodes import NODE_CLASS_MAPPINGS
    from lowvram_lora.nodes.paths import configure_standalone_dirs

    assets = ensure_demo_assets(tmp_path / "demo", trained=False)
    capfd.readouterr()  # building the demo model draws diffusers' own bars: not the run's
    args = argparse.Namespace(
        workflow=str(WORKFLOWS_DIR / "demo_tiny_lora.json"), models_dir=str(assets["models"]),
        output_dir=str(tmp_path / "out"), no_progress=not progress, traceback=False,
        overrides=[f"2.dataset_path={assets['dataset']}", "4.steps=3", "4.warmup_steps=0", "4.sample_every=0"])
    assert run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs) == 0
    out, err = capfd.readouterr()
    bars = [line for line in (out + err).replace("\r", "\n").splitlines() if "%|" in line or "it/s]" in line]
    if progress:
        assert any(line.startswith("train") for line in bars)  # the training bar, as before
    else:
        assert not bars, bars
    assert "trained 3 steps: final loss" in out and "done: 7 node(s)" in out  # the summary lines stay


@pytest.mark.parametrize("inside", [False, True])
def test_library_bars_are_off_around_a_node_inside_a_server(monkeypatch, inside):
    """Inside ComfyUI or ``serve`` (here: a host set, as serve sets one) the node shows its own progress, so
    transformers' and diffusers' loading bars are off around the node's engine call and back afterwards; headless
    they stay as they are."""
    import diffusers.utils.logging as dlog
    import transformers.utils.logging as tlog

    from lowvram_lora.nodes import progress

    monkeypatch.setattr(progress, "_host", object() if inside else None)
    monkeypatch.setattr(progress, "_comfy", lambda: None)
    tlog.enable_progress_bar()
    dlog.enable_progress_bar()
    with progress.node_library_bars():
        assert tlog.is_progress_bar_enabled() is not inside
        assert dlog.is_progress_bar_enabled() is not inside
    assert tlog.is_progress_bar_enabled() and dlog.is_progress_bar_enabled()
