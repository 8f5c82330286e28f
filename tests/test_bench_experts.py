"""bench/bench_experts.py's CPU smoke (issue 42): both tiny Wan experts as int8 slabs, trained at once through Dual-GPU
Split mode experts on cpu + cpu and one after the other through the one-expert entry; the rows it writes and the four
LoRA files it saves, read back here: each expert's experts-mode LoRA equals its one-expert run's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_experts.py"


def test_the_experts_bench_smoke_trains_both_ways_to_the_same_loras(tmp_path):
    out = tmp_path / "rows.jsonl"
    cmd = [sys.executable, str(BENCH), "--device", "cpu", "--variant", "wan-tiny-high-noise", "--res", "64x48x5",
           "--steps", "2", "--clips", "1", "--rank", "2", "--lr", "1e-2", "--workdir", str(tmp_path / "work"),
           "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["mode"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"experts", "serial", "summary"}
    assert len({r["run_id"] for r in rows.values()}) == 1
    for r in rows.values():  # the bench rows' common fields
        assert r["bench"] == "experts" and r["torch"] == torch.__version__ and "bench_experts.py" in r["command"]
        assert r["model"] == "wan-tiny-high-noise + wan-tiny-low-noise" and r["date"] and r["gpu"]
    experts, serial, summary = rows["experts"], rows["serial"], rows["summary"]
    assert "error" not in experts and "error" not in serial
    assert [e["role"] for e in experts["experts"]] == ["high_noise", "low_noise"] == [e["role"] for e in serial["experts"]]
    assert len(experts["peak_alloc_gb_per_gpu"]) == 2 and len(serial["peak_alloc_gb_per_gpu"]) == 1
    assert len(experts["experts"][0]["step_times"]) == 2 and len(experts["experts"][1]["step_times"]) == 1
    assert experts["host_workers_peak_gb"] > 0.05  # the two worker processes were sampled
    assert experts["wall_s"] > 0 and serial["wall_s"] > 0
    assert summary["x_serial"] == round(experts["wall_s"] / serial["wall_s"], 3)
    assert summary["loras_match"] is True and summary["match_rtol"] == 1e-6
    # The files themselves, compared here: the same LoRA from both modes, and the two experts' differ (not vacuous).
    loras = tmp_path / "work" / "loras"
    got = {f"{mode}_{role}": load_file(str(loras / f"{mode}_{role}.safetensors"))
           for mode in ("experts", "serial") for role in ("high_noise", "low_noise")}
    for role in ("high_noise", "low_noise"):
        a, b = got[f"experts_{role}"], got[f"serial_{role}"]
        assert a.keys() == b.keys() and len(a) > 0
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)
    high, low = got["serial_high_noise"], got["serial_low_noise"]
    assert max(float((high[k].float() - low[k].float()).abs().max()) for k in high) > 1e-4
    assert any(float(v.float().abs().max()) > 0 for k, v in high.items() if "lora_B" in k or "lora_up" in k)
