"""Busy threads beside a training run, to measure how much its step needs the interpreter lock.

The pipelined split (engine/parallel/pipeline.py) drives both GPUs from one process: each micro-batch's forward and
its checkpointed recompute are Python, so the two GPUs' threads take turns on one interpreter lock. On one GPU this
cannot be timed as a split, but its cause can: ``Contention(n)`` runs ``n`` busy threads while the run trains. A
step that slows down beside them was waiting on Python, not on the GPU; ``share()`` is how much of the lock the
busy threads got over the marked steps, against one such thread alone. Two kinds:

- ``python``: a pure Python loop, which gives the lock up only when the switch interval
  (``sys.setswitchinterval``, 5 ms by default) forces it. torch gives the lock up around every operator call, so
  beside such a loop each call of the step can wait a whole interval (the worst case: a long Python stretch in one
  pipeline thread);
- ``ops``: a loop of one-element CPU torch operators, each of which gives the lock up and takes it back as a
  launching thread does (the other GPU's thread of a pipelined split, which calls an operator every few
  microseconds).

Run alone (``python3 bench/gil_contention.py``), it measures the second effect on the host itself: how many operator
calls per second one thread makes alone and beside an ``ops`` thread, at several switch intervals. With
``--trainers`` (``--device cuda:0`` for real launches), the same for a whole training step's operator mix: a tiny
Flux.1 with LoRA and gradient checkpointing, one trainer alone against two on two threads at once.

Why not the profiler: its CPU tracing slows the launching thread itself (Flux.1-dev batch 1: 431 ms of "host late"
idle profiled against a 0.913 s unprofiled step with 0.834 s of kernels), so it overstates the host's share.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Callable

KINDS = ("python", "ops")


class Contention:
    """``with Contention(n) as c:`` n busy Python threads while the block runs; ``c.mark()`` at each step's end,
    ``c.share(first)`` the busy threads' loop rate from mark ``first`` to the last, over one thread's rate alone."""

    def __init__(self, threads: int, probe_s: float = 0.5, kind: str = "python"):
        if kind not in KINDS:
            raise ValueError(f"contention kind {kind!r} is not one of {', '.join(KINDS)}")
        self.threads, self.probe_s, self.kind = threads, probe_s, kind
        self.counts = [0] * threads
        self.marks: list[tuple[float, int]] = []
        self.alone_rate = None
        self._stop = threading.Event()
        self._workers: list[threading.Thread] = []

    def _spin(self, i: int) -> None:
        n, stop = 0, self._stop.is_set
        if self.kind == "ops":
            import torch

            x, y = torch.zeros(1), torch.zeros(1)
            while not stop():
                torch.add(x, 1, out=y)
                n += 1
                if not n & 63:
                    self.counts[i] = n
        else:
            while not stop():
                n += 1
                if not n & 1023:
                    self.counts[i] = n
        self.counts[i] = n

    def _total(self) -> int:
        return sum(self.counts)

    def __enter__(self) -> "Contention":
        if self.kind == "ops":
            import torch  # noqa: F401 - before the probe: a first import inside it would be counted as no calls
        self._stop.clear()  # the object may be entered again
        self.counts, self.marks, self.alone_rate = [0] * self.threads, [], None
        if self.threads:
            self._workers = [threading.Thread(target=self._spin, args=(i,), daemon=True, name=f"contender {i}")
                             for i in range(self.threads)]
            try:
                self._workers[0].start()  # one alone first: the rate the others' shares are against
                time.sleep(0.05)
                t0, c0 = time.perf_counter(), self._total()
                time.sleep(self.probe_s)
                self.alone_rate = (self._total() - c0) / (time.perf_counter() - t0)
                for w in self._workers[1:]:
                    w.start()
            except BaseException:  # Ctrl-C in the probe: no thread left spinning
                self.__exit__()
                raise
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for w in self._workers:
            if w.is_alive():
                w.join()

    def rate_between(self, first: int, last: int) -> float | None:
        """The busy threads' loops per second between two marks."""
        (t0, c0), (t1, c1) = self.marks[first], self.marks[last]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else None

    def mark(self) -> None:
        self.marks.append((time.perf_counter(), self._total()))

    def share(self, first: int) -> float | None:
        """The busy threads' loop rate over marks[first:] as a fraction of one thread's rate alone (1.0: the run
        left the lock free; 0.5: the run held it half the time, or wanted it all the time against one busy
        thread)."""
        if not self.threads or not self.alone_rate or len(self.marks) <= first + 1 or first < 0:
            return None
        rate = self.rate_between(first, -1)
        return round(rate / self.alone_rate, 3) if rate is not None else None


def op_rate(seconds: float) -> float:
    """One-element CPU torch operator calls per second from this thread."""
    import torch

    a, b = torch.zeros(1), torch.zeros(1)
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.add(a, 1, out=b)
        n += 1
    return n / seconds


def tiny_flux_steps(steps: int, device: str = "cpu") -> Callable[[], float]:
    """A training step's operator sequence at a size where the operators cost their host time only: a tiny Flux.1
    (2 double, 4 single blocks) with a rank-4 LoRA (peft, through diffusers' add_adapter) and gradient checkpointing,
    forward + backward on one sample. Returns a function that runs ``steps`` steps and gives steps per second."""
    import torch
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=4,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=32, axes_dims_rope=[4, 6, 6]).to(device)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_mlp",
                                                                    "proj_out", "ff.net.0.proj", "ff.net.2"]))
    model.enable_gradient_checkpointing()
    model.train()
    x = dict(hidden_states=torch.randn(1, 16, 16, device=device),
             encoder_hidden_states=torch.randn(1, 8, 32, device=device),
             pooled_projections=torch.randn(1, 32, device=device), timestep=torch.tensor([0.5], device=device),
             img_ids=torch.zeros(16, 3, device=device), txt_ids=torch.zeros(8, 3, device=device), guidance=None,
             return_dict=False)

    def run() -> float:
        t = time.perf_counter()
        for _ in range(steps):
            model(**x)[0].float().pow(2).mean().backward()
        if device != "cpu":
            torch.cuda.synchronize(device)
        return steps / (time.perf_counter() - t)

    run()  # warm-up
    return run


def two_trainers(steps: int, device: str) -> tuple[float, float]:
    """(steps/s of one tiny trainer alone, steps/s of two such trainers on two threads at once, summed)."""
    first, second = tiny_flux_steps(steps, device), tiny_flux_steps(steps, device)
    alone = first()
    rates = [0.0, 0.0]

    def work(i, run):
        rates[i] = run()

    threads = [threading.Thread(target=work, args=(i, r)) for i, r in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return alone, sum(rates)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Operator calls per second, alone and beside a thread of operator calls; "
                                            "with --trainers, two tiny training loops alone and at once")
    p.add_argument("--intervals-ms", type=float, nargs="+", default=[5.0, 1.0, 0.5, 0.2, 0.1])
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--trainers", action="store_true",
                   help="instead of bare operator calls: a tiny Flux.1 with LoRA and checkpointing trained on one "
                        "thread, then two on two threads at once (as the pipelined split's two GPUs' threads)")
    p.add_argument("--device", default="cpu", help="--trainers: where the tiny models run (cuda:0: real launches)")
    p.add_argument("--steps", type=int, default=40, help="--trainers: steps per measurement")
    p.add_argument("--out", default="", help="also append one row per interval to this results.jsonl")
    args = p.parse_args(argv)
    import statistics

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_bench import _command, _versions, new_run_id

    from lowvram_lora.engine.offload.hostmem import host_rss_bytes

    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)  # the operators' own work stays on this thread: the lock is what is measured
    default = sys.getswitchinterval()
    run_id = new_run_id()
    samples = {ms: [] for ms in args.intervals_ms}
    try:
        for _ in range(args.repeats):  # the intervals alternate within each repeat: a drift of the host hits all
            for ms in args.intervals_ms:
                sys.setswitchinterval(ms / 1e3)
                if args.trainers:
                    samples[ms].append(two_trainers(args.steps, args.device))
                    continue
                alone = op_rate(args.seconds)
                with Contention(1, probe_s=0.1, kind="ops") as c:
                    c.mark()
                    beside = op_rate(args.seconds)
                    c.mark()
                samples[ms].append((alone, beside, c.rate_between(0, 1) or 0.0))
    finally:
        sys.setswitchinterval(default)
        torch.set_num_threads(threads_before)
    for ms in args.intervals_ms:
        med = [statistics.median(x[k] for x in samples[ms]) for k in range(len(samples[ms][0]))]
        row = {"date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "run_id": run_id, "bench": "gil",
               **_versions(), "command": _command(), "switch_interval_ms": ms, "repeats": args.repeats}
        if args.trainers:
            a, both = med
            row.update(gpu=args.device if args.device != "cpu" else "none (host only)", mode="trainers",
                       steps_per_s_alone=round(a, 2), steps_per_s_two_threads=round(both, 2),
                       both_threads_x_one_alone=round(both / a, 3))
            print(f"switch interval {ms:5.2f} ms: one tiny trainer {a:6.1f} steps/s alone; two on two threads "
                  f"{both:6.1f} steps/s together ({both / a:.3f}x one alone; medians of {args.repeats})", flush=True)
        else:
            a, b, other = med
            row.update(gpu="none (host only)", mode="op calls", op_calls_per_s_alone=round(a),
                       op_calls_per_s_beside_ops=round(b), op_calls_per_s_contender=round(other),
                       x_alone=round(b / a, 3), both_threads_x_one_alone=round((b + other) / a, 3))
            print(f"switch interval {ms:5.2f} ms: {a:9.0f} op calls/s alone; beside an op thread {b:9.0f} + its "
                  f"{other:9.0f} = {(b + other) / a:.3f}x one alone (medians of {args.repeats})", flush=True)
        row.update(host_rss_gb=round(host_rss_bytes() / 1e9, 3), pinned_host_gb=0.0,
                   peak_alloc_gb=round(torch.cuda.max_memory_allocated() / 1e9, 3)
                   if args.device != "cpu" and torch.cuda.is_available() else 0.0)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
