"""bench/bench_experts.py's CPU smoke (issue 42): both tiny Wan experts as int8 slabs, trained at once through Dual-GPU
Split mode experts on cpu + cpu and one after the other through the one-expert entry; the rows it writes and the four
LoRA files it saves, read back here: each expert's experts-mode LoRA equals its one-expert run's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import bench_module
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
    # the time outside the steps, by part: the run's start-up and end; in experts mode each worker's start and exit
    for e in experts["experts"] + serial["experts"]:
        assert e["startup_s"]["total"] > 0 and e["finish_s"] >= 0
    assert all(e["worker_ready_s"] > 0 and e["worker_exit_s"] >= 0 for e in experts["experts"])
    assert not any("worker_ready_s" in e for e in serial["experts"])
    assert all(e["wall_s"] > e["startup_s"]["total"] + e["finish_s"] for e in serial["experts"])
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


def test_a_serial_pair_split_over_two_calls_joins_into_one_summary(tmp_path):
    """``--roles`` runs one one-expert run per call (a 16-step Wan pair exceeds one machine call); ``--summarize`` joins
    the newest experts row with the newest serial row of each role of the same settings: the serial wall is the two
    runs' sum (back to back), an older or differently-set row is not taken, and the LoRA files are compared (a
    difference planted in one expert's file is found at its true size)."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    bench = bench_module("bench_experts")
    base = {"bench": "experts", "res": "64x48x5", "steps": 4, "budget_gb_per_gpu": 8.0, "seed": 1, "lora_rank": 2,
            "clips": 1, "model": "wan-tiny-high-noise + wan-tiny-low-noise"}

    def run(role, wall, losses, **kw):
        return {"role": role, "wall_s": wall, "step_s": 2.0, "losses": losses, "peak_alloc_gb": 1.0, **kw}

    rows = [
        {**base, "run_id": "old", "mode": "serial", "wall_s": 99.0, "peak_alloc_gb_per_gpu": [9.0],
         "experts": [run("high_noise", 99.0, [9.0, 9.0, 9.0, 9.0])]},
        {**base, "run_id": "e", "mode": "experts", "wall_s": 13.0, "peak_alloc_gb_per_gpu": [1.0, 1.1],
         "host_peak_gb": 3.0, "experts": [run("high_noise", None, [1.0, 0.9, 0.8, 0.7]),
                                          run("low_noise", None, [2.0, 1.9, 1.8, 1.7])]},
        {**base, "run_id": "h", "mode": "serial", "wall_s": 11.0, "peak_alloc_gb_per_gpu": [1.0], "host_peak_gb": 2.0,
         "experts": [run("high_noise", 11.0, [1.0, 0.9, 0.8, 0.7])]},
        {**base, "run_id": "other", "mode": "serial", "steps": 3, "wall_s": 1.0, "peak_alloc_gb_per_gpu": [1.0],
         "experts": [run("low_noise", 1.0, [0.0, 0.0, 0.0])]},
        {**base, "run_id": "l", "mode": "serial", "wall_s": 12.0, "peak_alloc_gb_per_gpu": [1.2], "host_peak_gb": 2.5,
         "experts": [run("low_noise", 12.0, [2.0, 1.9, 1.8, 1.75])]},
    ]
    out = tmp_path / "rows.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loras = tmp_path / "loras"
    loras.mkdir()
    g = torch.Generator().manual_seed(0)
    for role in ("high_noise", "low_noise"):
        ref = {"a.lora_A.weight": torch.randn(2, 8, generator=g), "a.lora_B.weight": torch.randn(8, 2, generator=g)}
        save_file(ref, str(loras / f"serial_{role}.safetensors"))
        got = dict(ref)
        if role == "low_noise":
            got["a.lora_B.weight"] = ref["a.lora_B.weight"] * 1.01  # a 1% relative difference
        save_file(got, str(loras / f"experts_{role}.safetensors"))

    emitted = []
    args = SimpleNamespace(out=str(out), res=base["res"], steps=4, budget=8.0, seed=1, rank=2, clips=1,
                           project_steps=100, match_rtol=1e-3)
    bench.summarize_rows(args, lambda row: emitted.append(row) or row, loras, cuda=False)
    (s,) = emitted
    assert s["from_runs"] == ["e", "h", "l"]
    assert s["serial_wall_s"] == 23.0 and s["experts_wall_s"] == 13.0 and s["x_serial"] == round(13 / 23, 3)
    assert s["serial_peak_alloc_gb_per_gpu"] == [1.2] and s["serial_host_peak_gb"] == 2.5
    # Projection: each further step costs both serial steps (2 + 2 s) and the slower expert's (2 s) side by side.
    assert s["serial_fixed_s"] == 23.0 - 4 * 4.0 and s["experts_fixed_s"] == 13.0 - 4 * 2.0
    assert s["x_serial_projected"] == round((13 + 96 * 2) / (23 + 96 * 4), 3)
    high, low = s["lora_diff"]["high_noise"], s["lora_diff"]["low_noise"]
    assert high["bit_equal"] and high["max_rel_diff"] == 0.0 and high["loss_max_diff"] == 0.0
    b = load_file(str(loras / "serial_low_noise.safetensors"))["a.lora_B.weight"]
    assert not low["bit_equal"] and abs(low["max_rel_diff"] - 0.01) < 1e-6
    assert abs(low["max_abs_diff"] - float((b * 0.01).abs().max())) < 1e-6 and low["loss_max_diff"] == 0.05
    assert s["loras_match"] is False and s["match_rtol"] == 1e-3  # 1% is over the 1e-3 asked


def test_a_continuing_call_stops_at_once_where_the_slabs_are_gone(tmp_path):
    """``--no-build`` (a call continuing an earlier one, on a machine that may be a fresh one): no slab in --workdir
    is a named stop before anything is built or trained, and nothing is written."""
    bench = bench_module("bench_experts")
    out = tmp_path / "rows.jsonl"
    with pytest.raises(SystemExit, match="no slab of wan-tiny-high-noise, wan-tiny-low-noise in .*build them first"):
        bench.main(["--device", "cpu", "--variant", "wan-tiny-high-noise", "--modes", "serial", "--no-build",
                    "--workdir", str(tmp_path / "work"), "--out", str(out)])
    assert not out.exists() and not list((tmp_path / "work").glob("*.safetensors"))
