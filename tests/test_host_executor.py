"""Headless execution of API graphs and the ``run`` command's exit codes (no ComfyUI, no torch)."""

import argparse
import json

import pytest

from lowvram_lora.host.executor import NodeExecutionError, execute_graph, execution_order
from lowvram_lora.host.run_command import add_run_parser, run_workflow_command
from lowvram_lora.host.workflow import WorkflowError

CALLS = []


class Source:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"default": 1, "min": 0, "max": 100}),
                             "seed": ("INT", {"default": 0})}}

    RETURN_TYPES = ("FAKE_NUM", "STRING")
    RETURN_NAMES = ("num", "label")
    FUNCTION = "make"
    CATEGORY = "test"

    def make(self, value, seed):
        CALLS.append(("Source", value))
        return (value, f"v{value}")


class Add:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {"a": ("FAKE_NUM",), "b": ("FAKE_NUM",)},
            "optional": {"scale": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 10.0}),
                         "extra": ("FAKE_NUM",)},
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    RETURN_TYPES = ("FAKE_NUM",)
    FUNCTION = "add"
    CATEGORY = "test"

    def add(self, a, b, scale=2.0, extra=None, unique_id=None):
        CALLS.append(("Add", a, b, scale, extra, unique_id))
        return [(a + b) * scale]  # a list is accepted like a tuple


class Show:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"num": ("FAKE_NUM",), "label": ("STRING", {"default": ""})}}

    RETURN_TYPES = ()
    FUNCTION = "show"
    CATEGORY = "test"
    OUTPUT_NODE = True

    def show(self, num, label):
        CALLS.append(("Show", num, label))
        return {"ui": {"text": [f"{label}={num}"]}, "result": ()}


class Boom:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"num": ("FAKE_NUM",)}}

    RETURN_TYPES = ("FAKE_NUM",)
    FUNCTION = "explode"
    CATEGORY = "test"

    def explode(self, num):
        raise ValueError("dataset folder is empty")


class Interrupt(Boom):
    FUNCTION = "stop"

    def stop(self, num):
        raise KeyboardInterrupt


MAPPINGS = {c.__name__: c for c in (Source, Add, Show, Boom, Interrupt)}


@pytest.fixture(autouse=True)
def clear_calls():
    CALLS.clear()


def make_graph():
    return {
        "5": {"class_type": "Show", "inputs": {"num": ["3", 0], "label": ["1", 1]}, "_meta": {"title": "Show it"}},
        "3": {"class_type": "Add", "inputs": {"a": ["1", 0], "b": ["2", 0]}},
        "2": {"class_type": "Source", "inputs": {"value": 4, "seed": 0}},
        "1": {"class_type": "Source", "inputs": {"value": 3, "seed": 0}},
        "9": {"class_type": "Source", "inputs": {"value": 9, "seed": 0}},  # feeds no output: not run
    }


def test_runs_in_dependency_order_and_passes_results():
    results = execute_graph(make_graph(), MAPPINGS, progress=False)
    assert results.order == ["1", "2", "3", "5"]
    assert CALLS == [("Source", 3), ("Source", 4), ("Add", 3, 4, 2.0, None, "3"), ("Show", 14.0, "v3")]
    assert results["3"] == (14.0,)
    assert results["1"] == (3, "v3")
    assert results["5"] == ()
    assert "9" not in results


def test_ui_dicts_are_returned():
    results = execute_graph(make_graph(), MAPPINGS, progress=False)
    assert results.ui == {"5": {"text": ["v3=14.0"]}}


def test_without_output_node_everything_runs():
    graph = make_graph()
    del graph["5"]
    assert execution_order(graph, MAPPINGS) == ["1", "2", "3", "9"]


def test_optional_inputs_are_passed_only_when_present():
    graph = make_graph()
    graph["3"]["inputs"]["scale"] = 0.5
    graph["3"]["inputs"]["extra"] = ["9", 0]
    execute_graph(graph, MAPPINGS, progress=False)
    assert ("Add", 3, 4, 0.5, 9, "3") in CALLS
    assert ("Source", 9) in CALLS  # now needed by an output


def test_on_node_reports_executing_and_executed():
    events = []
    execute_graph(make_graph(), MAPPINGS, progress=False, on_node=lambda *e: events.append(e))
    assert events[:2] == [("executing", "1", None), ("executed", "1", None)]
    assert events[-1] == ("executed", "5", {"text": ["v3=14.0"]})
    assert len(events) == 8


def test_progress_bar_names_the_node(capsys):
    execute_graph(make_graph(), MAPPINGS, progress=True)
    assert "node 4/4: Show it" in capsys.readouterr().err


def test_node_error_names_the_node_and_chains_the_cause():
    graph = make_graph()
    graph["4"] = {"class_type": "Boom", "inputs": {"num": ["1", 0]}, "_meta": {"title": "Cache Embeds"}}
    graph["5"]["inputs"]["num"] = ["4", 0]
    with pytest.raises(NodeExecutionError) as info:
        execute_graph(graph, MAPPINGS, progress=False)
    err = info.value
    assert err.node_id == "4" and err.class_type == "Boom"
    assert 'node 4 "Cache Embeds" (Boom)' in str(err) and "dataset folder is empty" in str(err)
    assert isinstance(err.__cause__, ValueError)
    assert ("Show", 14.0, "v3") not in CALLS


def test_keyboard_interrupt_propagates_unchanged():
    graph = make_graph()
    graph["4"] = {"class_type": "Interrupt", "inputs": {"num": ["1", 0]}}
    graph["5"]["inputs"]["num"] = ["4", 0]
    with pytest.raises(KeyboardInterrupt):
        execute_graph(graph, MAPPINGS, progress=False)


def test_invalid_graph_is_rejected_before_running():
    graph = make_graph()
    graph["3"]["inputs"]["b"] = ["1", 1]  # STRING into FAKE_NUM
    with pytest.raises(WorkflowError, match='node 3.*"b"'):
        execute_graph(graph, MAPPINGS, progress=False)
    assert CALLS == []


# ----------------------------------------------------------------- run command


def parse(argv):
    parser = argparse.ArgumentParser(prog="lowvram-lora")
    add_run_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def write(tmp_path, graph, name="wf.json"):
    path = tmp_path / name
    path.write_text(json.dumps(graph))
    return str(path)


def test_run_parser_defaults():
    args = parse(["run", "wf.json"])
    assert (args.workflow, args.overrides, args.models_dir, args.output_dir) == ("wf.json", [], "./models", "./output")
    assert not args.no_progress and not args.traceback
    args = parse(["run", "wf.json", "--set", "1.value=5", "--set", "2.value=6", "--no-progress", "--traceback"])
    assert args.overrides == ["1.value=5", "2.value=6"] and args.no_progress and args.traceback


def test_run_succeeds_and_configures_dirs(tmp_path, capsys):
    dirs = []
    args = parse(["run", write(tmp_path, make_graph()), "--set", "1.value=10", "--no-progress",
                  "--models-dir", str(tmp_path / "m"), "--output-dir", str(tmp_path / "o")])
    code = run_workflow_command(args, MAPPINGS, configure_dirs=lambda m, o: dirs.append((m, o)))
    assert code == 0
    assert dirs == [(str(tmp_path / "m"), str(tmp_path / "o"))]
    assert ("Show", 28.0, "v10") in CALLS
    out = capsys.readouterr().out
    assert "done: 4 node(s)" in out and "v10=28.0" in out


def test_run_bad_workflow_exits_1_without_traceback(tmp_path, capsys):
    graph = make_graph()
    graph["2"]["inputs"]["value"] = 500
    dirs = []
    code = run_workflow_command(parse(["run", write(tmp_path, graph)]), MAPPINGS,
                                configure_dirs=lambda m, o: dirs.append(m))
    err = capsys.readouterr().err
    assert code == 1 and CALLS == []  # dirs are configured first (combos list files from them)
    assert "error: node 2" in err and '"value"' in err and "Traceback" not in err


def test_run_bad_override_and_missing_file_exit_1(tmp_path, capsys):
    assert run_workflow_command(parse(["run", write(tmp_path, make_graph()), "--set", "7.value=1"]), MAPPINGS) == 1
    assert run_workflow_command(parse(["run", str(tmp_path / "nope.json")]), MAPPINGS) == 1
    err = capsys.readouterr().err
    assert "7" in err and "cannot read" in err


def test_run_node_error_exits_1_and_traceback_flag_shows_it(tmp_path, capsys):
    graph = make_graph()
    graph["4"] = {"class_type": "Boom", "inputs": {"num": ["1", 0]}}
    graph["5"]["inputs"]["num"] = ["4", 0]
    path = write(tmp_path, graph)
    assert run_workflow_command(parse(["run", path, "--no-progress"]), MAPPINGS) == 1
    err = capsys.readouterr().err
    assert "error: node 4 (Boom) failed: ValueError: dataset folder is empty" in err and "Traceback" not in err
    assert run_workflow_command(parse(["run", path, "--no-progress", "--traceback"]), MAPPINGS) == 1
    assert "Traceback" in capsys.readouterr().err


def test_run_interrupted_exits_130(tmp_path, capsys):
    graph = make_graph()
    graph["4"] = {"class_type": "Interrupt", "inputs": {"num": ["1", 0]}}
    graph["5"]["inputs"]["num"] = ["4", 0]
    assert run_workflow_command(parse(["run", write(tmp_path, graph), "--no-progress"]), MAPPINGS) == 130
    assert "interrupted" in capsys.readouterr().err
