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
