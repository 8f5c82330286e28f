"""bench/gil_contention.py: the busy threads' share of the interpreter lock, which bench_memory --contend reports."""
import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from gil_contention import Contention, main  # noqa: E402


def test_share_is_the_busy_rate_over_the_marked_steps_against_one_thread_alone():
    c = Contention(1)
    c.alone_rate = 1000.0
    c.marks = [(0.0, 0), (1.0, 500), (3.0, 1500)]
    assert c.share(0) == 0.5 and c.share(1) == 0.5
    assert c.share(2) is None and c.share(-1) is None  # one mark, or no warm-up step: no span
    assert Contention(0).share(0) is None


@pytest.mark.parametrize("kind", ["python", "ops"])
def test_a_step_that_holds_the_lock_leaves_the_busy_thread_less_than_one_that_waits(kind):
    """One busy thread, two adjacent windows: while this thread sleeps (as one blocked on the GPU, which lets go of the
    lock) the busy thread runs at its own rate; while this thread loops in pure Python (it lets go only when the switch
    interval forces it) the busy thread gets about half the lock."""
    def python_loop(seconds):
        end = time.perf_counter() + seconds
        n = 0
        while time.perf_counter() < end:
            n += 1

    with Contention(1, probe_s=0.2, kind=kind) as c:
        c.mark()
        time.sleep(0.6)
        c.mark()
        python_loop(0.6)
        c.mark()
    waiting, holding = c.rate_between(0, 1), c.rate_between(1, 2)
    assert holding < 0.8 * waiting, (holding, waiting)


def test_a_contention_can_be_entered_again():
    c = Contention(1, probe_s=0.05)
    for _ in range(2):
        with c:
            c.mark()
            time.sleep(0.1)
            c.mark()
        assert c.alone_rate > 0 and len(c.marks) == 2
        assert c.share(0) == pytest.approx(c.rate_between(0, 1) / c.alone_rate, abs=1e-3)  # this entry's own marks
    assert not any(w.is_alive() for w in c._workers)


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="python, ops"):
        Contention(1, kind="spin")


def test_the_host_bench_writes_its_rates_and_puts_the_switch_interval_back(tmp_path):
    import torch

    before, threads = sys.getswitchinterval(), torch.get_num_threads()
    out = tmp_path / "rows.jsonl"
    main(["--intervals-ms", "0.5", "--seconds", "0.2", "--repeats", "1", "--out", str(out)])
    assert sys.getswitchinterval() == before
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["switch_interval_ms"] == 0.5 and row["host_rss_gb"] > 0
    a, b, other = row["op_calls_per_s_alone"], row["op_calls_per_s_beside_ops"], row["op_calls_per_s_contender"]
    assert a > 1000 and b > 0 and other > 0  # the contender's own calls are counted, not assumed equal to this one's
    assert row["x_alone"] == pytest.approx(b / a, abs=1e-3)
    assert row["both_threads_x_one_alone"] == pytest.approx((b + other) / a, abs=2e-3)
    assert torch.get_num_threads() == threads  # the bench's one thread is put back


def test_two_tiny_trainers_report_their_rates_against_one_alone(tmp_path):
    """--trainers: a tiny Flux.1 with LoRA and checkpointing, trained on one thread, then two at once; the row's ratio
    is the two threads' summed rate over one alone."""
    out = tmp_path / "rows.jsonl"
    main(["--trainers", "--intervals-ms", "5", "--steps", "3", "--repeats", "1", "--out", str(out)])
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["mode"] == "trainers" and row["steps_per_s_alone"] > 0 and row["steps_per_s_two_threads"] > 0
    assert row["both_threads_x_one_alone"] == pytest.approx(row["steps_per_s_two_threads"] / row["steps_per_s_alone"],
                                                            abs=0.01)
