"""bench/report.py: the pin rows get their own section, each figure from its row (hand-written rows)."""
from helpers import bench_module

report = bench_module("report")


def test_pin_rows_are_their_own_section_with_their_figures():
    row = {"date": "2026-11-29T00:42:10+00:00", "bench": "pin", "gpu": "NVIDIA H200", "mode": "engine-t16",
           "pinned_gb": 15.98, "pieces": 47, "pin_s": 1.419, "pin_gbps": 11.264, "copy_gbps": 55.25,
           "host_rss_gb": 17.31, "host_rss_added_gb": 15.98, "command": "python3 bench/bench_pin.py", "note": "n"}
    text = report.render([row])
    assert "## Pinning host memory (bench/bench_pin.py)" in text
    assert ("| 2026-11-29 00:42 | NVIDIA H200 | engine-t16 | 15.98 (47) | 1.419 | 11.26 | 55.2 | 17.31 (15.98) | "
            "`python3 bench/bench_pin.py` (n) |") in text
    assert "_No rows yet._" in text  # not counted as a training row


def test_gil_rows_are_their_own_section_with_their_figures():
    rows = [{"date": "2026-11-29T04:12:19+00:00", "bench": "gil", "gpu": "none (host only)", "python": "3.11.7",
             "mode": "trainers", "switch_interval_ms": 0.2, "steps_per_s_alone": 19.92, "steps_per_s_two_threads": 16.4,
             "both_threads_x_one_alone": 0.823, "host_rss_gb": 0.423, "command": "python bench/gil_contention.py"},
            {"date": "2026-11-29T03:45:25+00:00", "bench": "gil", "gpu": "none (host only)", "python": "3.11.7",
             "mode": "op calls", "switch_interval_ms": 5.0, "op_calls_per_s_alone": 206889,
             "op_calls_per_s_beside_ops": 48177, "both_threads_x_one_alone": 0.466, "host_rss_gb": 0.382,
             "command": "python bench/gil_contention.py"}]
    text = report.render(rows)
    assert "## Two threads under one interpreter lock (bench/gil_contention.py)" in text
    assert ("| 2026-11-29 04:12 | none (host only) | 3.11.7 | trainers | 0.20 | 19.9 | 16.4 | 0.823 | 0.42 | "
            "`python bench/gil_contention.py` |") in text
    assert "| op calls | 5.00 | 206889 | 48177 | 0.466 |" in text
    assert "_No rows yet._" in text and "## ?" not in text  # not counted as training rows
