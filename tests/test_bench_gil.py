"""bench/gil_contention.py: the busy threads' share of the interpreter lock, which bench_memory --contend reports."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from gil_contention import Contention  # noqa: E402


def test_share_is_the_busy_rate_over_the_marked_steps_against_one_thread_alone():
    c = Contention(1)
    c.alone_rate = 1000.0
    c.marks = [(0.0, 0), (1.0, 500), (3.0, 1500)]
    assert c.share(0) == 0.5 and c.share(1) == 0.5
    assert c.share(2) is None and c.share(-1) is None  # one mark, or no warm-up step: no span
    assert Contention(0).share(0) is None


def _share_while(work) -> float:
    with Contention(1, probe_s=0.2) as c:
        c.mark()
        work()
        c.mark()
    return c.share(0)


def test_a_step_that_holds_the_lock_leaves_the_busy_thread_less_than_one_that_waits():
    def python_loop():  # a launching thread that never lets go of the lock on its own
        end = time.perf_counter() + 0.4
        n = 0
        while time.perf_counter() < end:
            n += 1

    waiting = _share_while(lambda: time.sleep(0.4))  # a thread blocked on the GPU lets go of the lock
    holding = _share_while(python_loop)
    # Alone, the busy thread keeps its rate (about 1); against a Python loop it gets about half the lock.
    assert holding < 0.8 * waiting, (holding, waiting)
