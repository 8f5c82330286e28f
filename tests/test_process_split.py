"""One process per GPU for the pipelined split (engine/parallel/process_split.py), on the CPU: two gloo processes on
``cpu,cpu`` train the tiny Flux.1 through train_lora, each running its own part, and both end with the LoRA of one
process training the same batches unsplit (rtol 1e-4), with the gradient clip active (the global norm) and with an
EMA (both parts' weights reach both processes after each step). The GPU twin is bench/bench_parallel.py --modes procs.
"""
import json
import os
import socket
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from lowvram_lora.engine.config import AdapterConfig, LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.models import load_transformer
from lowvram_lora.engine.offload import OffloadConfig
from lowvram_lora.engine.parallel import ParallelConfig
from lowvram_lora.engine.parallel.process_split import SplitRanks, check_stage_run
from lowvram_lora.engine.train import train_lora

#: (name, TrainConfig changes, micro_batches, EMA decay): each run both processes make, and the unsplit reference.
RUNS = (
    ("batch2_m2_clipped", {"batch_size": 2, "max_grad_norm": 0.05}, 2, 0.0),
    ("accumulated_m2_ema", {"batch_size": 1, "gradient_accumulation": 4}, 2, 0.6),
)


def _settings(changes: dict, ema: float, device: str = "cpu"):
    lora = LoraSettings(rank=4, adapter=AdapterConfig(ema_decay=ema)) if ema else LoraSettings(rank=4)
    return lora, TrainConfig(steps=2, learning_rate=2e-3, seed=2, device=device, **changes)


def _worker(rank: int, port: int, pipe: str, cache, out: str, devices=("cpu", "cpu")) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      HF_HUB_OFFLINE="1")
    import torch.distributed as dist

    from lowvram_lora.engine.parallel.process_split import init_process_split

    ranks = init_process_split(devices)
    try:
        for name, changes, micro, ema in RUNS:
            base, family, _, variant = load_transformer(pipe, dtype=torch.float32)
            lora, train = _settings(changes, ema, devices[rank])
            res = train_lora(ModelConfig(transformer_path=pipe, dtype="fp32"), cache, lora, train,
                             preloaded=(base, family, variant), offload=OffloadConfig(mode="resident"),
                             split=ParallelConfig(mode="split", devices=devices, micro_batches=micro), ranks=ranks)
            save_file({k: v.contiguous() for k, v in res.state_dict.items()}, f"{out}/{name}.{rank}.safetensors")
            if res.ema_state_dict:
                save_file({k: v.contiguous() for k, v in res.ema_state_dict.items()},
                          f"{out}/{name}.ema.{rank}.safetensors")
            Path(f"{out}/{name}.{rank}.json").write_text(json.dumps(
                {"loss": res.loss_history, "stats": res.settings.get("offload_stats"),
                 "ranks": res.settings.get("process_split")}))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(tiny_pipeline, tiny_cache, out, devices=("cpu", "cpu")):
    mp.start_processes(_worker, args=(_free_port(), str(tiny_pipeline), tiny_cache, str(out), devices), nprocs=2,
                       start_method="spawn")
    return out


@pytest.fixture(scope="module")
def two_processes(tiny_pipeline, tiny_cache, tmp_path_factory):
    return _two_processes(tiny_pipeline, tiny_cache, tmp_path_factory.mktemp("process_split"))


@pytest.mark.parametrize("name,changes,micro,ema", RUNS, ids=[r[0] for r in RUNS])
def test_two_processes_train_the_unsplit_lora(two_processes, tiny_pipeline, tiny_cache, name, changes, micro, ema):
    _compare(two_processes, tiny_pipeline, tiny_cache, name, changes, micro, ema, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_two_processes_on_cuda_train_the_unsplit_lora(tiny_pipeline, tiny_cache, tmp_path):
    """On two GPUs over NCCL; on one, both processes on cuda:0 over gloo (CUDA tensors through host memory). fp32,
    against one process on cuda:0."""
    devices = ("cuda:0", "cuda:1") if torch.cuda.device_count() > 1 else ("cuda:0", "cuda:0")
    out = _two_processes(tiny_pipeline, tiny_cache, tmp_path, devices)
    for name, changes, micro, ema in RUNS:
        _compare(out, tiny_pipeline, tiny_cache, name, changes, micro, ema, "cuda:0")


def _compare(folder, tiny_pipeline, tiny_cache, name, changes, micro, ema, device):
    two_processes = folder
    lora, train = _settings(changes, ema, device)
    base, family, _, variant = load_transformer(tiny_pipeline, dtype=torch.float32)
    whole = train_lora(ModelConfig(transformer_path=str(tiny_pipeline), dtype="fp32"), tiny_cache, lora, train,
                       preloaded=(base, family, variant), step_window=0)
    for rank in (0, 1):
        got = json.loads((two_processes / f"{name}.{rank}.json").read_text())
        assert got["loss"] == pytest.approx(whole.loss_history, rel=1e-5)
        steps = train.steps * train.gradient_accumulation * (train.batch_size if micro > 1 else 1)
        assert got["stats"]["pipelined_micro_batches"] == steps and got["stats"]["peer_bytes_copied"] > 0
        assert got["ranks"]["world_size"] == 2
        sd = load_file(two_processes / f"{name}.{rank}.safetensors")
        assert sd.keys() == whole.state_dict.keys()
        for k, v in whole.state_dict.items():
            torch.testing.assert_close(sd[k], v, rtol=1e-4, atol=1e-6, msg=k)
        if ema:
            emas = load_file(two_processes / f"{name}.ema.{rank}.safetensors")
            for k, v in whole.ema_state_dict.items():
                torch.testing.assert_close(emas[k], v, rtol=1e-4, atol=1e-6, msg=k)
    # and the clip mattered: without it the same run ends elsewhere
    if changes.get("max_grad_norm"):
        free = train_lora(ModelConfig(transformer_path=str(tiny_pipeline), dtype="fp32"), tiny_cache, lora,
                          TrainConfig(**{**vars(train), "max_grad_norm": 0.0}), preloaded=(base, family, variant),
                          step_window=0)
        assert any(not torch.allclose(free.state_dict[k], v, atol=1e-6) for k, v in whole.state_dict.items())


def test_what_a_process_split_does_not_run_yet_is_refused():
    assert SplitRanks(1).stage == 1 and SplitRanks(0).global_micro_index(5) == 5
    check_stage_run(None, None, None, None)
    from lowvram_lora.engine.sampling import SamplingConfig

    with pytest.raises(ConfigError, match=r"previews \(sample_every\).*threaded"):
        check_stage_run(SamplingConfig(every=5), None, None, None)


def test_the_node_starts_both_processes_through_train_or_reuse(tiny_pipeline, tiny_cache, tmp_path):
    """What Train LoRA runs with Dual-GPU Split one_process_per_gpu on: train_or_reuse starts the two worker
    processes (engine/runs/launch.py), each loads the model, trains its part and releases the other part's frozen
    weights, and rank 0's LoRA is the unsplit run's (rtol 1e-4)."""
    from helpers import LogRecorder

    from lowvram_lora.engine.models.inspect import inspect_transformer
    from lowvram_lora.engine.runs.result_reuse import train_or_reuse
    from lowvram_lora.nodes.dual_gpu import LowVRAMDualGPUSplit

    parallel = LowVRAMDualGPUSplit.execute(devices="cpu,cpu", micro_batches=2, one_process_per_gpu=True).args[0]
    assert parallel.one_process_per_gpu and parallel.micro_batches == 2
    model = inspect_transformer(ModelConfig(transformer_path=str(tiny_pipeline)))
    lora, train = LoraSettings(rank=4), TrainConfig(steps=2, learning_rate=2e-3, seed=5, device="cpu", batch_size=2)
    logs = LogRecorder()
    got = train_or_reuse(model, tiny_cache, lora, train, tmp_path, logs, parallel=parallel)
    assert got.steps == 2 and not got.interrupted
    assert any("the split's processes: starting 2 worker processes" in m for m in logs.logs), logs.logs
    assert any("process split: this process (stage 0) runs blocks 0-" in m for m in logs.logs), logs.logs
    # the model is the worker's own: the part it does not run lets go of its frozen weights (never read: same LoRA)
    assert any("process split: released" in m and "of the other part's frozen weights" in m for m in logs.logs)
    whole = train_lora(model.config, tiny_cache, lora, train)
    assert got.loss_history == pytest.approx(whole.loss_history, rel=1e-5)
    for k, v in whole.state_dict.items():
        torch.testing.assert_close(got.state_dict[k], v, rtol=1e-4, atol=1e-6, msg=k)


def test_one_process_per_gpu_settings_say_what_they_need():
    from lowvram_lora.nodes.dual_gpu import LowVRAMDualGPUSplit

    tip = next(i for i in LowVRAMDualGPUSplit.define_schema().inputs if i.id == "one_process_per_gpu").tooltip
    assert "interpreter" in tip and "starts over" in tip
    assert ParallelConfig(devices=("cpu", "cpu"), micro_batches=0, one_process_per_gpu=True).one_process_per_gpu
    for bad, match in [(dict(micro_batches=1), "micro_batches is 1: set micro_batches to 0 \\(auto\\) or 2"),
                       (dict(micro_batches=4, virtual_stages=2), "virtual_stages is 2: set it to 1"),
                       (dict(mode="data_parallel"), "only applies to split mode")]:
        with pytest.raises(ConfigError, match=match):
            ParallelConfig(**{"devices": ("cpu", "cpu"), "one_process_per_gpu": True, **bad})


def test_the_plan_counts_each_process_s_own_python():
    """One process per part: the pipelined step's host floor is the 1F1B makespan of each part's own Python (its share
    of the blocks), not every micro-batch's Python one after the other. Flux.1-dev 1024² bf16, batch 8 in 8
    micro-batches, 12 GB per H200: the threaded split's floor (8 x 0.62 s = 4.92 s) binds over the GPUs' 4.66 s; the
    processes' (3.49 s) does not, and the plan predicts the GPUs' makespan."""
    from helpers import bench_module

    from lowvram_lora.engine.families import get_family
    from lowvram_lora.engine.offload import OffloadConfig, Workload
    from lowvram_lora.engine.offload.plan import GB
    from lowvram_lora.engine.offload.steptime import Machine, host_s_per_piece, peak_flops_for
    from lowvram_lora.engine.parallel.split import pipelined_step_s, plan_split, trainable_per_block

    devs = (torch.device("cuda:0"), torch.device("cuda:1"))
    h200 = Machine(link_bytes_per_s=55 * GB, peak_flops=peak_flops_for("NVIDIA H200"), name="H200", source="probe")
    family = get_family("flux1")
    model, fp = bench_module("train_bench").meta_footprint(family, "flux1-dev", family.load_config("flux1-dev"), "bf16",
                                                           LoraSettings(rank=16, alpha=16.0), attach=True)
    per_block, outside = trainable_per_block(model, family)

    procs = plan_split(fp, per_block, outside, Workload(8, 4096, 512), OffloadConfig(mode="auto"), devs,
                       (int(12 * GB),) * 2, cut=19, machines=(h200, h200), micro_batches=8, processes=True,
                       suggest=False)  # 19: where the GPUs' time puts the cut (placed so without ``cut``; slower)
    threads = replace(procs, processes=False)  # the same parts and cut, in one process
    assert threads.host_bound and threads.host_floor_s == pytest.approx(8 * host_s_per_piece(fp, False))
    halves = [host_s_per_piece(fp, False) * p.footprint.num_blocks / 57 for p in procs.plans]
    assert procs.host_floor_s == pytest.approx(pipelined_step_s([8 * h for h in halves], 8))
    # the cut (Flux.1's 19 double blocks on the first GPU) gives the processes 19 and 38 blocks' Python
    assert procs.host_floor_s == pytest.approx(3.49, abs=0.01)
    assert procs.host_floor_s < 0.75 * threads.host_floor_s
    assert not procs.host_bound and procs.predicted_step_s == procs.gpu_step_s < threads.predicted_step_s
    assert "host-bound" not in procs.describe()
