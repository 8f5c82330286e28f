"""bench/memory_trace.py: what holds a GPU's memory at its peak, from torch's allocator history (a trace and a
snapshot in the layout ``torch.cuda.memory._snapshot()`` returns; the expected figures worked out by hand)."""
import json

import pytest
from helpers import bench_module

mt = bench_module("memory_trace")

TORCH = {"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 10, "name": "linear"}
BLOCK = {"filename": "/x/site-packages/diffusers/models/transformers/transformer_flux2.py", "line": 600,
         "name": "forward"}
RUNNER = {"filename": "/x/lowvram_lora/engine/parallel/pipeline.py", "line": 250, "name": "block_arguments"}
COPY = {"filename": "/x/lowvram_lora/engine/parallel/pipeline.py", "line": 120, "name": "start"}


def test_where_names_the_first_line_outside_torch_and_the_engine_line_behind_it():
    assert mt.where([TORCH, BLOCK, RUNNER]) == ("diffusers/models/transformers/transformer_flux2.py:600 forward <- "
                                                "engine/parallel/pipeline.py:250 block_arguments")
    assert mt.where([TORCH, COPY, RUNNER]) == "engine/parallel/pipeline.py:120 start"
    assert mt.where([TORCH]) == "torch/nn/functional.py:10 linear"  # only torch: its innermost line


def test_with_cpp_frames_the_python_line_or_else_the_autograd_node_names_it():
    """``stacks='all'`` frames as torch 2.11 gives them (C++ first, file ``??`` where unknown)."""
    unwind = {"filename": "??", "line": 0, "name": "torch::unwind::unwind()"}
    alloc = {"filename": "??", "line": 0, "name": "c10::cuda::CUDACachingAllocator::Native::malloc(...)"}
    mm = {"filename": "??", "line": 0, "name": "at::native::mm(at::Tensor const&, at::Tensor const&)"}
    node = {"filename": "??", "line": 0, "name": "torch::autograd::generated::MmBackward0::apply(...)"}
    assert mt.where([unwind, alloc, TORCH, BLOCK, RUNNER]) == mt.where([TORCH, BLOCK, RUNNER])
    assert mt.where([unwind, alloc, mm, node]) == "torch::autograd::generated::MmBackward0::apply(...) (no Python frame)"
    assert mt.where([unwind, alloc, mm]) == "at::native::mm(at::Tensor const&, at::Tensor const&) (no Python frame)"
    assert mt.where([unwind, alloc]) == "?"


def test_the_trace_is_replayed_to_its_peak():
    """a 100 (block), b 200 (copy), b freed, c 400 (block), d 50 (copy), a freed, e 30: alive at most after d,
    100 + 400 + 50 = 550 bytes; the block's line holds 500 of it in two allocations."""
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": [TORCH, BLOCK, RUNNER]},
        {"action": "alloc", "addr": 2, "size": 200, "frames": [COPY]},
        {"action": "free_requested", "addr": 2, "size": 200},
        {"action": "free_completed", "addr": 2, "size": 200},
        {"action": "alloc", "addr": 3, "size": 400, "frames": [TORCH, BLOCK, RUNNER]},
        {"action": "alloc", "addr": 2, "size": 50, "frames": [COPY]},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 4, "size": 30, "frames": [COPY]},
        {"action": "segment_alloc", "addr": 9, "size": 1 << 20},
    ]
    out = mt.trace_peak(trace)
    assert out["peak_gb_above_trace_start"] == round(550 / 1e9, 4) and out["peak_event"] == 5
    assert out["freed_from_before_the_trace_gb"] == {"by_peak": 0.0, "in_all": 0.0}
    assert [(g["where"].split(" ")[0], g["count"]) for g in out["alive_at_peak"]] == [
        ("diffusers/models/transformers/transformer_flux2.py:600", 2), ("engine/parallel/pipeline.py:120", 1)]


def test_frees_of_blocks_from_before_the_trace_lower_the_count():
    """Block 7 (900 bytes) was allocated before the window. a 300, 7 freed, c 500, d 200: above the start, the most
    alive is 300 before 7's free (300 - 900 + 500 + 200 = 100 at the end). Without counting 7's free, the peak
    would wrongly be 1000 after d."""
    trace = [
        {"action": "alloc", "addr": 1, "size": 300, "frames": [COPY]},
        {"action": "free_requested", "addr": 7, "size": 900},
        {"action": "alloc", "addr": 3, "size": 500, "frames": [TORCH, BLOCK, RUNNER]},
        {"action": "alloc", "addr": 4, "size": 200, "frames": [COPY]},
    ]
    out = mt.trace_peak(trace)
    assert out["peak_gb_above_trace_start"] == round(300 / 1e9, 4) and out["peak_event"] == 0
    assert out["freed_from_before_the_trace_gb"] == {"by_peak": 0.0, "in_all": round(900 / 1e9, 4)}
    assert [(g["where"], g["count"]) for g in out["alive_at_peak"]] == [("engine/parallel/pipeline.py:120 start", 1)]


def test_an_error_in_the_out_of_memory_summary_is_reported_not_raised(tmp_path, capsys):
    """The observer runs inside the allocator's out-of-memory path: its own failure must not replace the OOM."""
    class Broken:
        class cuda:
            class memory:
                @staticmethod
                def _snapshot():
                    raise RuntimeError("snapshot failed")

    history = mt.MemoryHistory.__new__(mt.MemoryHistory)
    history.torch, history.oom_path = Broken, tmp_path / "oom.json"
    history._on_oom(0, 10**9, 11 * 10**9, 0)
    assert "not written: RuntimeError: snapshot failed" in capsys.readouterr().out
    assert not (tmp_path / "oom.json").exists()


def test_live_blocks_by_device_and_state(tmp_path):
    snapshot = {"segments": [
        {"device": 0, "blocks": [{"size": 3 * 10**8, "state": "active_allocated", "frames": [COPY]},
                                 {"size": 10**8, "state": "inactive", "frames": []}]},
        {"device": 1, "blocks": [{"size": 7 * 10**7, "state": "active_pending_free", "frames": [COPY]}]},
        {"device": 0, "blocks": [{"size": 2 * 10**8, "state": "active_allocated", "frames": [COPY]}]}],
        "device_traces": [[], []]}
    out = mt.summarize(snapshot)
    assert out["trace_peak"] == {}
    assert out["live"]["0"]["gb_by_state"] == {"active_allocated": 0.5, "inactive": 0.1}
    assert out["live"]["0"]["allocated"] == [{"where": "engine/parallel/pipeline.py:120 start", "gb": 0.5,
                                               "count": 2}]
    assert out["live"]["1"] == {"gb_by_state": {"active_pending_free": 0.07}, "allocated": []}
    mt._write_json(tmp_path / "m.json", out)
    assert json.loads((tmp_path / "m.json").read_text()) == out and not list(tmp_path.glob("*.tmp"))


def _cuda():
    import torch

    return torch.cuda.is_available()



@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("stacks", ["python", "all"])
def test_on_a_gpu_the_peak_and_the_out_of_memory_are_named_by_line(tmp_path, stacks):
    """torch's own history on a real GPU: 64 MB and 32 MB allocated on known lines, the 32 MB freed, 16 MB more:
    the replay's peak above the trace's start is the 96 MB (with torch's rounding), both named by this file's lines;
    then an out-of-memory under a small cap writes its summary instead of hiding the error."""
    import json

    import torch

    torch.empty(2 << 30, dtype=torch.uint8, device="cuda")  # a free cached 2 GiB, as other tests in the process leave
    history = mt.MemoryHistory(100000, tmp_path / "oom.json", stacks)
    try:
        dev = torch.device("cuda", torch.cuda.current_device())
        a = torch.empty(64 << 20, dtype=torch.uint8, device=dev)  # line A
        b = torch.empty(32 << 20, dtype=torch.uint8, device=dev)  # line B
        del b
        c = torch.empty(16 << 20, dtype=torch.uint8, device=dev)
        out = history.write(tmp_path / "m.json")
        peak = out["trace_peak"][str(dev.index)]
        assert abs(peak["peak_gb_above_trace_start"] - 0.1007) < 0.002, peak  # 96 MiB = 0.1007 GB
        groups = {g["where"]: g for g in peak["alive_at_peak"]}
        ours = [w for w in groups if "test_memory_trace.py" in w]
        assert len(ours) == 2 and round(sum(groups[w]["gb"] for w in ours), 3) == 0.101, groups
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.empty_cache()  # the cap holds what the allocator reserves: its cached free blocks go first
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(dev) + (256 << 20)) / total, dev)
        request = torch.cuda.memory_reserved(dev) + (1 << 30)
        with pytest.raises(torch.OutOfMemoryError):
            # larger than all the allocator holds, so no cached block serves it: a new segment, over the cap
            torch.empty(request, dtype=torch.uint8, device=dev)
        oom = json.loads((tmp_path / "oom.json").read_text())
        assert oom["oom"]["request_gb"] >= 1.07 and oom["live"][str(dev.index)]["allocated"], oom["oom"]
        # the figures against the allocator's own: the request (rounded up to 2 MiB) and what it holds allocated
        assert abs(oom["oom"]["request_gb"] - request / 1e9) <= 0.0022, (oom["oom"], request)
        live = oom["live"][str(dev.index)]
        assert abs(live["gb_by_state"]["active_allocated"] - torch.cuda.memory_allocated(dev) / 1e9) <= 0.002, live
        del a, c
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.memory._record_memory_history(enabled=None)
