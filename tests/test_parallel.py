"""Multi-GPU training logic on the CPU: data parallel with gloo worker processes, and the split."""
import os
import re
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lowvram_lora.engine.offload.plan import HEADROOM_BYTES

from lowvram_lora.engine.callbacks import TrainingCallback
from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.errors import CacheError, ConfigError, WorkerError
from lowvram_lora.engine.models import load_transformer
from lowvram_lora.engine.models.inspect import inspect_transformer
from lowvram_lora.engine.offload import OffloadConfig
from lowvram_lora.engine.offload.plan import GB, ModelFootprint, Workload
from lowvram_lora.engine.parallel import ParallelConfig
from lowvram_lora.engine.parallel.config import parse_budgets, parse_devices
from lowvram_lora.engine.parallel.data_parallel import Ranks
from lowvram_lora.engine.parallel.split import _arguments_to, plan_split
from lowvram_lora.engine.train import train_lora
from lowvram_lora.engine.train.batching import bucket_batches
from lowvram_lora.engine.runs.result_reuse import train_or_reuse

DP_CPU = ParallelConfig(mode="data_parallel", devices=("cpu", "cpu"))


class Recorder(TrainingCallback):
    def __init__(self, on_first_step=None, stop_after=None):
        self.steps, self.logs = [], []
        self.on_first_step, self.stop_after = on_first_step, stop_after

    def on_step(self, info):
        self.steps.append(info)
        if len(self.steps) == 1 and self.on_first_step:
            self.on_first_step()

    def log(self, message):
        self.logs.append(message)

    def should_stop(self):
        return self.stop_after is not None and len(self.steps) >= self.stop_after


def _workers() -> list[int]:
    """PIDs of live data-parallel worker processes started by this test process."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes()
                env = (d / "environ").read_bytes()
            except OSError:
                continue
            if b"engine.runs.worker" in cmd and f"LOWVRAM_PARENT_PID={os.getpid()}".encode() in env:
                out.append(int(d.name))
    return out


# -- config and sharding ------------------------------------------------------------------

def test_config_parsing_and_errors():
    assert parse_devices("0, 1") == ("cuda:0", "cuda:1")
    assert parse_budgets("12,10.5") == (12.0, 10.5)
    cfg = ParallelConfig(mode="split", devices=("cuda:0", "cuda:1"), vram_budget_gb=(12.0,))
    assert cfg.vram_budget_gb == (12.0, 12.0) and cfg.world_size == 1
    assert ParallelConfig(mode="data_parallel", devices=("cuda:0", "cuda:1", "cuda:2")).world_size == 3
    for bad, match in [
        (dict(mode="ring"), "not one of"),
        (dict(devices=("cuda:0",)), "at least two"),
        (dict(mode="data_parallel", devices=("cuda:0", "cuda:0")), "twice"),
        (dict(devices=("cuda:0", "gpu1")), "cuda:N"),
        (dict(devices=("cuda:0", "cuda:1", "cuda:2")), "exactly two"),
        (dict(vram_budget_gb=(float("nan"), 1.0)), "finite"),
        (dict(vram_budget_gb=(1.0, 2.0, 3.0)), "3 values for 2 devices"),
        (dict(cut=0), "block index"),
        (dict(mode="data_parallel", cut=3), "only applies to split"),
    ]:
        with pytest.raises(ConfigError, match=match):
            ParallelConfig(**bad)
    with pytest.raises(ConfigError, match="not a number"):
        parse_budgets("12,lots")


def test_shards_partition_the_single_process_stream():
    items = [(i, (64, 64) if i % 3 else (32, 96)) for i in range(11)]
    one = bucket_batches(items, 2, 5, lambda it: it[1])
    single = [next(one) for _ in range(12)]
    shards = [Ranks(r, 3).shard(bucket_batches(items, 2, 5, lambda it: it[1])) for r in range(3)]
    per_rank = [[next(s) for _ in range(4)] for s in shards]
    # rank r's k-th batch is global batch k*W + r, and each batch stays within one bucket
    assert all(per_rank[r][k] == single[k * 3 + r] for r in range(3) for k in range(4))
    assert all(len({it[1] for it in b}) == 1 for b in single)
    assert [Ranks(r, 3).global_micro_index(4) for r in range(3)] == [12, 13, 14]


# -- data parallel: 2 gloo processes on the CPU ----------------------------------------

@pytest.fixture(scope="module")
def dp_run(tiny_pipeline, tiny_cache, tmp_path_factory):
    """One finished two-rank run (6 steps, a state saved each step), made once for the tests that compare with it
    (two worker processes cost seconds to start): (model, lora, train, the result, its steps as reported, its
    folder, the run description it kept for torchrun)."""
    model = inspect_transformer(ModelConfig(transformer_path=str(tiny_pipeline)))
    lora = LoraSettings(rank=4)
    train = TrainConfig(steps=6, learning_rate=2e-3, seed=1, device="cpu", save_every=1)
    root = tmp_path_factory.mktemp("dp_run")
    rec = Recorder()
    result = train_or_reuse(model, tiny_cache, lora, train, root / "cache", rec, parallel=DP_CPU)
    spec = root / "spec-latest.json"  # a copy: a later launch under cache/ would replace the kept one
    spec.write_bytes((root / "cache" / "parallel" / "spec-latest.json").read_bytes())
    return SimpleNamespace(model=model, lora=lora, train=train, result=result, steps=[s.step for s in rec.steps],
                           folder=root / "cache", spec=spec, logs=rec.logs)


def test_data_parallel_equals_one_process_accumulating_both_batches(dp_run, tiny_cache):
    model, lora, train, dp = dp_run.model, dp_run.lora, dp_run.train, dp_run.result
    assert dp.steps == 6 and not dp.interrupted and dp_run.steps == [1, 2, 3, 4, 5, 6]
    info = dp.settings["data_parallel"]
    assert info["world_size"] == 2 and info["weight_checksums"][0] == info["weight_checksums"][1]
    # one process drawing the same two batches per step as accumulated micro-batches: the same mean gradient
    single = train_lora(model.config, tiny_cache, lora, TrainConfig(**{**vars(train), "gradient_accumulation": 2}))
    assert set(dp.state_dict) == set(single.state_dict)
    for k, v in single.state_dict.items():
        torch.testing.assert_close(dp.state_dict[k], v, rtol=1e-4, atol=1e-6)
    assert dp.loss_history == pytest.approx(single.loss_history, rel=1e-5)
    # and not what one process makes of one batch per step
    alone = train_lora(model.config, tiny_cache, lora, train)
    assert any(not torch.allclose(alone.state_dict[k], v, atol=1e-6) for k, v in dp.state_dict.items())
    assert not list((dp_run.folder / "parallel").glob("run-*")) and not _workers()
    # a rerun reuses the finished data-parallel run; the one-process key is a different run
    again = Recorder()
    train_or_reuse(model, tiny_cache, lora, train, dp_run.folder, again, parallel=DP_CPU)
    assert any("reusing the finished run" in m for m in again.logs) and not again.steps


def test_data_parallel_stop_keeps_finished_steps_and_resumes(dp_run, tiny_cache, tmp_path):
    model, lora, train = dp_run.model, dp_run.lora, dp_run.train
    stopped = train_or_reuse(model, tiny_cache, lora, train, tmp_path, Recorder(stop_after=2), parallel=DP_CPU)
    assert stopped.interrupted and 2 <= stopped.steps < 6 and not _workers()
    rec = Recorder()
    resumed = train_or_reuse(model, tiny_cache, lora, train, tmp_path, rec, parallel=DP_CPU)
    assert resumed.steps == 6 and not resumed.interrupted
    assert any("resuming from step" in m for m in rec.logs)
    for k, v in dp_run.result.state_dict.items():  # the same run, never stopped
        torch.testing.assert_close(resumed.state_dict[k], v, rtol=1e-5, atol=1e-7)


def test_data_parallel_worker_death_and_bad_input(tiny_pipeline, tiny_cache, tmp_path):
    model = inspect_transformer(ModelConfig(transformer_path=str(tiny_pipeline)))
    lora, train = LoraSettings(rank=4), TrainConfig(steps=400, learning_rate=1e-3, device="cpu")

    def kill_rank1():
        pids = [p for p in _workers() if b"RANK=1\x00" in Path(f"/proc/{p}/environ").read_bytes()]
        os.kill(pids[0], signal.SIGKILL)

    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 died \(signal 9\)") as died:
        train_or_reuse(model, tiny_cache, lora, train, tmp_path, Recorder(on_first_step=kill_rank1), parallel=DP_CPU)
    assert time.monotonic() - t0 < 120 and not _workers()
    # without a saved state, it says a rerun starts over (the first state would come at step 40)
    assert "No training state was saved yet (the first is saved at step 40)" in str(died.value)
    # an error inside the workers comes back as the same error, with its message
    broken = type(tiny_cache)(**{**vars(tiny_cache), "manifest_path": tmp_path / "missing.json"})
    with pytest.raises(CacheError, match="cannot read cache manifest"):
        train_or_reuse(model, broken, lora, train, tmp_path, Recorder(), parallel=DP_CPU)
    assert not _workers()


def test_data_parallel_worker_death_says_where_a_rerun_resumes(tiny_pipeline, tiny_cache, tmp_path):
    model = inspect_transformer(ModelConfig(transformer_path=str(tiny_pipeline)))
    lora, train = LoraSettings(rank=4), TrainConfig(steps=400, learning_rate=1e-3, device="cpu", save_every=1)

    def kill_rank1():  # step 1 is reported after its state was saved
        pids = [p for p in _workers() if b"RANK=1\x00" in Path(f"/proc/{p}/environ").read_bytes()]
        os.kill(pids[0], signal.SIGKILL)

    with pytest.raises(WorkerError, match=r"rank 1 died") as died:
        train_or_reuse(model, tiny_cache, lora, train, tmp_path, Recorder(on_first_step=kill_rank1), parallel=DP_CPU)
    step = int(re.search(r"it resumes from step (\d+)/400", str(died.value))[1])
    assert step >= 1 and f"state-{step:07d}.json" in {p.name for p in (tmp_path / "resume").rglob("state-*.json")}
    assert not _workers()  # without a saved state: test_data_parallel_worker_death_and_bad_input


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has two GPUs")
def test_data_parallel_refuses_gpus_that_are_not_there(tiny_pipeline, tiny_cache, tmp_path):
    model = inspect_transformer(ModelConfig(transformer_path=str(tiny_pipeline)))
    with pytest.raises(ConfigError, match=r"asks for 2 GPUs .* this machine has \d"):
        train_or_reuse(model, tiny_cache, LoraSettings(rank=4), TrainConfig(steps=2), tmp_path, Recorder(),
                       parallel=ParallelConfig(mode="data_parallel", devices=("cuda:0", "cuda:1")))


# -- split ----------------------------------------------------------------------------

def test_split_on_the_cpu_trains_exactly_as_unsplit(tiny_pipeline, tiny_cache):
    cfg = ModelConfig(transformer_path=str(tiny_pipeline))
    lora, train = LoraSettings(rank=4), TrainConfig(steps=3, learning_rate=2e-3, seed=2, device="cpu")
    base, family, _, variant = load_transformer(tiny_pipeline, dtype=torch.float32)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    rec = Recorder()
    split = train_lora(cfg, tiny_cache, lora, train, rec, preloaded=(base, family, variant),
                       offload=OffloadConfig(mode="resident"),
                       split=ParallelConfig(mode="split", devices=("cpu", "cpu"), cut=3))
    whole = train_lora(cfg, tiny_cache, lora, train, preloaded=(base, family, variant), step_window=0)
    assert split.settings["offload_plan"]["cut"] == 3
    assert split.settings["step_window"]["modules"] > 1  # each part's modulation from the window (none: unsplit)
    assert any("split at block 3 of" in m for m in rec.logs)
    for k, v in whole.state_dict.items():
        torch.testing.assert_close(split.state_dict[k], v, rtol=1e-5, atol=1e-7)
    after = base.state_dict()  # the preloaded model is left as found: no hooks, no LoRA, same weights
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert not any(b._forward_pre_hooks for b in base.modules())


def test_compiled_blocks_train_the_interleaved_split_as_the_eager_one_device_run(tiny_pipeline, tiny_cache,
                                                                                  monkeypatch):
    """compile='blocks' with Dual-GPU Split (explicit only: auto keeps the split eager until it is timed on GPUs): the
    blocks' forwards compiled (aot_eager: dynamo's capture and autograd split, no code generation) and called from
    the pipeline's micro-batch threads, interleaved (v = 2, four chunks) on cpu,cpu, give the eager one-device run's
    losses and LoRA (rtol 1e-4); the compiled forwards did run (graphs were captured)."""
    from lowvram_lora.engine.train import compile as compile_mod

    monkeypatch.setattr(compile_mod, "DEFAULT_BACKEND", "aot_eager")
    torch._dynamo.reset()  # graphs another test captured in this process would be reused, none counted here
    cfg = ModelConfig(transformer_path=str(tiny_pipeline))
    lora, train = LoraSettings(rank=4), TrainConfig(steps=2, learning_rate=2e-3, seed=2, device="cpu", batch_size=2)
    base, family, _, variant = load_transformer(tiny_pipeline, dtype=torch.float32)
    rec = Recorder()
    split = train_lora(cfg, tiny_cache, lora, train, rec, preloaded=(base, family, variant),
                       offload=OffloadConfig(mode="resident", compile="blocks"),
                       split=ParallelConfig(mode="split", devices=("cpu", "cpu"), micro_batches=2, virtual_stages=2))
    # The window's outputs are picked per micro-batch by the calling thread, which dynamo would guard as a constant
    # (on CUDA, torch 2.11: 'Unexpected type _MicroBatch' while creating the guard): off, and said so.
    assert any("modulation window: off (compiled blocks with a pipelined Dual-GPU Split" in m for m in rec.logs), rec.logs
    assert split.settings["compile"]["graphs"] > 0 and split.settings["offload_plan"]["virtual_stages"] == 2
    whole = train_lora(cfg, tiny_cache, lora, train, preloaded=(base, family, variant), step_window=0)
    assert "compile" not in whole.settings or not whole.settings["compile"]
    assert split.loss_history == pytest.approx(whole.loss_history, rel=1e-4)
    for k, v in whole.state_dict.items():
        torch.testing.assert_close(split.state_dict[k], v, rtol=1e-4, atol=1e-6)


def test_split_hook_moves_nested_arguments():
    hook = _arguments_to(torch.device("meta"))
    args, kwargs = hook(None, (torch.ones(2), 3), {"rotary": (torch.ones(1), torch.ones(1)), "mod": [torch.ones(1)]})
    assert args[0].device.type == "meta" and args[1] == 3
    assert all(t.device.type == "meta" for t in (*kwargs["rotary"], *kwargs["mod"]))


def _footprint(n=10):
    return ModelFootprint(name="m", block_names=[f"b{i}" for i in range(n)], block_bytes=[int(GB)] * n,
                          other_bytes=int(0.5 * GB), trainable_params=n * 1000, hidden_size=64)


def test_split_plan_balances_and_respects_budgets():
    fp, wl = _footprint(), Workload(1, 64, 16)
    devs = (torch.device("cuda:0"), torch.device("cuda:1"))
    plan = plan_split(fp, [1000] * 10, 0, wl, OffloadConfig(mode="resident"), devs, (None, None))
    peaks = [p.predicted_peak_bytes for p in plan.plans]
    assert plan.cut == 5 and max(peaks) / min(peaks) < 1.15  # the cut that balances the weights
    auto = OffloadConfig(mode="auto")
    plan = plan_split(fp, [1000] * 10, 0, wl, auto, devs, (int(5 * GB), int(5 * GB)))
    assert all(p.predicted_peak_bytes + HEADROOM_BYTES <= 5 * GB for p in plan.plans)  # each part in its budget
    assert plan.plans[0].streamed or plan.plans[1].streamed  # 10.5 GB of weights cannot all stay
    plan = plan_split(fp, [1000] * 10, 0, wl, auto, devs, (int(12 * GB), int(12 * GB)))
    assert not plan.plans[0].streamed and not plan.plans[1].streamed  # 24 GB: everything resident
    lopsided = plan_split(fp, [1000] * 10, 0, wl, auto, devs, (int(9 * GB), int(4 * GB)))
    assert lopsided.cut > 5  # the larger budget takes more blocks
    with pytest.raises(ConfigError, match="does not fit at any cut"):
        plan_split(fp, [1000] * 10, 0, wl, auto, devs, (int(1 * GB), int(1 * GB)))
    with pytest.raises(ConfigError, match="cut=10 must be between 1 and 9"):
        plan_split(fp, [1000] * 10, 0, wl, auto, devs, (int(9 * GB), int(9 * GB)), cut=10)
    assert "split at block" in plan.describe() and plan.summary()["cut"] == plan.cut


def test_worker_processes_share_the_cpus_and_say_where_their_start_up_went(dp_run, monkeypatch):
    """Each worker process gets its share of the host's usable CPUs (hostmem.usable_cpus) as torch threads: two
    processes each starting one thread per CPU would run the host work two threads to a CPU; the user's
    OMP_NUM_THREADS is kept. Rank 0 reports how long the worker took to be ready and the run's start-up by phase, in
    the log and the result's settings."""
    from lowvram_lora.engine.offload.hostmem import usable_cpus
    from lowvram_lora.engine.runs import launch

    cpus = usable_cpus()
    # the fixture's run: two workers, so each had half of this machine's CPUs (or the threads the environment set)
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, cpus // 2))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launch.worker_env(2)["OMP_NUM_THREADS"] == str(max(1, cpus // 2))
    assert launch.worker_env(1, processes=4)["OMP_NUM_THREADS"] == str(max(1, cpus // 4))
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert launch.worker_env(2)["OMP_NUM_THREADS"] == "5"
    ready = [m for m in dp_run.logs if m.startswith("worker ready on cpu")]
    assert len(ready) == 1 and f"with {threads} CPU threads" in ready[0], dp_run.logs  # rank 0 only speaks
    settings = dp_run.result.settings
    assert 0 < settings["worker_ready_s"] < 120 and "worker_done_at" not in settings
    startup = settings["startup_s"]
    assert list(startup) == ["model", "placement", "compute and optimizer", "data, window and previews", "total"]
    assert startup["total"] == pytest.approx(sum(v for k, v in startup.items() if k != "total"), abs=2e-3)
    assert any(m.startswith(f"start-up {startup['total']:.1f} s") for m in dp_run.logs)
    assert settings["finish_s"] >= 0


def test_worker_processes_share_the_runs_ram_budget():
    """Data parallel and the two-expert run start one process per GPU on one host: each plans within its share of
    the run's RAM budget (a set budget halved; with 0 the auto budget resolved once, then halved), not the whole."""
    from lowvram_lora.engine.offload.hostmem import resolve_ram_budget
    from lowvram_lora.engine.runs.launch import per_process_offload

    assert per_process_offload(OffloadConfig(mode="auto", ram_budget_gb=20.0), 2).ram_budget_gb == pytest.approx(10.0)
    assert per_process_offload(OffloadConfig(mode="auto", ram_budget_gb=20.0), 1).ram_budget_gb == 20.0
    assert per_process_offload(None, 2) is None
    auto = per_process_offload(OffloadConfig(mode="auto"), 2).ram_budget_gb
    assert auto == pytest.approx(resolve_ram_budget(0).bytes / 2 / 1e9, rel=0.05) and auto > 0


def test_split_step_time_is_the_parts_on_their_own_machines_plus_the_crossing():
    """Issue 42 item 3: each part is timed on its device's link and GPU (not the default 25 GB/s, unknown-GPU
    machine that predicted 8.9 + 17.4 s for a measured 2.27 s step), and the sequential split's step is the sum of
    the parts' steps (each checked against make_plan on that part alone) plus the cut's hidden states both ways."""
    from lowvram_lora.engine.offload.plan import make_plan
    from lowvram_lora.engine.offload.steptime import Machine, peak_flops_for
    from lowvram_lora.engine.parallel.split import part_footprints

    fp, wl = _footprint(), Workload(1, 4096, 512)
    devs = (torch.device("cuda:0"), torch.device("cuda:1"))
    auto, budgets = OffloadConfig(mode="auto"), (int(6 * GB), int(6 * GB))
    h200 = Machine(link_bytes_per_s=55 * GB, peak_flops=peak_flops_for("NVIDIA H200"), name="H200", source="probe")
    plan = plan_split(fp, [1000] * 10, 0, wl, auto, devs, budgets, machines=(h200, h200))
    for part_fp, part, budget in zip(part_footprints(fp, [1000] * 10, 0, plan.cut), plan.plans, budgets):
        alone = make_plan(part_fp, wl, auto, budget, machine=h200)
        assert part.machine is h200
        assert part.step_time.seconds == pytest.approx(alone.step_time.seconds, rel=1e-9)
    crossing = 2 * (1 * (4096 + 512) * 64 * 2) / plan.peer_bytes_per_s  # batch x tokens x hidden x bf16, each way
    assert plan.crossing_s == pytest.approx(crossing)
    assert plan.predicted_step_s == pytest.approx(sum(p.step_time.seconds for p in plan.plans) + crossing)
    assert "predicted step" in plan.describe() and plan.summary()["predicted_step_s"] == round(plan.predicted_step_s, 4)
    slow = plan_split(fp, [1000] * 10, 0, wl, auto, devs, budgets, cut=plan.cut)  # the old default machine
    assert slow.predicted_step_s > plan.predicted_step_s  # 25 GB/s and an unknown GPU's peak: slower


def test_the_documented_torchrun_command_runs_the_kept_spec_on_two_nodes(dp_run, tmp_path):
    """docs/multi-gpu.md, Several hosts: two torchrun agents, one per simulated node (--nnodes 2, one rank each,
    gloo over loopback), run the worker on the run description the node kept, and --save writes a LoRA file equal
    to the node's own two-rank run."""
    import subprocess
    import sys

    from lowvram_lora.engine.lora_io import load_lora

    first, spec = dp_run.result, dp_run.spec
    out = tmp_path / "torchrun_lora.safetensors"
    root = Path(__file__).resolve().parents[1]
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_import_root(tmp_path, root)),
                                                        os.environ.get("PYTHONPATH", "")])}
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
         "-m", "lowvram_lora.engine.runs.worker", str(spec), "--save", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=env) for node in (0, 1)]
    outputs = []
    try:
        for a in agents:
            outputs.append(a.communicate(timeout=300)[0])
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    done = subprocess.CompletedProcess(agents[0].args, max(a.returncode for a in agents), "\n".join(outputs), "")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    from lowvram_lora.engine.lora_io import save_lora

    lora, ref = load_lora(out), load_lora(save_lora(first, tmp_path / "node_run.safetensors"))
    assert lora.metadata["lowvram_lora.steps"] == "6"
    assert set(lora.state_dict) == set(ref.state_dict)
    for k, v in ref.state_dict.items():  # the same run as the node's: the same weights
        torch.testing.assert_close(lora.state_dict[k], v)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _import_root(tmp_path: Path, root: Path) -> Path:
    """``import lowvram_lora`` from this checkout (an installed copy could be another version)."""
    d = tmp_path / "import"
    d.mkdir(exist_ok=True)
    if not (d / "lowvram_lora").exists():
        os.symlink(root, d / "lowvram_lora")
    return d
