"""Kernel-level accounting of profiled training steps (issue 26 item 1), from torch.profiler's raw events.

Used by bench/profile_step.py; pure Python over a list of ``Ev`` (no torch needed to analyse), so the
arithmetic is tested on made-up events too (tests/test_profile_step.py).

What one step is: the profiler's ``ProfilerStep#N`` range (prof.step() is called after each training step,
which ends with a device synchronisation), so every kernel of step N starts inside it.

Per step (then averaged over the profiled steps, in ms per step):

- ``wall``: the step's range; ``busy_all`` / ``busy_compute``: the union of kernel, memcpy and memset
  intervals on all streams / on the compute stream (the stream with the most kernel time);
- ``partition``: the step's wall time cut into compute-stream busy time per kernel category plus its idle
  time by gap size, before the first and after the last kernel. The rows add up to ``wall`` exactly, so
  one mode's partition minus another's adds up to the difference of their step times (the diff table);
- ``categories``: kernel time per category on all streams (count and ms; streams overlap, so these add up
  to the kernel total, not to the wall time);
- idle gaps on the compute stream: the largest, and all gaps of 10 us or more grouped by the innermost CPU
  range open at the gap's midpoint on any thread (what the host was doing while the GPU waited);
- top kernels, kernel "signatures" (inductor names without their serial number), CPU ranges named
  ``lowvram::*`` (bench/profile_step.py wraps the engine's streaming functions in them), compiled-region
  entries and CUDA runtime calls.

On a machine without CUDA (the ``--tiny`` check) there are no device kernels: the top-level CPU ops of each
thread stand in for them (``kernels_are_cpu_ops``) and the threads for streams, so the same accounting runs.
"""
from __future__ import annotations

import bisect
import re
from collections import defaultdict
from dataclasses import dataclass

#: Kinds of events: device work, CPU ranges, CUDA runtime calls.
DEVICE_KINDS = ("kernel", "memcpy", "memset")


@dataclass
class Ev:
    kind: str  # kernel | memcpy | memset | annotation | cpu_op | runtime
    name: str
    start: float  # us since the trace started
    end: float
    lane: int  # the CUDA stream for device events, the thread for CPU ones
    corr: int = 0  # CUPTI's correlation id: the same on a kernel (memcpy, memset) and the runtime call that launched it


# ------------------------------------------------------------------------------------------- events

def kineto_events(results) -> list[Ev]:
    """Our events from torch.profiler's results (``prof.profiler.kineto_results``): times in us from the trace's
    start (integer ns are subtracted before the float conversion: absolute ns do not fit a double's mantissa)."""
    raw = list(results.events())
    if not raw:
        return []
    base = results.trace_start_ns() if hasattr(results, "trace_start_ns") else min(_start_ns(e) for e in raw)
    out = []
    for e in raw:
        kind = _kind(e)
        if kind is None:
            continue
        s = _start_ns(e) - base
        d = e.duration_ns() if hasattr(e, "duration_ns") else int(e.duration_us() * 1000)
        corr = int(e.correlation_id()) if kind in DEVICE_KINDS or kind == "runtime" else 0
        out.append(Ev(kind, e.name(), s / 1000.0, (s + max(d, 0)) / 1000.0, int(e.device_resource_id()), corr))
    return out


def _start_ns(e) -> int:
    return e.start_ns() if hasattr(e, "start_ns") else int(e.start_us() * 1000)


_ACTIVITY_KIND = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset", "user_annotation": "annotation",
                  "cpu_op": "cpu_op", "cuda_runtime": "runtime", "cuda_driver": "runtime"}


def _kind(e) -> str | None:
    """Our kind of a kineto event, or None to drop it (device-side copies of CPU ranges, sync markers, ...)."""
    on_device = "CUDA" in str(e.device_type())
    activity = e.activity_type() if hasattr(e, "activity_type") else None
    if activity is not None:
        kind = _ACTIVITY_KIND.get(str(activity))
        if kind is None or (kind in DEVICE_KINDS) != on_device:
            return None
        return kind
    name = e.name()  # older torch: no activity type, guess from the device and the name
    if on_device:
        if e.is_user_annotation() or re.search(r"Sync|Wait Event", name):
            return None
        return "memcpy" if name.startswith("Memcpy") else "memset" if name.startswith("Memset") else "kernel"
    if e.is_user_annotation():
        return "annotation"
    return "runtime" if re.match(r"cu[A-Z]|cuda[A-Z]", name) and "::" not in name else "cpu_op"


def top_level_cpu_ops(events: list[Ev]) -> list[Ev]:
    """CPU ops not inside another CPU op of their thread, as device-kernel stand-ins (CPU-only profiles)."""
    out = []
    by_lane: dict[int, list[Ev]] = defaultdict(list)
    for e in events:
        if e.kind == "cpu_op":
            by_lane[e.lane].append(e)
    for lane, evs in by_lane.items():
        evs.sort(key=lambda e: (e.start, -e.end))
        reach = float("-inf")
        for e in evs:
            if e.start >= reach:
                out.append(Ev("kernel", e.name, e.start, e.end, lane))
            reach = max(reach, e.end)
    return out


# --------------------------------------------------------------------------------------- categories

#: Regular expressions on kernel names, first match wins (case-insensitive). Inductor names its Triton kernels
#: ``triton_{poi|red|per|tem}_fused_<aten ops>_<n>``; cuBLAS on Hopper uses ``nvjet_*`` and ``sm90_xmma_*``.
CATEGORIES = [
    ("nccl", r"nccl"),
    ("attention", r"flash|fmha|attention|sdpa|scaled_dot_product|cudnn"),
    ("int8 dequant (eager triton)", r"dequant"),
    ("gemm", r"gemm|gemv|cutlass|cublas|xmma|nvjet|wgmma|splitkreduce|triton_tem_|^aten::(mm|addmm|bmm|baddbmm|"
             r"matmul|linear|_int_mm|_scaled_mm)$"),
    ("optimizer (multi_tensor_apply)", r"multi_tensor_apply|adam|foreach"),
    ("triton fused (inductor)", r"^triton_|cpp_fused"),
    ("native elementwise/copy/reduce (at::native)", r"at::native|elementwise|reduce_kernel|copy_kernel|catarray|"
                                                     r"index|^aten::"),
]
#: Inductor kernels made of a dtype conversion and a multiply only (views aside): the int8 dequant of a weight
#: (q.float() * scale), but also casts with a scale elsewhere; shown on their own so the diff can tell.
CAST_MUL = "cast*scale (inductor _to_copy+mul only: int8 dequant, some casts)"
_VIEW_OPS = {"view", "unsqueeze", "t", "permute", "expand", "clone", "transpose", "reshape", "squeeze", "slice"}
_COMPILED = [(re.compile(p, re.I), n) for n, p in CATEGORIES]


def category(ev: Ev) -> str:
    if ev.kind == "memcpy":
        m = re.search(r"HtoD|DtoH|DtoD|HtoH|PtoP", ev.name)
        return f"memcpy {m.group(0) if m else 'other'}"
    if ev.kind == "memset":
        return "memset"
    if _is_cast_mul(ev.name):
        return CAST_MUL
    for rx, name in _COMPILED:
        if rx.search(ev.name):
            return name
    return "other"


def _is_cast_mul(name: str) -> bool:
    m = re.match(r"^triton_(?:poi|red|per)_fused_(.*?)(?:_\d+)?$", name)
    if not m:
        return False
    tokens = set(m.group(1).replace("_to_copy", "TOCOPY").replace("convert_element_type", "TOCOPY").split("_")) - {""}
    return "TOCOPY" in tokens and "mul" in tokens and tokens <= {"TOCOPY", "mul"} | _VIEW_OPS


def signature(name: str) -> str:
    """A kernel's name without inductor's serial number (``triton_poi_fused_add_mul_12`` -> ``..._add_mul``), so
    the same fusion in two compiles groups together; other names cut at 160 characters."""
    if name.startswith("triton_"):
        return re.sub(r"_\d+$", "", name)
    return name[:160]


# ---------------------------------------------------------------------------------------- intervals

def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _total(intervals) -> float:
    return sum(e - s for s, e in intervals)


def _overlap(a: tuple[float, float], merged: list[tuple[float, float]], starts: list[float]) -> float:
    """Time of interval ``a`` covered by ``merged`` (sorted, disjoint; ``starts`` their starts)."""
    s, e = a
    i = max(bisect.bisect_right(starts, s) - 1, 0)
    got = 0.0
    while i < len(merged) and merged[i][0] < e:
        got += max(0.0, min(e, merged[i][1]) - max(s, merged[i][0]))
        i += 1
    return got


GAP_BUCKETS = [(10.0, "gaps < 10 us"), (100.0, "gaps 10-100 us"), (1000.0, "gaps 0.1-1 ms"),
               (float("inf"), "gaps >= 1 ms")]
#: Why the compute stream sat idle before a kernel (gaps of DETAIL_US or more), from when its launch call returned:
#: after the gap began (the kernel was not queued yet: the host was late, host-bound), or before (it was queued and
#: waited on the stream: for an event of another stream, e.g. a copy), or no launch call found (CPU-only profiles).
IDLE_SHORT = "idle: gaps < 10 us (launch spacing)"
IDLE_HOST = "idle: host late (next kernel launched after the stream went idle)"
IDLE_COPY = "idle: queued, waiting while a copy ran on another stream"
IDLE_WAIT = "idle: queued, waiting (no copy in flight)"
IDLE_UNKNOWN = "idle: launch call not found"
LEAD, TAIL = "idle: before the first kernel", "idle: after the last kernel"
#: Gaps at least this long (us) are listed with what the host was doing (shorter ones: launch spacing).
DETAIL_US = 10.0


def innermost_at(events: list[Ev], times: list[float], only=None) -> list[Ev | None]:
    """For each time, the innermost CPU range open then (the latest-starting one still open, over all threads;
    ranges of one thread nest), by one sweep over the ranges of each thread in start order."""
    by_lane: dict[int, list[Ev]] = defaultdict(list)
    for e in events:
        if (e.kind in ("annotation", "cpu_op", "runtime") and not e.name.startswith("ProfilerStep#")
                and (only is None or only(e))):
            by_lane[e.lane].append(e)
    lanes = [(sorted(v, key=lambda e: (e.start, -e.end)), [0], []) for v in by_lane.values()]
    out: list[Ev | None] = [None] * len(times)
    for i in sorted(range(len(times)), key=times.__getitem__):
        t, best = times[i], None
        for evs, ptr, stack in lanes:
            while ptr[0] < len(evs) and evs[ptr[0]].start <= t:
                e = evs[ptr[0]]
                ptr[0] += 1
                while stack and stack[-1].end < e.start:
                    stack.pop()
                stack.append(e)
            while stack and stack[-1].end < t:
                stack.pop()
            if stack and (best is None or stack[-1].start > best.start):
                best = stack[-1]
        out[i] = best
    return out


# ------------------------------------------------------------------------------------------ analysis

def step_windows(events: list[Ev]) -> list[tuple[float, float]]:
    steps = sorted((e.start, e.end) for e in events if e.kind == "annotation" and e.name.startswith("ProfilerStep#")
                   and e.end > e.start)
    return steps


def analyze(events: list[Ev], steps: int | None = None, top_kernels: int = 25, top_gaps: int = 10) -> dict:
    """The summary of the profiled steps in ``events`` (see the module docstring; the last ``steps`` of them when
    given); ms per step unless named."""
    windows = step_windows(events)
    if not windows:
        raise ValueError("no ProfilerStep# ranges in the profile: was prof.step() called after each step?")
    windows = windows[-steps:] if steps else windows
    device = [e for e in events if e.kind in DEVICE_KINDS]
    cpu_stand_in = not any(e.kind == "kernel" for e in device)
    if cpu_stand_in:
        device = top_level_cpu_ops(events)
    n = len(windows)
    lane_kernel_us: dict[int, float] = defaultdict(float)
    for e in device:
        lane_kernel_us[e.lane] += e.end - e.start
    compute = max(lane_kernel_us, key=lane_kernel_us.get) if lane_kernel_us else -1
    launches = {e.corr: e.end for e in events if e.kind == "runtime" and e.corr}  # when each launch was enqueued

    acc = _Acc()
    per_step = []
    gaps_all = []
    for k, (ws, we) in enumerate(windows):
        mine = [Ev(e.kind, e.name, e.start, min(e.end, we), e.lane, e.corr) for e in device if ws <= e.start < we]
        on_compute = sorted((e for e in mine if e.lane == compute), key=lambda e: (e.start, e.end))
        others = _union([(e.start, e.end) for e in mine if e.lane != compute])
        copies = _union([(e.start, e.end) for e in mine if e.lane != compute and e.kind == "memcpy"])
        wall = we - ws
        busy_all = _total(_union([(e.start, e.end) for e in mine]))
        part: dict[str, float] = defaultdict(float)
        sizes: dict[str, float] = defaultdict(float)
        reach, prev = ws, None
        inner = []  # (start, end, kernel before, kernel after) of each idle gap between kernels
        for e in on_compute:
            if e.start > reach and prev is not None:
                inner.append((reach, e.start, prev, e))
            s = max(e.start, reach)
            if e.end > s:
                part["busy: " + category(e)] += e.end - s
            reach, prev = max(reach, e.end), e
        busy_compute = sum(part.values())
        part[LEAD] += on_compute[0].start - ws if on_compute else wall
        part[TAIL] += we - reach if on_compute else 0.0
        starts_o, starts_c = [a for a, _ in others], [a for a, _ in copies]
        for (s, e, before, after) in inner:
            sizes[next(label for lim, label in GAP_BUCKETS if e - s < lim)] += e - s
            if e - s < DETAIL_US:
                part[IDLE_SHORT] += e - s
                continue
            copy_us = _overlap((s, e), copies, starts_c)
            launch = launches.get(after.corr) if after.corr else None
            cause = (IDLE_UNKNOWN if launch is None else IDLE_HOST if launch > s
                     else IDLE_COPY if copy_us > 0.5 * (e - s) else IDLE_WAIT)
            part[cause] += e - s
            gaps_all.append({
                "step": k, "at_ms": round((s - ws) / 1e3, 3), "us": round(e - s, 1), "cause": cause.split(": ")[1],
                "launched_us_after_idle": round(launch - s, 1) if launch is not None else None,
                "other_streams_busy_us": round(_overlap((s, e), others, starts_o), 1),
                "copy_in_flight_us": round(copy_us, 1),
                "before": before.name[:120], "after": after.name[:120], "mid": (s + e) / 2})
        per_step.append({"wall_ms": wall / 1e3, "busy_all_ms": busy_all / 1e3, "busy_compute_ms": busy_compute / 1e3,
                         "kernels": sum(1 for e in mine if e.kind == "kernel"),
                         "gaps": len(inner), "gaps_ms": sum(e - s for s, e, _, _ in inner) / 1e3,
                         "partition_ms": {r: v / 1e3 for r, v in part.items()},
                         "gap_sizes_ms": {r: v / 1e3 for r, v in sizes.items()}})
        acc.add_step(mine, events, ws, we)
    # What the host was doing at each gap's middle: its innermost range, and the innermost lowvram:: one.
    mids = [g.pop("mid") for g in gaps_all]
    for g, ctx, low in zip(gaps_all, innermost_at(events, mids),
                           innermost_at(events, mids, only=lambda e: e.name.startswith("lowvram::"))):
        g["cpu"], g["lowvram"] = (ctx.name[:120] if ctx else "-"), (low.name if low else "-")

    mean = lambda key: sum(s[key] for s in per_step) / n  # noqa: E731
    rows = sorted({r for s in per_step for r in s["partition_ms"]})
    partition = {r: sum(s["partition_ms"].get(r, 0.0) for s in per_step) / n for r in rows}
    gap_sizes = {r: sum(s["gap_sizes_ms"].get(r, 0.0) for s in per_step) / n for _, r in GAP_BUCKETS}
    by_ctx: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for g in gaps_all:
        key = f"{g['cause']} | {g['lowvram']} | {g['cpu']}"
        by_ctx[key][0] += 1
        by_ctx[key][1] += g["us"]
    lanes = []
    for lane in sorted(acc.lane_stats, key=lambda l: -acc.lane_stats[l]["busy_us"]):
        st = acc.lane_stats[lane]
        lanes.append({"lane": lane, "role": "compute" if lane == compute else "other",
                      "kernels_per_step": st["kernel"] / n, "memcpy_per_step": st["memcpy"] / n,
                      "memset_per_step": st["memset"] / n, "busy_ms_per_step": st["busy_us"] / n / 1e3})
    return {
        "steps": n, "kernels_are_cpu_ops": cpu_stand_in, "compute_lane": compute,
        "wall_ms": mean("wall_ms"), "busy_all_ms": mean("busy_all_ms"), "busy_compute_ms": mean("busy_compute_ms"),
        "idle_compute_ms": mean("wall_ms") - mean("busy_compute_ms"),
        "kernels_per_step": mean("kernels"), "compute_gaps_per_step": mean("gaps"),
        "compute_gaps_ms": mean("gaps_ms"),
        "partition_ms": partition, "gap_sizes_ms": gap_sizes,
        "categories": {c: {"count": v[0] / n, "ms": v[1] / n / 1e3} for c, v in
                       sorted(acc.cats.items(), key=lambda kv: -kv[1][1])},
        "kernel_total_ms": sum(v[1] for v in acc.cats.values()) / n / 1e3,
        "top_kernels": [{"name": name[:300], "category": acc.kcat[name], "count": v[0] / n, "ms": v[1] / n / 1e3,
                         "mean_us": v[1] / max(v[0], 1)}
                        for name, v in sorted(acc.kernels.items(), key=lambda kv: -kv[1][1])[:top_kernels]],
        "signatures_ms": {s: v / n / 1e3 for s, v in acc.sigs.items()},
        "largest_gaps": sorted(gaps_all, key=lambda g: -g["us"])[:top_gaps],
        "idle_by_cpu_context": [{"context": c, "gaps": v[0] / n, "ms": v[1] / n / 1e3}
                                for c, v in sorted(by_ctx.items(), key=lambda kv: -kv[1][1])[:20]],
        "lowvram_ranges": {k: {"count": v[0] / n, "ms": v[1] / n / 1e3} for k, v in
                           sorted(acc.ranges.items(), key=lambda kv: -kv[1][1])},
        "compiled_regions": {k: v / n for k, v in sorted(acc.compiled.items(), key=lambda kv: -kv[1])},
        "runtime_calls": [{"name": k, "count": v[0] / n, "ms": v[1] / n / 1e3}
                          for k, v in sorted(acc.runtime.items(), key=lambda kv: -kv[1][1])[:15]],
        "lanes": lanes,
        "per_step": [{k: v for k, v in s.items() if k not in ("partition_ms", "gap_sizes_ms")} for s in per_step],
    }


_COMPILED_REGION = re.compile(r"Torch-Compiled Region|CompiledFunction|CompiledFxGraph|cudaGraphLaunch|"
                              r"TorchDynamo|## Call", re.I)


class _Acc:
    """Sums over the profiled steps."""

    def __init__(self):
        self.cats = defaultdict(lambda: [0, 0.0])
        self.kernels = defaultdict(lambda: [0, 0.0])
        self.kcat: dict[str, str] = {}
        self.sigs = defaultdict(float)
        self.ranges = defaultdict(lambda: [0, 0.0])
        self.compiled = defaultdict(int)
        self.runtime = defaultdict(lambda: [0, 0.0])
        self.lane_stats = defaultdict(lambda: {"kernel": 0, "memcpy": 0, "memset": 0, "busy_us": 0.0, "iv": []})

    def add_step(self, mine: list[Ev], events: list[Ev], ws: float, we: float) -> None:
        per_lane = defaultdict(list)
        for e in mine:
            d = e.end - e.start
            c = category(e)
            self.cats[c][0] += 1
            self.cats[c][1] += d
            self.kernels[e.name][0] += 1
            self.kernels[e.name][1] += d
            self.kcat[e.name] = c
            self.sigs[signature(e.name)] += d
            self.lane_stats[e.lane][e.kind] += 1
            per_lane[e.lane].append((e.start, e.end))
        for lane, iv in per_lane.items():
            self.lane_stats[lane]["busy_us"] += _total(_union(iv))
        for e in events:
            if not (ws <= e.start < we) or e.kind in DEVICE_KINDS:
                continue
            if e.name.startswith("lowvram::"):
                self.ranges[e.name][0] += 1
                self.ranges[e.name][1] += min(e.end, we) - e.start
            if e.kind == "runtime":
                self.runtime[e.name][0] += 1
                self.runtime[e.name][1] += e.end - e.start
            if _COMPILED_REGION.search(e.name):
                self.compiled[e.name[:100]] += 1


# --------------------------------------------------------------------------------------------- diffs

def diff(base: dict, other: dict, key: str = "partition_ms") -> list[tuple[str, float, float, float]]:
    """(row, base ms, other ms, other - base) for every row of ``key`` in either summary, largest change first;
    the partition's rows add up to each mode's wall time, so the differences add up to the step-time difference."""
    a, b = base[key], other[key]
    val = (lambda d, r: d.get(r, {}).get("ms", 0.0)) if key == "categories" else (lambda d, r: d.get(r, 0.0))
    rows = [(r, val(a, r), val(b, r), val(b, r) - val(a, r)) for r in set(a) | set(b)]
    return sorted(rows, key=lambda r: -abs(r[3]))


# ------------------------------------------------------------------------------------------ markdown

def _t(header: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v).replace("|", "/") for v in row) + " |" for row in rows]
    return "\n".join(lines)


def mode_markdown(label: str, s: dict, extra: dict) -> str:
    unit = "CPU ops (no CUDA: top-level CPU ops stand in for kernels)" if s["kernels_are_cpu_ops"] else "kernels"
    out = [f"## {label}", "",
           f"- step without the profiler (median of the timed steps): {extra.get('step_s_unprofiled')} s; "
           f"profiled steps: {', '.join(f'{x:.3f}' for x in extra.get('step_s_profiled', []))} s (the loop's own "
           f"clock; the recorded step before them, left out: {extra.get('step_s_recorded_dropped')} s); profiled "
           f"range {s['wall_ms']:.1f} ms/step over {s['steps']} steps",
           f"- GPU busy: {s['busy_all_ms']:.1f} ms on all streams, {s['busy_compute_ms']:.1f} ms on the compute "
           f"stream ({s['compute_lane']}); compute stream idle {s['idle_compute_ms']:.1f} ms/step, of which "
           f"{s['compute_gaps_ms']:.1f} ms in {s['compute_gaps_per_step']:.0f} gaps between {unit}",
           f"- {s['kernels_per_step']:.0f} {unit} per step; {s['kernel_total_ms']:.1f} ms of them (all streams)", ""]
    out += ["Streams:", "", _t(["stream", "role", "kernels/step", "memcpy/step", "memset/step", "busy ms/step"],
                                [[l["lane"], l["role"], f"{l['kernels_per_step']:.0f}", f"{l['memcpy_per_step']:.0f}",
                                  f"{l['memset_per_step']:.0f}", l["busy_ms_per_step"]] for l in s["lanes"]]), ""]
    out += ["Wall time of a step, cut on the compute stream (rows add up to the step):", "",
            _t(["row", "ms/step"], [[r, v] for r, v in sorted(s["partition_ms"].items(), key=lambda kv: -kv[1])]
               + [["**total**", sum(s["partition_ms"].values())]]), ""]
    out += ["Idle gaps between kernels on the compute stream by size:", "",
            _t(["size", "ms/step"], [[r, v] for r, v in s["gap_sizes_ms"].items()]), ""]
    out += ["Kernel time by category, all streams:", "",
            _t(["category", "count/step", "ms/step"], [[c, f"{v['count']:.0f}", v["ms"]] for c, v in
                                                       s["categories"].items()] + [["**total**", "", s["kernel_total_ms"]]]), ""]
    out += [f"Top {len(s['top_kernels'])} {unit} by time:", "",
            _t(["name", "category", "count/step", "ms/step", "mean us"],
               [[k["name"][:110], k["category"], f"{k['count']:.0f}", k["ms"], f"{k['mean_us']:.1f}"]
                for k in s["top_kernels"]]), ""]
    out += ["Largest idle gaps on the compute stream (the host's innermost range at the gap's middle):", "",
            _t(["step", "at ms", "us", "cause", "launched us after idle", "copy in flight us", "other streams busy us",
                "lowvram range", "CPU", "after"],
               [[g["step"], g["at_ms"], g["us"], g["cause"], g["launched_us_after_idle"], g["copy_in_flight_us"],
                 g["other_streams_busy_us"], g["lowvram"], g["cpu"][:60], g["after"][:60]]
                for g in s["largest_gaps"]]), ""]
    out += ["Idle gaps of 10 us or more, by cause and what the host was doing at their middle (cause | lowvram range "
            "| innermost CPU range):", "",
            _t(["context", "gaps/step", "ms/step"], [[c["context"][:120], f"{c['gaps']:.0f}", c["ms"]]
                                                     for c in s["idle_by_cpu_context"]]), ""]
    if s["lowvram_ranges"]:
        out += ["CPU time in the engine's streaming code (lowvram:: ranges, inclusive; nested ranges count in both):",
                "", _t(["range", "count/step", "ms/step"], [[k, f"{v['count']:.0f}", v["ms"]]
                                                            for k, v in s["lowvram_ranges"].items()]), ""]
    if s["compiled_regions"]:
        out += ["Compiled-region entries per step:", "",
                _t(["name", "count/step"], [[k, f"{v:.0f}"] for k, v in s["compiled_regions"].items()]), ""]
    if s["runtime_calls"]:
        out += ["CUDA runtime calls (host time):", "",
                _t(["call", "count/step", "ms/step"], [[r["name"], f"{r['count']:.0f}", r["ms"]]
                                                       for r in s["runtime_calls"]]), ""]
    return "\n".join(out)


def diff_markdown(base_label: str, base: dict, label: str, other: dict, top: int = 30) -> str:
    rows = diff(base, other)
    total = [sum(r[1] for r in rows), sum(r[2] for r in rows), sum(r[3] for r in rows)]
    out = [f"## {label} minus {base_label}", "",
           f"Step (profiled range): {base['wall_ms']:.1f} -> {other['wall_ms']:.1f} ms "
           f"({other['wall_ms'] - base['wall_ms']:+.1f} ms). The rows cut each step on its compute stream; their "
           f"differences add up to the step-time difference.", "",
           _t(["row", f"{base_label} ms", f"{label} ms", "diff ms"], [list(r) for r in rows] + [["**total**", *total]]),
           "", "Kernel time by category, all streams (overlapping streams: not a cut of the step):", "",
           _t(["category", f"{base_label} ms", f"{label} ms", "diff ms"], [list(r) for r in diff(base, other, "categories")]),
           "", f"Kernel signatures (inductor names without their serial number), the {top} largest changes:", "",
           _t(["signature", f"{base_label} ms", f"{label} ms", "diff ms"],
              [[r[0][:110], r[1], r[2], r[3]] for r in diff(base, other, "signatures_ms")[:top]]), ""]
    return "\n".join(out)
