"""bench/host_profile.py on the tiny Flux.1 (CPU): every mode a row with host RAM beside peak VRAM, the block count
the engine streams, the raw loops' LoRA gradients equal to torch's checkpoint's (rtol 1e-5), and a profile of the
engine's steps that reaches the engine's own functions."""
import json

import pytest
import torch
from helpers import bench_module


def test_host_profile_rows_and_profile(tmp_path):
    host_profile = bench_module("host_profile")
    assert host_profile.main(["--tiny", "--compile", "off", "--warmup", "1", "--timed", "1", "--profiled", "1",
                              "--out-dir", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in rows] == ["engine", "raw-ckpt", "raw-block-ckpt", "raw", "raw-frozen"]
    from lowvram_lora.engine.families import get_family
    from lowvram_lora.engine.offload.footprint import named_blocks
    from train_bench import build_random_model

    model, family, _ = build_random_model("flux1-tiny", torch.device("cpu"), torch.float32, 0.02, 0)
    blocks = len(named_blocks(model, get_family("flux1")))
    for r in rows:
        assert r["compile"] == "off" and r["blocks"] == blocks and r["step_s"] > 0
        assert r["ms_per_block"] == pytest.approx(r["step_s"] / blocks * 1e3, abs=0.02)  # step_s is rounded
        assert r["peak_alloc_gb"] == 0.0 and r["host_rss_gb"] > 0 and r["pinned_host_gb"] is not None
    # the raw loops train the same LoRA: their gradients against torch's checkpoint's (fp32 CPU, the same operations)
    errs = {r["mode"]: r.get("grad_rel_err_vs_torch_ckpt") for r in rows}
    assert errs["raw-ckpt"] == 0.0
    assert errs["raw-block-ckpt"] < 1e-5 and errs["raw"] < 1e-5, errs
    profile = (tmp_path / "engine_off.txt").read_text()
    assert "block_checkpoint.py" in profile and "loop.py" in profile  # the engine's checkpoint ran in its steps
    assert "| off | raw-block-ckpt |" in (tmp_path / "summary.md").read_text()
