"""Offload Config shows what people set on most runs; the planner's own choices are Offload Tuning's (issue 43).

Unplugged, Offload Tuning's defaults are OffloadConfig's own (what Offload Config used when they were its widgets),
every shipped template plans with the values it had, and workflows saved while they were Offload Config's widgets
still run with every value they hold (the mechanism of Training Options: nodes/moved_settings.py)."""
import json
import re
from pathlib import Path

import pytest

from lowvram_lora.engine.offload import OffloadConfig
from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.host import templates as T
from lowvram_lora.host.executor import execute_graph
from lowvram_lora.host.workflow import apply_overrides, to_api_graph, validate_graph
from lowvram_lora.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
from lowvram_lora.nodes.offload_config import LEGACY_WIDGETS, LowVRAMOffloadConfig, is_legacy_layout
from lowvram_lora.nodes.offload_tuning import LowVRAMOffloadTuning, option_values
from lowvram_lora.nodes.train_lora import LEGACY_WIDGETS as TRAIN_LEGACY_WIDGETS

ROOT = Path(__file__).resolve().parent.parent
# Offload Config's widgets_values in example_workflows/demo_tiny_lora.json as shipped until 2026-11-28 (16 values),
# and the same file with a tuned plan (every moved setting off its default).
OLD_DEMO_VALUES = ["resident", 0.0, -1, 0, "auto", True, 0.8, "dequant", 0, "auto", 0, "auto", 1.0, "auto", 0.0, -1]
TUNED = {"mode": "stream", "vram_budget_gb": 0.0, "resident_blocks": 2, "prefetch_depth": 3,
         "activation_offload": "on", "gradient_checkpointing": True, "max_pinned_fraction": 0.6, "int8_compute": "fp8",
         "recompute_chunks": 4, "optimizer_on_host": "off", "micro_batch_size": 1, "compile": "blocks",
         "activation_memory_budget": 0.7, "outer_on_host": "on", "ram_budget_gb": 12.5, "disk_blocks": 1}
TUNED_CONFIG = OffloadConfig(mode="stream", resident_blocks=2, prefetch_depth=3, activation_offload=True,
                             max_pinned_fraction=0.6, int8_compute="fp8", recompute_chunks=4, optimizer_on_host=False,
                             micro_batch_size=1, compile="blocks", activation_memory_budget=0.7, outer_on_host=True,
                             ram_budget_gb=12.5, disk_blocks=1)


def _offload(graph: dict, node_id: str = "3") -> OffloadConfig:
    """Offload Config's output, run by the headless executor on its part of ``graph`` (the node and what it takes,
    with the whole graph as its hidden prompt, as ComfyUI gives it)."""
    part = {node_id: graph[node_id]} | {
        v[0]: graph[v[0]] for v in graph[node_id]["inputs"].values() if isinstance(v, list)}
    validate_graph(part, NODE_CLASS_MAPPINGS)
    return execute_graph(part, NODE_CLASS_MAPPINGS, progress=False)[node_id][0]


def test_offload_config_shows_few_widgets_and_unplugged_tuning_is_the_dataclass_default():
    shown = [n for n, (_, o) in LowVRAMOffloadConfig.INPUT_TYPES()["required"].items() if "default" in o]
    assert shown == ["mode", "compile", "vram_budget_gb", "ram_budget_gb"]
    assert list(LowVRAMOffloadConfig.INPUT_TYPES()["optional"]) == ["tuning"]
    assert LowVRAMOffloadConfig.execute().args[0] == OffloadConfig()
    plugged = LowVRAMOffloadConfig.execute(tuning=LowVRAMOffloadTuning.execute().args[0]).args[0]
    assert plugged == OffloadConfig()
    margin = LowVRAMOffloadConfig.execute(tuning=LowVRAMOffloadTuning.execute(allocator_margin_gb=1.5).args[0]).args[0]
    assert margin == OffloadConfig(allocator_margin_gb=1.5)  # 0 (the widget's default) stands for None
    for bad in (float("nan"), -1.0):
        with pytest.raises(ConfigError, match="allocator_margin_gb"):
            OffloadConfig(allocator_margin_gb=bad)
    # every widget, moved or not, is in the old order: nothing was dropped on the way (allocator_margin_gb came
    # after the move: no old workflow holds it)
    assert sorted(LEGACY_WIDGETS + ("allocator_margin_gb",)) == sorted(shown + list(option_values(LowVRAMOffloadTuning,
                                                                                                  {})))


def test_every_shipped_template_plans_with_the_values_it_had():
    """The family's template names Offload Config's values; the generated graph's node gives the OffloadConfig
    those values make (with the dataclass's defaults for the rest, as before the move), for every chain."""
    for name, t in T.SHIPPED.items():
        api = json.loads((ROOT / "example_workflows" / "api" / f"{name}.json").read_text())
        for k, chain in enumerate(({},) + tuple(t.chains)):
            node_id = str(3 + 10 * k)
            assert api[node_id]["class_type"] == "LowVRAMOffloadConfig", (name, k)
            assert _offload(api, node_id) == OffloadConfig(**{**t.offload, **chain.get("offload", {})}), (name, k)
    with pytest.raises(ValueError, match="resident_blocks, which Offload Tuning holds"):
        T._offload_widgets({"mode": "stream", "resident_blocks": 2})


def _old_demo_ui(values: list) -> dict:
    """The shipped demo as a file saved before the move: Offload Config with its 16 positional values."""
    ui = json.loads((ROOT / "example_workflows" / "demo_tiny_lora.json").read_text())
    next(n for n in ui["nodes"] if n["type"] == "LowVRAMOffloadConfig")["widgets_values"] = list(values)
    return ui


def test_a_workflow_saved_before_the_move_plans_with_every_value_it_holds(models_with_empty_files):
    assert is_legacy_layout(OLD_DEMO_VALUES) and is_legacy_layout(OLD_DEMO_VALUES[:6])  # an older, shorter file
    assert not is_legacy_layout(["resident", "auto", 0.0, 0.0])
    ui = _old_demo_ui([TUNED[k] for k in LEGACY_WIDGETS])
    api = to_api_graph(ui, NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS)
    assert _offload(api) == TUNED_CONFIG
    assert _offload(to_api_graph(_old_demo_ui(OLD_DEMO_VALUES), NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS)) \
        == OffloadConfig(mode="resident")
    # An API file saved before: the moved settings by name on Offload Config, checked as Offload Tuning checks them
    old_api = {"3": {"class_type": "LowVRAMOffloadConfig", "inputs": dict(TUNED)}}
    assert _offload(old_api) == TUNED_CONFIG
    with pytest.raises(Exception, match="prefetch_depth"):
        validate_graph({"3": {"class_type": "LowVRAMOffloadConfig", "inputs": TUNED | {"prefetch_depth": 99}}},
                       NODE_CLASS_MAPPINGS)
    # --set on a moved setting: on Offload Config by name when no Offload Tuning is plugged, else on the plugged one
    apply_overrides(old_api, ["3.recompute_chunks=8"], NODE_CLASS_MAPPINGS)
    assert old_api["3"]["inputs"]["recompute_chunks"] == 8
    plugged = {"3": {"class_type": "LowVRAMOffloadConfig", "inputs": {"mode": "stream", "compile": "off",
                                                                      "vram_budget_gb": 0.0, "ram_budget_gb": 0.0,
                                                                      "tuning": ["12", 0]}},
               "12": {"class_type": "LowVRAMOffloadTuning", "inputs": option_values(LowVRAMOffloadTuning, {})}}
    apply_overrides(plugged, ["3.resident_blocks=5"], NODE_CLASS_MAPPINGS)
    assert "resident_blocks" not in plugged["3"]["inputs"] and plugged["12"]["inputs"]["resident_blocks"] == 5
    assert _offload(plugged) == OffloadConfig(mode="stream", compile="off", resident_blocks=5)


def test_a_value_given_by_name_overrides_the_plugged_tuning_and_says_so(capsys):
    tuning = option_values(LowVRAMOffloadTuning, {"prefetch_depth": 2})
    cfg = LowVRAMOffloadConfig.execute(mode="stream", tuning=tuning, prefetch_depth=1).args[0]
    assert cfg.prefetch_depth == 1
    assert "prefetch_depth=1 given to Offload Config by name overrides the plugged Offload Tuning node's 2" in \
        capsys.readouterr().out
    with pytest.raises(TypeError, match="Offload Config has no input prefetch_dept"):
        LowVRAMOffloadConfig.execute(prefetch_dept=1)
    with pytest.raises(ValueError, match="outer_on_host='yes' is not one of auto, on, off"):
        LowVRAMOffloadConfig.execute(outer_on_host="yes")


def test_the_editor_extension_reads_old_files_by_the_same_names():
    js = (ROOT / "web" / "moved_settings.js").read_text()
    for node, legacy, test, options in (
            ("LowVRAMTrainLoRA", TRAIN_LEGACY_WIDGETS, 'values.length >= 7 && typeof values[6] === "string"',
             ("LowVRAMTrainingOptions", "LowVRAMPreviewOptions")),
            ("LowVRAMOffloadConfig", LEGACY_WIDGETS, 'values.length >= 2 && typeof values[1] !== "string"',
             ("LowVRAMOffloadTuning",))):
        entry = re.search(node + r": \{(.*?)\n  \},", js, re.S).group(1)
        names = re.search(r"LEGACY_WIDGETS: \[(.*?)\]", entry, re.S).group(1)
        assert tuple(re.findall(r'"([a-z_0-9]+)"', names)) == legacy, node
        assert test in entry and all(f'"{cls}"' in entry for cls in options), node
