"""The LoRA Adapter node: its tooltips are AdapterConfig's help, settings of another type are ignored, and a workflow
run by ``lowvram-lora run`` with it plugged into Train LoRA trains and saves that type."""
import argparse
import json

import pytest

from lowvram_lora.engine.config import AdapterConfig, field_help
from lowvram_lora.host.run_command import run_workflow_command
from lowvram_lora.host.templates import WORKFLOWS_DIR
from lowvram_lora.nodes import NODE_CLASS_MAPPINGS
from lowvram_lora.nodes.paths import configure_standalone_dirs

NODE = NODE_CLASS_MAPPINGS["LowVRAMLoraAdapter"]


@pytest.mark.parametrize("widget", ["type", "lokr_factor", "lokr_decompose_both", "continue_from", "ema_decay",
                                    "snapshot_every", "snapshot_keep", "ema_previews"])
def test_tooltips_are_the_adapter_configs_help(widget):
    inputs = NODE.INPUT_TYPES()
    tooltip = {**inputs["required"], **inputs.get("optional", {})}[widget][1]["tooltip"]
    assert tooltip.startswith(field_help(AdapterConfig, widget))


def test_a_continue_from_name_is_looked_up_in_the_loras_folder(tmp_path):
    from lowvram_lora.nodes.paths import configure_standalone_dirs as dirs

    (tmp_path / "models" / "loras").mkdir(parents=True)
    (tmp_path / "models" / "loras" / "mine.safetensors").write_bytes(b"x")
    dirs(str(tmp_path / "models"), str(tmp_path / "out"))
    got = NODE.execute(type="lora", continue_from="mine.safetensors").args[0]
    assert got.continue_from == str((tmp_path / "models" / "loras" / "mine.safetensors").resolve())
    with pytest.raises(FileNotFoundError, match="'other.safetensors' was not found in"):
        NODE.execute(type="lora", continue_from="other.safetensors")


def test_settings_of_another_type_are_reset_so_they_do_not_change_the_run():
    assert NODE.execute(type="loha", lokr_factor=8, lokr_decompose_both=True).args[0] == AdapterConfig("loha")
    assert NODE.execute(type="lokr", lokr_factor=8).args[0] == AdapterConfig("lokr", lokr_factor=8)


def test_train_lora_has_one_optional_adapter_socket():
    optional = NODE_CLASS_MAPPINGS["LowVRAMTrainLoRA"].INPUT_TYPES()["optional"]
    assert optional["adapter"][0] == "LOWVRAM_ADAPTER"


def test_a_workflow_with_the_adapter_node_trains_and_saves_that_type(tmp_path):
    from safetensors import safe_open

    from lowvram_lora.demo import ensure_demo_assets

    assets = ensure_demo_assets(tmp_path / "demo", trained=False)
    graph = json.loads((WORKFLOWS_DIR / "api" / "demo_tiny_lora.json").read_text())
    train = next(k for k, v in graph.items() if v["class_type"] == "LowVRAMTrainLoRA")
    graph["90"] = {"class_type": "LowVRAMLoraAdapter",
                   "inputs": {"type": "loha", "lokr_factor": -1, "lokr_decompose_both": False,
                              "continue_from": "", "ema_decay": 0.5, "snapshot_every": 1, "snapshot_keep": 0}}
    graph[train]["inputs"]["adapter"] = ["90", 0]
    path = tmp_path / "graph.json"
    path.write_text(json.dumps(graph))
    args = argparse.Namespace(workflow=str(path), models_dir=str(assets["models"]), output_dir=str(tmp_path / "out"),
                              no_progress=True, traceback=True,
                              overrides=[f"2.dataset_path={assets['dataset']}", f"{train}.steps=2",
                                         f"{train}.warmup_steps=0"])
    assert run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs) == 0
    saved = sorted((tmp_path / "out" / "loras").glob("*.safetensors"))
    assert [p.name.removeprefix("demo_tiny_lora") for p in saved] == ["_00001_.safetensors", "_00001__ema.safetensors"]
    with safe_open(str(saved[1]), "pt") as f:  # ema_decay: the EMA's own file beside the plain one
        assert f.metadata()["lowvram_lora.weights"] == "ema" and f.metadata()["lowvram_lora.adapter"] == "loha"
    with safe_open(str(saved[0]), "pt") as f:
        assert f.metadata()["lowvram_lora.adapter"] == "loha"
        assert json.loads(f.metadata()["lowvram_lora.settings"])["lora"]["adapter"]["ema_decay"] == 0.5
        assert any(k.endswith(".hada_w1_a") for k in f.keys()) and not any("lora_A" in k for k in f.keys())
    # snapshot_every=1, keep all: a loadable file per step under output/loras/snapshots/<run>/
    snaps = sorted((tmp_path / "out" / "loras" / "snapshots").glob("*/step_*.safetensors"))
    assert [p.name for p in snaps] == ["step_0000001.safetensors", "step_0000001_ema.safetensors",
                                       "step_0000002.safetensors", "step_0000002_ema.safetensors"]
