"""What holds a GPU's memory at its peak, by the line that allocated it: torch's allocator history
(``torch.cuda.memory._record_memory_history``), summarized in-process as JSON (never a pickle written and read back).

Why: the first GPU of a pipelined Flux.2-dev split peaks 1.0-1.4 GB above its plan (2x H200, 2026-11-28), and under
the per-GPU allocator cap that is an out-of-memory. ``torch.cuda.max_memory_allocated`` says how much, not what; this
says what, in one bench call:

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/bench_parallel.py ... --memory-history 400000

writes, beside ``--out``, ``memory_<mode>_r<rank>.json`` after each mode (each device's trace replayed to its peak:
the allocations alive then, grouped by the first line outside torch that made them) and, on an out-of-memory,
``oom_memory_r<rank>.json`` (every live block at that moment, grouped the same way). Each device keeps its last
``max_entries`` events; allocations made before the oldest one kept (the model's weights at placement, for a long
run) are not in the replay, so its peak is counted above the trace's start (frees of those older blocks lower it),
and the totals say so.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

#: Frames inside these paths are the machinery, not the code that asked for the memory.
_MACHINERY = ("/torch/", "<")


def where(frames: list[dict]) -> str:
    """The innermost Python frame outside torch (``file:line function``, the file from its package directory on),
    and the innermost frame of this package's engine when that is further out: the line that allocated and why.
    With C++ frames too (``--memory-stacks all``) those are passed over; an allocation with no Python frame (the
    backward, on autograd's thread) is named by its autograd node, else by the ATen op that made it."""
    python = [f for f in frames if f.get("filename", "").endswith(".py")]
    if not python:
        for marks in (("Backward",), ("at::native::", "at::_ops::")):
            op = next((f for f in frames if any(m in f.get("name", "") for m in marks)), None)
            if op is not None:
                return f"{op['name'][:160]} (no Python frame)"
        return "?"
    own = next((f for f in python if not any(m in f.get("filename", "") for m in _MACHINERY)), None)
    engine = next((f for f in python if "/engine/" in f.get("filename", "")), None)

    def name(f):
        path = f["filename"]
        for root in ("/lowvram_lora/", "/site-packages/", "/bench/"):
            if root in path:
                path = path.split(root, 1)[1]
                break
        return f"{path}:{f.get('line')} {f.get('name')}"

    if own is None:
        return name(python[0])
    return name(own) if engine is None or engine is own else f"{name(own)} <- {name(engine)}"


def _group(items, top: int) -> list[dict]:
    """(size, frames) pairs grouped by ``where``, the largest ``top`` groups."""
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, frames in items:
        g = groups[where(frames)]
        g[0] += size
        g[1] += 1
    return [{"where": w, "gb": round(b / 1e9, 4), "count": n}
            for w, (b, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]]


def trace_peak(trace: list[dict], top: int = 25) -> dict:
    """One device's trace (``_snapshot()['device_traces'][d]``) replayed: an allocation is alive from its ``alloc`` to
    its ``free_requested`` (when ``memory_allocated`` drops). A free of a block allocated before the trace's window
    lowers the count too, so the peak is the most bytes alive above the window's start (which may be below it). At
    that event: the total, what was freed from before the window, and the window's allocations alive then, grouped by
    ``where``."""
    live, total, peak, peak_at, older = {}, 0, 0, -1, 0
    for i, ev in enumerate(trace):
        action = ev.get("action")
        if action == "alloc":
            live[ev["addr"]] = ev["size"]
            total += ev["size"]
            if total > peak:
                peak, peak_at = total, i
        elif action == "free_requested":
            if ev["addr"] in live:
                total -= live.pop(ev["addr"])
            else:  # allocated before the window
                total -= ev["size"]
                older += ev["size"]
    alive, older_at_peak = {}, 0
    for ev in trace[:peak_at + 1]:  # once more, to the peak, keeping the frames
        if ev.get("action") == "alloc":
            alive[ev["addr"]] = (ev["size"], ev.get("frames") or [])
        elif ev.get("action") == "free_requested":
            if alive.pop(ev["addr"], None) is None:
                older_at_peak += ev["size"]
    return {"peak_gb_above_trace_start": round(peak / 1e9, 4), "events": len(trace), "peak_event": peak_at,
            "freed_from_before_the_trace_gb": {"by_peak": round(older_at_peak / 1e9, 4),
                                               "in_all": round(older / 1e9, 4)},
            "alive_at_peak": _group(alive.values(), top)}


def live_blocks(snapshot: dict, top: int = 25) -> dict:
    """Every block the allocator holds now (``_snapshot()['segments']``), per device: bytes by state, and the
    allocated ones grouped by ``where``."""
    out = {}
    for device in sorted({s["device"] for s in snapshot.get("segments", [])}):
        states: dict[str, int] = defaultdict(int)
        allocated = []
        for seg in snapshot["segments"]:
            if seg["device"] != device:
                continue
            for b in seg.get("blocks", []):
                states[b["state"]] += b["size"]
                if b["state"] == "active_allocated":
                    allocated.append((b["size"], b.get("frames") or []))
        out[str(device)] = {"gb_by_state": {k: round(v / 1e9, 4) for k, v in states.items()},
                            "allocated": _group(allocated, top)}
    return out


def summarize(snapshot: dict, top: int = 25) -> dict:
    """Both views of one ``torch.cuda.memory._snapshot()``: each device's trace at its peak, and the live blocks."""
    traces = snapshot.get("device_traces", [])
    return {"trace_peak": {str(d): trace_peak(t, top) for d, t in enumerate(traces) if t},
            "live": live_blocks(snapshot, top)}


class MemoryHistory:
    """Records the allocator's history on every GPU of this process; ``write(path)`` summarizes it to JSON and starts
    a fresh history; on an out-of-memory, the moment's summary goes to ``oom_path`` before the error unwinds."""

    def __init__(self, max_entries: int, oom_path: Path, stacks: str = "python"):
        import torch

        self.torch, self.max_entries, self.oom_path, self.stacks = torch, max_entries, Path(oom_path), stacks
        self._start()
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is not None:
            attach(self._on_oom)

    def _start(self) -> None:
        # One call: the history is recorded for every device of the process (torch ignores its device argument).
        # stacks="all" adds C++ frames, so the backward's allocations (made on autograd's thread, with no Python
        # frame) are named too; symbolizing them makes each snapshot slower.
        self.torch.cuda.memory._record_memory_history(max_entries=self.max_entries, stacks=self.stacks,
                                                      clear_history=True)

    def _on_oom(self, device, alloc, device_allocated, device_free) -> None:
        try:
            summary = summarize(self.torch.cuda.memory._snapshot())
            summary["oom"] = {"device": device, "request_gb": round(alloc / 1e9, 4),
                              "allocated_gb": round(device_allocated / 1e9, 4),
                              "free_gb": round(device_free / 1e9, 4)}
            _write_json(self.oom_path, summary)
            print(f"memory at the out-of-memory on cuda:{device}: {self.oom_path}", flush=True)
        except Exception as exc:  # noqa: BLE001 - the out-of-memory itself is the error the run must show
            print(f"memory at the out-of-memory on cuda:{device} not written: {type(exc).__name__}: {exc}",
                  flush=True)

    def write(self, path: Path) -> dict:
        summary = summarize(self.torch.cuda.memory._snapshot())
        _write_json(Path(path), summary)
        self._start()
        return summary


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
