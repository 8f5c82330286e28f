"""Train LoRA shows the settings people change; the rest are Training Options' and Preview Options' (issue 43).

Their defaults are the training loop's own (what Train LoRA used when they were its widgets), every shipped template
keeps its values, and workflows saved while they were Train LoRA's widgets still run with every value they hold."""
import json
from dataclasses import fields
from pathlib import Path

import pytest

from lowvram_lora.engine.config import TrainConfig
from lowvram_lora.engine.sampling import SamplingConfig
from lowvram_lora.host import templates as T
from lowvram_lora.host.workflow import apply_overrides, to_api_graph
from lowvram_lora.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
from lowvram_lora.nodes.train_lora import LEGACY_WIDGETS, is_legacy_layout, moved_settings
from lowvram_lora.nodes.training_options import LowVRAMPreviewOptions, LowVRAMTrainingOptions, option_values

ROOT = Path(__file__).resolve().parent.parent
# Train LoRA's widgets_values in example_workflows/demo_tiny_lora.json as shipped until 2026-11-27 (20 values).
OLD_DEMO_VALUES = [300, 0.005, 8, 8.0, 1, 1, "constant", 10, 0, 1.0, 1.0, "adamw", 0, 100, 8, 128, 0, True, 3.5, 17]


def _engine_default(name: str):
    """The training loop's own default of a moved setting (TrainConfig, or SamplingConfig for sample_*)."""
    cls, field = (SamplingConfig, name[len("sample_"):]) if name.startswith("sample_") else (TrainConfig, name)
    return next(f.default for f in fields(cls) if f.name == field)


def test_train_lora_shows_few_widgets_and_the_options_default_to_the_loops_own_values():
    train = [n for n, (_, o) in NODE_CLASS_MAPPINGS["LowVRAMTrainLoRA"].INPUT_TYPES()["required"].items()
             if "default" in o]
    assert train == ["steps", "learning_rate", "rank", "alpha", "batch_size", "training_seed", "sample_every",
                     "sample_frames"]  # sample_frames: hidden by the editor for an image model
    for node in (LowVRAMTrainingOptions, LowVRAMPreviewOptions):
        values = option_values(node, {})
        assert values and values == {k: _engine_default(k) for k in values}, node


def test_every_shipped_template_keeps_its_training_values():
    """The family's template data names every setting as Train LoRA's; the generated graph holds each on Train LoRA
    or on the options node plugged into it (each chain's own), and a setting it does not name is the loop's default."""
    moved = [k for k in LEGACY_WIDGETS if k not in NODE_CLASS_MAPPINGS["LowVRAMTrainLoRA"].INPUT_TYPES()["required"]]
    assert len(moved) == 12
    for name, t in T.SHIPPED.items():
        api = json.loads((ROOT / "example_workflows" / "api" / f"{name}.json").read_text())
        for k, chain in enumerate(({},) + tuple(t.chains)):
            train = api[str(4 + 10 * k)]["inputs"]
            got = {key: v for key, v in train.items() if not isinstance(v, list)}
            for socket in ("training_options", "preview_options"):
                got |= api[train[socket][0]]["inputs"]
            want = {**t.train, **chain.get("train", {})}
            assert {key: got[key] for key in want} == want, (name, k)
            assert {key: got[key] for key in moved if key not in want} == {
                key: _engine_default(key) for key in moved if key not in want}, (name, k)


def _old_demo_ui() -> dict:
    """The shipped demo as a file saved before the move: no options nodes, Train LoRA's 20 positional values."""
    ui = json.loads((ROOT / "example_workflows" / "demo_tiny_lora.json").read_text())
    gone = {n["id"] for n in ui["nodes"] if n["type"] in ("LowVRAMTrainingOptions", "LowVRAMPreviewOptions")}
    ui["nodes"] = [n for n in ui["nodes"] if n["id"] not in gone]
    dropped = {l[0] for l in ui["links"] if l[1] in gone}
    ui["links"] = [l for l in ui["links"] if l[0] not in dropped]
    train = next(n for n in ui["nodes"] if n["type"] == "LowVRAMTrainLoRA")
    train["inputs"] = [i for i in train["inputs"] if i.get("link") not in dropped]
    train["widgets_values"] = list(OLD_DEMO_VALUES)
    return ui


def test_a_workflow_saved_before_the_move_reads_every_value_by_its_old_name(models_with_empty_files):
    assert is_legacy_layout(OLD_DEMO_VALUES) and not is_legacy_layout([300, 0.005, 8, 8.0, 1, 0, 100, 17])
    api = to_api_graph(_old_demo_ui(), NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS)
    train = api["4"]["inputs"]
    assert {k: train[k] for k in ("steps", "learning_rate", "rank", "training_seed", "sample_every")} == {
        "steps": 300, "learning_rate": 0.005, "rank": 8, "training_seed": 0, "sample_every": 100}
    declared = NODE_CLASS_MAPPINGS["LowVRAMTrainLoRA"].INPUT_TYPES()["required"]
    settings = moved_settings(None, None, {k: v for k, v in train.items() if k not in declared})
    assert settings == {"gradient_accumulation": 1, "lr_scheduler": "constant", "warmup_steps": 10,
                        "optimizer": "adamw", "max_grad_norm": 1.0, "guidance": 1.0, "save_every": 0, "sample_steps": 8,
                        "sample_resolution": 128, "sample_seed": 0, "sample_guidance": 3.5, "sample_at_start": True}
    # --set on a moved setting lands on the plugged options node, else on Train LoRA by name
    apply_overrides(api, ["4.warmup_steps=3"], NODE_CLASS_MAPPINGS)
    assert api["4"]["inputs"]["warmup_steps"] == 3
    shipped = json.loads((ROOT / "example_workflows" / "api" / "demo_tiny_lora.json").read_text())
    apply_overrides(shipped, ["4.warmup_steps=3", "4.sample_steps=5"], NODE_CLASS_MAPPINGS)
    assert "warmup_steps" not in shipped["4"]["inputs"] and shipped["8"]["inputs"]["warmup_steps"] == 3
    assert shipped["9"]["inputs"]["sample_steps"] == 5


def test_an_old_workflow_reaches_the_training_loop_with_the_values_it_holds(models_with_empty_files, monkeypatch):
    """Train LoRA's own execute on the API graph an old file converts to (as ComfyUI and the headless runner call
    it: declared inputs as arguments, the whole prompt as its hidden input): the moved settings it holds reach the
    training loop's configs. The loop itself is stopped at its door (the configs are what is checked)."""
    import lowvram_lora.engine.runs.result_reuse as reuse

    ui = _old_demo_ui()
    values = dict(zip(LEGACY_WIDGETS, OLD_DEMO_VALUES)) | {
        "steps": 20, "gradient_accumulation": 2, "lr_scheduler": "cosine", "warmup_steps": 1, "max_grad_norm": 0.5,
        "guidance": 2.0, "optimizer": "adamw8bit", "save_every": -1, "training_seed": 7, "sample_steps": 3,
        "sample_resolution": 96, "sample_seed": 5, "sample_at_start": False, "sample_guidance": 1.5}
    train = next(n for n in ui["nodes"] if n["type"] == "LowVRAMTrainLoRA")
    train["widgets_values"] = [values[k] for k in LEGACY_WIDGETS]
    api = to_api_graph(ui, NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS)
    seen = {}

    def stop(model, dataset, lora_cfg, train_cfg, *args, sampling=None, **kwargs):
        seen.update(train=train_cfg, sampling=sampling)
        raise InterruptedError("stopped at the training loop's door")

    monkeypatch.setattr(reuse, "train_or_reuse", stop)
    cls = NODE_CLASS_MAPPINGS["LowVRAMTrainLoRA"]
    declared = {k: v for k, v in api["4"]["inputs"].items() if k in cls.INPUT_TYPES()["required"] and k not in
                ("model", "dataset", "offload")}
    with pytest.raises(InterruptedError):
        cls.PREPARE_CLASS_CLONE({"UNIQUE_ID": "4", "PROMPT": api}).execute(model=None, dataset=None, offload=None,
                                                                           **declared)
    t, s = seen["train"], seen["sampling"]
    assert (t.steps, t.gradient_accumulation, t.lr_scheduler, t.warmup_steps, t.max_grad_norm, t.guidance, t.optimizer,
            t.save_every, t.seed) == (20, 2, "cosine", 1, 0.5, 2.0, "adamw8bit", -1, 7)
    assert (s.every, s.steps, s.resolution, s.seed, s.at_start, s.guidance) == (100, 3, 96, 5, False, 1.5)


def test_a_value_given_by_name_overrides_the_plugged_node_and_says_so():
    said = []
    got = moved_settings(option_values(LowVRAMTrainingOptions, {"warmup_steps": 50}), None,
                         {"warmup_steps": 0, "sample_steps": 4}, said.append)
    assert got["warmup_steps"] == 0 and got["sample_steps"] == 4 and got["lr_scheduler"] == "constant"
    assert said == ["warmup_steps=0 given to Train LoRA by name overrides the plugged Training Options node's 50"]
    with pytest.raises(TypeError, match="Train LoRA has no input sample_stepz"):
        moved_settings(None, None, {"sample_stepz": 4})
    with pytest.raises(TypeError, match="Preview Options has no setting steps; it has sample_steps"):
        option_values(LowVRAMPreviewOptions, {"steps": 4})
