"""``--set`` overrides are applied before the workflow file's own values are validated (issue 28 point 6).

A value that is invalid in the file (a model file this machine lacks, a value out of range) must be
repairable from the command line: ``lowvram-lora run flux1_dev_lora.json --set 2.text_encoder_1=(none)``.
"""
import argparse
import json

import pytest

from lowvram_lora.host.run_command import run_workflow_command
from lowvram_lora.host.templates import WORKFLOWS_DIR
from lowvram_lora.host.workflow import WorkflowError, load_workflow, to_api_graph


class PickFile:
    """A combo of files, a bounded INT and a cross-input check, like our loader nodes."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "file": (["(none)", "a.safetensors"],),
            "steps": ("INT", {"default": 10, "min": 1, "max": 100}),
            "mode": (["one", "two"],),
        }}

    @classmethod
    def VALIDATE_INPUTS(cls, file, mode):
        return True if (file == "(none)") == (mode == "one") else f"mode {mode!r} does not go with file {file!r}"

    RETURN_TYPES = ()
    FUNCTION = "run"
    CATEGORY = "test"
    OUTPUT_NODE = True
    ran: list = []

    def run(self, file, steps, mode):
        PickFile.ran.append((file, steps, mode))
        return {"ui": {"text": [file]}}


MAPPINGS = {"PickFile": PickFile}


def _api(**inputs):
    return {"1": {"class_type": "PickFile", "inputs": {"file": "a.safetensors", "steps": 5, "mode": "two", **inputs}}}


def _ui(widgets):
    return {"last_node_id": 1, "last_link_id": 0, "links": [], "version": 0.4,
            "nodes": [{"id": 1, "type": "PickFile", "mode": 0, "inputs": [], "outputs": [],
                       "widgets_values": widgets}]}


@pytest.mark.parametrize("fmt", ["api", "ui"])
@pytest.mark.parametrize("bad, override, expected", [
    ({"file": "gone.safetensors", "mode": "one"}, "1.file=(none)", ("(none)", 5, "one")),
    ({"steps": 5000}, "1.steps=50", ("a.safetensors", 50, "two")),
])
def test_an_override_repairs_an_invalid_value_in_the_file(fmt, bad, override, expected):
    values = {"file": "a.safetensors", "steps": 5, "mode": "two", **bad}
    workflow = _api(**values) if fmt == "api" else _ui([values["file"], values["steps"], values["mode"]])
    with pytest.raises(WorkflowError):
        to_api_graph(workflow, MAPPINGS)  # the file alone is invalid
    graph = to_api_graph(workflow, MAPPINGS, overrides=[override])
    assert tuple(graph["1"]["inputs"][k] for k in ("file", "steps", "mode")) == expected


def test_validate_inputs_sees_the_overridden_values():
    # The file's pair is consistent; after the override it is not: the run must be refused before it starts.
    with pytest.raises(WorkflowError, match="does not go with"):
        to_api_graph(_api(), MAPPINGS, overrides=["1.file=(none)"])
    # And two overrides together make an inconsistent file consistent.
    graph = to_api_graph(_api(mode="one"), MAPPINGS, overrides=["1.file=(none)"])
    assert graph["1"]["inputs"]["file"] == "(none)"


def test_an_invalid_override_is_still_refused():
    with pytest.raises(WorkflowError, match='"steps"'):
        to_api_graph(_api(), MAPPINGS, overrides=["1.steps=500"])


def test_run_command_applies_overrides_before_validating(tmp_path, capsys):
    path = tmp_path / "wf.json"
    path.write_text(json.dumps(_api(file="gone.safetensors")))
    args = argparse.Namespace(workflow=str(path), overrides=["1.file=(none)", "1.mode=one"], models_dir=str(tmp_path),
                              output_dir=str(tmp_path / "out"), no_progress=True, traceback=False)
    PickFile.ran.clear()
    assert run_workflow_command(args, MAPPINGS) == 0, capsys.readouterr().err
    assert PickFile.ran == [("(none)", 5, "one")]


def test_shipped_flux1_workflow_without_clip_l_is_repaired_by_set(models_with_empty_files):
    """The case the issue reports: the file names clip_l.safetensors, which this machine lacks."""
    from lowvram_lora.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

    (models_with_empty_files / "text_encoders" / "clip_l.safetensors").unlink()
    workflow = load_workflow(WORKFLOWS_DIR / "flux1_dev_lora.json")
    with pytest.raises(WorkflowError, match="clip_l.safetensors"):
        to_api_graph(workflow, NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS)
    graph = to_api_graph(workflow, NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS,
                         overrides=["2.text_encoder_1=(none)"])
    assert graph["2"]["inputs"]["text_encoder_1"] == "(none)"
    assert graph["2"]["inputs"]["text_encoder_2"] == "t5xxl_fp16.safetensors"
