"""Busy Python threads beside a training run, to measure how much its step needs the interpreter lock.

The pipelined split (engine/parallel/pipeline.py) drives both GPUs from one process: each micro-batch's forward and
its checkpointed recompute are Python, so the two GPUs' threads take turns on one interpreter lock. On one GPU this
cannot be timed as a split, but its cause can: ``Contention(n)`` runs ``n`` threads that loop in pure Python (each
wants the lock all the time, as the other GPU's thread does while it launches a forward) while the run trains. A
step that slows down beside them was waiting on Python, not on the GPU; ``share()`` is how much of the lock the
busy threads got over the marked steps, against one such thread alone.

Why not the profiler: its CPU tracing slows the launching thread itself (Flux.1-dev batch 1: 431 ms of "host late"
idle profiled against a 0.913 s unprofiled step with 0.834 s of kernels), so it overstates the host's share.
"""
from __future__ import annotations

import threading
import time


class Contention:
    """``with Contention(n) as c:`` n busy Python threads while the block runs; ``c.mark()`` at each step's end,
    ``c.share(first)`` the busy threads' loop rate from mark ``first`` to the last, over one thread's rate alone."""

    def __init__(self, threads: int, probe_s: float = 0.5):
        self.threads, self.probe_s = threads, probe_s
        self.counts = [0] * threads
        self.marks: list[tuple[float, int]] = []
        self.alone_rate = None
        self._stop = threading.Event()
        self._workers: list[threading.Thread] = []

    def _spin(self, i: int) -> None:
        n, stop = 0, self._stop.is_set
        while not stop():
            n += 1
            if not n & 1023:
                self.counts[i] = n
        self.counts[i] = n

    def _total(self) -> int:
        return sum(self.counts)

    def __enter__(self) -> "Contention":
        if self.threads:
            self._workers = [threading.Thread(target=self._spin, args=(i,), daemon=True, name=f"contender {i}")
                             for i in range(self.threads)]
            self._workers[0].start()  # one alone first: the rate the others' shares are against
            time.sleep(0.05)
            t0, c0 = time.perf_counter(), self._total()
            time.sleep(self.probe_s)
            self.alone_rate = (self._total() - c0) / (time.perf_counter() - t0)
            for w in self._workers[1:]:
                w.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for w in self._workers:
            w.join()

    def mark(self) -> None:
        self.marks.append((time.perf_counter(), self._total()))

    def share(self, first: int) -> float | None:
        """The busy threads' loop rate over marks[first:] as a fraction of one thread's rate alone (1.0: the run
        left the lock free; 0.5: the run held it half the time, or wanted it all the time against one busy
        thread)."""
        if not self.threads or not self.alone_rate or len(self.marks) <= first + 1 or first < 0:
            return None
        (t0, c0), (t1, c1) = self.marks[first], self.marks[-1]
        return round((c1 - c0) / (t1 - t0) / self.alone_rate, 3) if t1 > t0 else None
