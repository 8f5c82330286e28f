"""The Load node identifies a checkpoint once, and that identity is the one the run uses: training in this
process identifies nothing, and a data-parallel worker gets it as JSON instead of identifying again.

Identifications are counted where they happen: each checkpoint kind's ``identify`` (engine/checkpoint/kinds/), with
the per-file-state memo emptied after the Load node, so a run that identified again would be counted."""
import pytest
import torch

from lowvram_lora.engine.callbacks import TrainingCallback
from lowvram_lora.engine.checkpoint import CheckpointIdentity, transformer
from lowvram_lora.engine.checkpoint.kinds import checkpoint_kinds
from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.models.inspect import ModelInfo
from lowvram_lora.engine.parallel import ParallelConfig
from lowvram_lora.engine.runs.result_reuse import train_or_reuse


@pytest.fixture
def identifications(monkeypatch):
    """The paths each kind's ``identify`` was called for (the memo emptied first, and again by ``forget``)."""
    calls = []
    for kind in checkpoint_kinds().values():
        def counted(path, family_id, real=kind.identify):
            calls.append(path)
            return real(path, family_id)

        monkeypatch.setattr(kind, "identify", counted)
    transformer._IDENTITIES.clear()
    yield calls
    transformer._IDENTITIES.clear()


def _load_node(models, path: str, monkeypatch) -> ModelInfo:
    """The Load Quantized Slab node, run as ComfyUI runs it (outside ComfyUI: the standalone models folder)."""
    from lowvram_lora.nodes import paths
    from lowvram_lora.nodes.load_model import LowVRAMLoadQuantizedSlab

    monkeypatch.setitem(paths._standalone, "models_dir", models)
    out = LowVRAMLoadQuantizedSlab.PREPARE_CLASS_CLONE({"unique_id": "1"}).execute(path, "auto", "bf16")
    return out.args[0]


def test_the_load_nodes_identity_is_the_runs(tiny_pipeline, tiny_cache, tmp_path, monkeypatch, identifications):
    models = tmp_path / "models"
    (models / "diffusers").mkdir(parents=True)
    (models / "diffusers" / "tiny").symlink_to(tiny_pipeline)
    info = _load_node(models, "diffusers/tiny", monkeypatch)
    assert len(identifications) == 1 and info.checkpoint.family.id == "flux1"
    transformer._IDENTITIES.clear()  # a second identification in the run would not be served from the memo
    lora, train = LoraSettings(rank=2), TrainConfig(steps=1, device="cpu")
    result = train_or_reuse(info, tiny_cache, lora, train, tmp_path / "cache", TrainingCallback())
    assert result.steps == 1 and len(identifications) == 1  # none in training

    # A ModelConfig (library use) is identified once, by the run itself: the count can move.
    from lowvram_lora.engine.train import train_lora

    train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), tiny_cache, lora, train)
    assert len(identifications) == 2


def test_a_data_parallel_worker_uses_the_identity_it_is_given(tiny_pipeline, tiny_cache, tmp_path, monkeypatch,
                                                              identifications, capsys):
    """The worker's spec carries the Load node's identity; the worker (here in this process, one rank) trains
    with it and identifies nothing; a spec without it (written by an older version) identifies once."""
    import json

    from lowvram_lora.engine.lora_io.trained import read_trained
    from lowvram_lora.engine.models.inspect import inspect_transformer
    from lowvram_lora.engine.parallel.data_parallel import NCCL_SAFE_ENV
    from lowvram_lora.engine.runs import worker
    from lowvram_lora.engine.runs.launch import run_spec

    info = inspect_transformer(ModelConfig(transformer_path=str(tiny_pipeline)))
    assert len(identifications) == 1
    ident = info.checkpoint
    assert CheckpointIdentity.from_json(json.loads(json.dumps(ident.to_json()))) == ident
    assert ModelInfo.from_json(json.loads(json.dumps(info.to_json()))) == info

    def run(spec: dict, name: str) -> None:
        run_dir = tmp_path / name
        run_dir.mkdir()
        spec = {**spec, "run_dir": str(run_dir), "stop_file": str(run_dir / "STOP")}
        (run_dir / "spec.json").write_text(json.dumps(spec))
        transformer._IDENTITIES.clear()
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOWVRAM_PARENT_PID"):  # one rank, no process group
            monkeypatch.delenv(key, raising=False)
        for key, value in NCCL_SAFE_ENV.items():  # what the worker sets, restored after the test
            monkeypatch.setenv(key, value)
        assert worker.main([str(run_dir / "spec.json")]) == 0
        assert read_trained(run_dir, "result").steps == 1

    store = {"root": str(tmp_path / "resume"), "key": "k", "settings": {}, "save_every": 0, "family_key": "f",
             "enabled": False}
    spec = run_spec(info, tiny_cache, LoraSettings(rank=2), TrainConfig(steps=1, device="cpu"),
                    ParallelConfig(mode="data_parallel", devices=("cpu", "cpu")), store, tmp_path)
    run(spec, "given")
    assert len(identifications) == 1  # none in the worker
    run({k: v for k, v in spec.items() if k != "model_info"}, "older")
    assert len(identifications) == 2
    capsys.readouterr()  # the worker's progress events


def test_a_slab_is_identified_with_its_family(tiny_pipeline, tmp_path, identifications):
    """A slab's manifest finishes its identity (family, variant, config), so no caller asks the slab package."""
    from lowvram_lora.engine.checkpoint import identify
    from lowvram_lora.engine.models import load_transformer
    from lowvram_lora.engine.slab import build_slab

    slab = build_slab(tiny_pipeline, tmp_path / "tiny.slab.safetensors")
    ident = identify(slab)
    assert (ident.kind, ident.family.id, ident.variant) == ("slab", "flux1", "flux1-tiny")
    assert ident.config["num_layers"] == identify(tiny_pipeline).config["num_layers"] > 0
    model, family, same, variant = load_transformer(ident, dtype=torch.float32)
    assert same is ident and family.id == "flux1" and variant == "flux1-tiny"
    assert len(identifications) == 2  # the slab and the pipeline folder, each once
