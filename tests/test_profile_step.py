"""bench/profile_step.py and bench/profile_analysis.py (issue 26 item 1) on the CPU.

- The accounting on made-up GPU events whose answer is worked out by hand: the step's cut on the compute stream
  (busy per category, idle by gap size, lead and tail) adds up to the step, categories to the kernel total, and
  the diff of two modes to the difference of their steps.
- The ``lowvram::*`` ranges the script wraps around the engine's streaming code fire under a real streamed tiny
  model (InlineCopyEngine, activation offload) and leave its gradients unchanged.
- The script end to end with ``--tiny`` (resident and compiled resident, one profiled step each): its summaries
  add up the same way.
"""
import copy
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from profile_analysis import (CAST_MUL, IDLE_COPY, IDLE_HOST, LEAD, TAIL, Ev, analyze, category,  # noqa: E402
                              diff)


def step(lane_cpu=1, scale=1.0):
    """One 1000 us step: compute stream 7, copy stream 20 (times x ``scale`` after the first kernel)."""
    t = lambda x: x if x <= 100 else 100 + (x - 100) * scale  # noqa: E731
    return [
        Ev("annotation", "ProfilerStep#3", 0.0, t(1000), lane_cpu),
        Ev("kernel", "nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT", t(100), t(300), 7),
        Ev("kernel", "flash_fwd_kernel", t(310), t(400), 7, corr=4),  # launched late: the host held it up
        Ev("kernel", "triton_poi_fused__to_copy_mul_3", t(400), t(450), 7),
        Ev("kernel", "triton_red_fused_add_native_layer_norm_7", t(600), t(700), 7, corr=5),  # queued, waited
        Ev("kernel", "void at::native::vectorized_elementwise_kernel<4>", t(690), t(720), 7),  # overlaps: clipped
        Ev("memcpy", "Memcpy HtoD (Pinned -> Device)", t(450), t(650), 20),
        Ev("annotation", "lowvram::visit", t(440), t(560), lane_cpu),
        Ev("runtime", "cudaStreamSynchronize", t(900), t(990), lane_cpu),
        Ev("runtime", "cudaLaunchKernel", t(300), t(305), lane_cpu, corr=5),
        Ev("runtime", "cudaLaunchKernel", t(305), t(309), lane_cpu, corr=4),
    ]


def test_the_step_is_cut_on_the_compute_stream_and_adds_up():
    s = analyze(step())
    assert s["compute_lane"] == 7 and s["steps"] == 1 and not s["kernels_are_cpu_ops"]
    p = {k: round(v * 1e3, 6) for k, v in s["partition_ms"].items()}  # in us
    assert p == {"busy: gemm": 200, "busy: attention": 90, f"busy: {CAST_MUL}": 50,
                 "busy: triton fused (inductor)": 100, "busy: native elementwise/copy/reduce (at::native)": 20,
                 LEAD: 100, TAIL: 280, IDLE_HOST: 10, IDLE_COPY: 150}
    assert sum(p.values()) == pytest.approx(1000) and s["wall_ms"] == pytest.approx(1.0)
    assert {k: round(v * 1e3, 6) for k, v in s["gap_sizes_ms"].items()} == {
        "gaps < 10 us": 0, "gaps 10-100 us": 10, "gaps 0.1-1 ms": 150, "gaps >= 1 ms": 0}
    assert s["busy_compute_ms"] == pytest.approx(0.46) and s["busy_all_ms"] == pytest.approx(0.61)
    cats = s["categories"]
    assert cats["memcpy HtoD"] == {"count": 1, "ms": pytest.approx(0.2)}
    assert sum(c["ms"] for c in cats.values()) == pytest.approx(s["kernel_total_ms"]) == pytest.approx(0.67)
    assert s["kernels_per_step"] == 5
    big = s["largest_gaps"][0]  # 450-600: the copy is in flight all along; the host is in the streamer's visit
    assert (big["us"], big["copy_in_flight_us"], big["lowvram"], big["cpu"]) == (150, 150, "lowvram::visit",
                                                                                   "lowvram::visit")
    assert big["launched_us_after_idle"] == -145 and s["largest_gaps"][1]["launched_us_after_idle"] == 9
    assert s["lowvram_ranges"]["lowvram::visit"] == {"count": 1, "ms": pytest.approx(0.12)}
    assert s["runtime_calls"][0]["name"] == "cudaStreamSynchronize"


def test_the_diff_of_two_modes_adds_up_to_their_step_difference():
    a, b = analyze(step()), analyze(step(scale=1.5))
    rows = diff(a, b)
    assert sum(r[3] for r in rows) == pytest.approx(b["wall_ms"] - a["wall_ms"]) == pytest.approx(0.45)
    assert dict((r[0], r[3]) for r in rows)["busy: gemm"] == pytest.approx(0.1)


def test_kernel_names_fall_in_their_categories():
    k = lambda name, kind="kernel": category(Ev(kind, name, 0, 1, 7))  # noqa: E731
    assert k("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert k("fmha_cutlassB_bf16_aligned_64x64_k128_sm80") == "attention"  # cutlass, but attention first
    assert k("dequant_rows_kernel") == "int8 dequant (eager triton)"
    assert k("triton_poi_fused__to_copy_mul_view_12") == CAST_MUL
    assert k("triton_poi_fused__to_copy_add_mul_12") == "triton fused (inductor)"
    assert k("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>") == \
        "optimizer (multi_tensor_apply)"
    assert k("Memcpy DtoH (Device -> Pinned)", "memcpy") == "memcpy DtoH"
    assert k("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "nccl"


def test_lowvram_ranges_fire_in_streaming_and_keep_the_gradients():
    from helpers import tiny_lora_model
    from profile_step import annotate_engine, remove_annotations
    from helpers import trained_grads as grads
    from test_offload_streaming import CALLS, run_steps, streamed
    from torch.profiler import ProfilerActivity, profile

    from profile_analysis import kineto_events

    ref, _ = tiny_lora_model("flux1", 2, 3, 0)
    model = copy.deepcopy(ref)
    run_steps(ref, CALLS[:1])
    installed = annotate_engine()
    try:
        handle = streamed(model, act=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run_steps(model, CALLS[:1])
            prof.step()
        handle.remove()
    finally:
        remove_annotations()
    g_ref, g = grads(ref), grads(model)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-5, atol=1e-7, msg=name)
    names = {e.name for e in kineto_events(prof.profiler.kineto_results)}
    for label in ("lowvram::visit", "lowvram::host.bind", "lowvram::act.checkpoint", "lowvram::act.pack",
                  "lowvram::act.unpack", "lowvram::ckpt_forward", "lowvram::ckpt_backward(recompute+bwd)"):
        assert label in installed and label in names, label
    from lowvram_lora.engine.offload.schedule import BlockScheduler

    assert not hasattr(BlockScheduler.visit, "_profile_range")  # put back


def test_the_script_on_the_tiny_model_adds_up(tmp_path):
    from profile_step import main, remove_annotations

    try:
        rc = main(["--tiny", "--warmup", "1", "--timed", "0", "--profiled", "1", "--out-dir", str(tmp_path)])
    finally:
        remove_annotations()
    assert rc == 0
    rows = {m: json.loads((tmp_path / f"profile_{m}.json").read_text()) for m in ("resident", "resident-compiled")}
    for mode, row in rows.items():
        s = row["summary"]
        assert row["error"] is None and s["steps"] == 1 and s["kernels_are_cpu_ops"], mode
        assert sum(s["partition_ms"].values()) == pytest.approx(s["wall_ms"], rel=1e-9)
        assert sum(c["ms"] for c in s["categories"].values()) == pytest.approx(s["kernel_total_ms"], rel=1e-9)
        assert s["kernels_per_step"] > 10 and s["lowvram_ranges"]["lowvram::micro_step(fwd+bwd)"]["count"] == 1
    a, b = rows["resident"]["summary"], rows["resident-compiled"]["summary"]
    assert sum(r[3] for r in diff(a, b)) == pytest.approx(b["wall_ms"] - a["wall_ms"], abs=1e-6)
    assert any("Torch-Compiled Region" in k for k in b["compiled_regions"])
    text = (tmp_path / "summary.md").read_text()
    assert "## resident-compiled minus resident" in text and "**total**" in text


class _FakeKineto:
    """What kineto_events reads of a torch profiler event."""

    def __init__(self, name, device, activity, start_ns, dur_ns, resource, corr=0):
        self._v = dict(name=name, device=device, activity=activity, start=start_ns, dur=dur_ns, res=resource, corr=corr)

    def name(self): return self._v["name"]  # noqa: E704
    def device_type(self): return f"DeviceType.{self._v['device']}"  # noqa: E704
    def activity_type(self): return self._v["activity"]  # noqa: E704
    def start_ns(self): return self._v["start"]  # noqa: E704
    def duration_ns(self): return self._v["dur"]  # noqa: E704
    def device_resource_id(self): return self._v["res"]  # noqa: E704
    def correlation_id(self): return self._v["corr"]  # noqa: E704
    def is_user_annotation(self): return "annotation" in self._v["activity"]  # noqa: E704


def test_kineto_events_keep_kernels_copies_ranges_and_launches_with_ns_precision():
    from profile_analysis import kineto_events

    base = 1_795_664_331_715_770_137  # absolute ns: beyond a double's integer precision
    raw = [_FakeKineto("ProfilerStep#3", "CPU", "user_annotation", base + 1_001, 10_000, 11),
           _FakeKineto("ProfilerStep#3", "CUDA", "gpu_user_annotation", base + 1_001, 10_000, 7),
           _FakeKineto("cudaLaunchKernel", "CPU", "cuda_runtime", base + 2_000, 500, 11, corr=42),
           _FakeKineto("sm90_xmma_gemm", "CUDA", "kernel", base + 3_003, 1_000, 7, corr=42),
           _FakeKineto("Memcpy HtoD (Pinned -> Device)", "CUDA", "gpu_memcpy", base + 3_000, 2_000, 20, corr=43),
           _FakeKineto("Stream Sync", "CUDA", "cuda_sync", base + 3_000, 2_000, 7),
           _FakeKineto("aten::mm", "CPU", "cpu_op", base + 1_900, 800, 11)]
    results = type("R", (), {"events": lambda self: raw, "trace_start_ns": lambda self: base})()
    evs = kineto_events(results)
    assert [(e.kind, e.lane, e.corr) for e in evs] == [("annotation", 11, 0), ("runtime", 11, 42), ("kernel", 7, 42),
                                                      ("memcpy", 20, 43), ("cpu_op", 11, 0)]
    assert evs[2].start == 3.003 and evs[2].end == 4.003  # us, exact to the ns
