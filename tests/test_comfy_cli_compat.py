"""What ComfyUI's /object_info says about our nodes, and what `comfy run` makes of our UI workflows.

`comfy run --workflow example_workflows/NAME.json --wait` (comfy-cli) converts a UI-format
workflow client-side: it GETs /object_info, calls
``comfy_cli.workflow_to_api.convert_ui_to_api(workflow, object_info)``, checks the
result with ``comfy_cli.cql.engine.Graph.validate_workflow`` (its preflight) and POSTs
``{"prompt": <result>, "client_id": ..., "extra_data": {...}}`` to /prompt.

ComfyUI cannot be installed here, so /object_info comes from
``comfyui_object_info.py`` (a port of ComfyUI's ``node_info``). The first tests
check that port against our node classes and always run. The comfy-cli tests
run comfy-cli's own converter and preflight in-process on the shipped UI
workflows and are skipped where comfy-cli is not installed (CI does not install
it; it is not a project dependency).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lowvram_lora.host.object_info import PACK_MODULE, node_info, object_info  # noqa: E402

from lowvram_lora.host.templates import SHIPPED, WORKFLOWS_DIR  # noqa: E402
from lowvram_lora.host.workflow import hidden_inputs, input_specs, return_types  # noqa: E402
from lowvram_lora.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402
from lowvram_lora.nodes import paths  # noqa: E402
from lowvram_lora.nodes.paths import configure_standalone_dirs  # noqa: E402

NAMES = sorted(SHIPPED)
#: The hidden input kinds ComfyUI's executor fills (execution.get_input_data).
COMFY_HIDDEN_KINDS = {"PROMPT", "DYNPROMPT", "EXTRA_PNGINFO", "UNIQUE_ID", "AUTH_TOKEN_COMFY_ORG", "API_KEY_COMFY_ORG"}


@pytest.fixture(autouse=True)
def _restore_standalone_dirs():
    saved = dict(paths._standalone)
    yield
    paths._standalone.update(saved)


@pytest.fixture
def info(models_with_empty_files):
    errors: list[str] = []
    out = object_info(NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, errors=errors)
    assert errors == []
    return out


# --------------------------------------------------------------------------- /object_info


def test_object_info_describes_every_node(info):
    assert list(info) == list(NODE_CLASS_MAPPINGS)


def test_object_info_without_any_model_files_still_describes_every_node(tmp_path):
    configure_standalone_dirs(str(tmp_path / "nothing"), str(tmp_path / "out"))
    errors: list[str] = []
    out = object_info(NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, errors=errors)
    assert errors == [] and list(out) == list(NODE_CLASS_MAPPINGS)

    def options(node, name):
        kind, spec = out[node]["input"]["required"][name]
        assert kind == "COMBO"  # V3 combos: the options travel in the spec (io.Combo.Input.as_dict)
        return spec["options"]

    assert options("LowVRAMLoadQuantizedSlab", "checkpoint") == []
    assert options("LowVRAMCacheTextEmbeds", "text_encoders") == ["(from checkpoint)", "(single files below)"]
    assert options("LowVRAMCacheTextEmbeds", "vae_file") == ["(none)"]


@pytest.mark.parametrize("class_type", list(NODE_CLASS_MAPPINGS))
def test_inputs_outputs_and_flags_as_comfyui_sends_them(info, class_type):
    """The fields of ComfyUI's V3 ``asdict(Schema.get_v1_info(cls))`` (nodes/schema.py ports it; the
    real-ComfyUI test compares it with ComfyUI's own)."""
    cls = NODE_CLASS_MAPPINGS[class_type]
    node = info[class_type]
    declared = cls.INPUT_TYPES()

    # Inputs: INPUT_TYPES as JSON (tuples become lists), sections and order kept.
    assert node["input"] == json.loads(json.dumps(declared))
    assert list(node["input"]) == list(declared)
    assert set(declared) <= {"required", "optional", "hidden"} and "required" in declared
    assert node["input_order"] == {section: list(entries) for section, entries in declared.items()}
    # The order the headless runner reads widgets_values in is ComfyUI's required + optional order.
    assert [s.name for s in input_specs(cls)] == (node["input_order"]["required"]
                                                  + node["input_order"].get("optional", []))
    hidden = node["input"].get("hidden", {})
    assert {k: v[0] for k, v in hidden.items()} == hidden_inputs(cls)
    assert set(hidden_inputs(cls).values()) <= COMFY_HIDDEN_KINDS
    for section in ("required", "optional"):
        for name, spec in node["input"].get(section, {}).items():
            assert isinstance(spec, list) and len(spec) == 2, name
            kind, options = spec
            assert isinstance(kind, str) and isinstance(options, dict) and options.get("tooltip"), name
            if "default" in options and kind in ("INT", "FLOAT"):
                assert options.get("min", options["default"]) <= options["default"] <= options.get("max", options["default"])
            if kind == "COMBO":
                assert options["multiselect"] is False and isinstance(options["options"], list), name
                if "default" in options and options["options"]:
                    assert options["default"] in options["options"], name

    # Outputs.
    outputs = list(return_types(cls))
    assert node["output"] == outputs
    assert node["output_is_list"] == [False] * len(outputs)
    assert node["output_name"] == list(cls.RETURN_NAMES)
    assert node["output_tooltips"] == list(cls.OUTPUT_TOOLTIPS) and all(node["output_tooltips"])
    assert node["output_matchtypes"] is None

    # Flags and labels.
    assert node["output_node"] is (class_type == "LowVRAMSaveLoRA")
    # Images to Dataset takes ComfyUI's dataset lists whole
    assert node["is_input_list"] is (class_type == "LowVRAMImagesToDataset")
    assert node["has_intermediate_output"] is False
    assert node["name"] == class_type
    assert node["display_name"] == NODE_DISPLAY_NAME_MAPPINGS[class_type]
    assert node["category"] == "LowVRAM LoRA"
    assert node["python_module"] == PACK_MODULE == "custom_nodes.lowvram-lora"
    assert isinstance(node["description"], str) and node["description"]
    assert node["search_aliases"] == (cls.GET_SCHEMA().search_aliases or None)
    assert node["deprecated"] is node["experimental"] is node["dev_only"] is node["api_node"] is False


def test_one_node_exactly_as_comfyui_sends_it(info):
    save = NODE_CLASS_MAPPINGS["LowVRAMSaveLoRA"]
    spec = save.INPUT_TYPES()["required"]
    assert info["LowVRAMSaveLoRA"] == {
        "input": {"required": {
            "lora": ["LOWVRAM_LORA", {"tooltip": spec["lora"][1]["tooltip"]}],
            "filename_prefix": ["STRING", {"tooltip": spec["filename_prefix"][1]["tooltip"],
                                           "default": "loras/flux_lora", "multiline": False}],
            "format": ["COMBO", {"tooltip": spec["format"][1]["tooltip"], "default": "comfyui",
                                 "multiselect": False, "options": ["comfyui", "diffusers"]}],
            "dtype": ["COMBO", {"tooltip": spec["dtype"][1]["tooltip"], "default": "bf16",
                                "multiselect": False, "options": ["bf16", "fp16", "fp32"]}],
        }, "hidden": {"prompt": ["PROMPT"], "extra_pnginfo": ["EXTRA_PNGINFO"]}},  # io.Schema.finalize adds them
        "input_order": {"required": ["lora", "filename_prefix", "format", "dtype"],
                        "hidden": ["prompt", "extra_pnginfo"]},
        "is_input_list": False,
        "output": [],
        "output_is_list": [],
        "output_name": [],
        "output_tooltips": [],
        "output_matchtypes": None,
        "name": "LowVRAMSaveLoRA",
        "display_name": "Save LoRA (LowVRAM)",
        "description": save.DESCRIPTION,
        "python_module": "custom_nodes.lowvram-lora",
        "category": "LowVRAM LoRA",
        "output_node": True,
        "deprecated": False,
        "experimental": False,
        "dev_only": False,
        "api_node": False,
        "price_badge": None,
        "search_aliases": None,
        "essentials_category": None,
        "has_intermediate_output": False,
    }
    train = info["LowVRAMTrainLoRA"]
    # prompt: a workflow saved before Training / Preview Options gives Train LoRA their settings by name
    assert train["input"]["hidden"] == {"unique_id": ["UNIQUE_ID"], "prompt": ["PROMPT"]}
    assert train["input_order"]["hidden"] == ["unique_id", "prompt"]
    assert train["input_order"]["required"][:4] == ["model", "dataset", "offload", "steps"]
    assert train["output"] == ["LOWVRAM_LORA", "IMAGE", "IMAGE", "LORA_MODEL", "LOSS_MAP"]
    assert train["output_name"] == ["lora", "loss_curve", "samples", "lora_model", "loss_map"]


def test_node_info_uses_the_loader_module_name_or_the_class_attribute():
    assert node_info("LowVRAMOffloadConfig", NODE_CLASS_MAPPINGS, {}, "custom_nodes.other")["python_module"] \
        == "custom_nodes.other"
    plain = node_info("LowVRAMOffloadConfig", NODE_CLASS_MAPPINGS, {}, None)
    # A V3 node names itself (its schema's display_name) whatever the display-name mapping says.
    assert plain["python_module"] is None and plain["display_name"] == "Offload Config"  # as ComfyUI's V3 nodes


# --------------------------------------------------------------------------- comfy-cli


@pytest.fixture(scope="session")
def w2a(tmp_path_factory):
    """comfy-cli's ``workflow_to_api`` module, or skip. comfy-cli creates ``~/.config/comfy-cli``
    when imported, so it is imported with HOME in a temporary folder (and telemetry off)."""
    with pytest.MonkeyPatch.context() as mp:
        if "comfy_cli" not in sys.modules:
            mp.setenv("HOME", str(tmp_path_factory.mktemp("comfy_cli_home")))
        mp.setenv("DO_NOT_TRACK", "1")
        module = pytest.importorskip("comfy_cli.workflow_to_api", reason="comfy-cli is not installed (pip install comfy-cli)")
        import comfy_cli.command.run  # noqa: F401
        import comfy_cli.cql.engine  # noqa: F401
    return module


def _strip(prompt: dict) -> dict:
    return {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in prompt.items()}


@pytest.mark.parametrize("name", NAMES)
def test_comfy_cli_converts_ui_workflow_to_our_api_twin(info, w2a, name):
    ui = json.loads((WORKFLOWS_DIR / f"{name}.json").read_text())
    api = json.loads((WORKFLOWS_DIR / "api" / f"{name}.json").read_text())
    assert not w2a.is_api_format(ui)
    prompt = w2a.convert_ui_to_api(ui, info)
    assert _strip(prompt) == _strip(api)
    assert {k: v.get("_meta") for k, v in prompt.items()} == {k: v["_meta"] for k, v in api.items()}
    assert json.loads(json.dumps(prompt)) == prompt  # what POST /prompt carries


@pytest.mark.parametrize("name", NAMES)
def test_comfy_cli_preflight_accepts_the_converted_prompt(info, w2a, name):
    from comfy_cli.cql.engine import Graph

    prompt = w2a.convert_ui_to_api(json.loads((WORKFLOWS_DIR / f"{name}.json").read_text()), info)
    result = Graph.from_object_info(info).validate_workflow(prompt)
    assert result.get("valid") is True and result.get("errors") == [], result
    assert result.get("warnings") == [], result


@pytest.mark.parametrize("name", NAMES)
def test_comfy_cli_preflight_accepts_our_api_twin(info, w2a, name):
    from comfy_cli.cql.engine import Graph

    api = json.loads((WORKFLOWS_DIR / "api" / f"{name}.json").read_text())
    result = Graph.from_object_info(info).validate_workflow(api)
    assert result.get("valid") is True and result.get("errors") == [], result


def test_comfy_run_command_converts_with_the_same_function(info, w2a, monkeypatch, capsys):
    """`comfy run --workflow X --print-prompt` through comfy-cli's run code, /object_info faked."""
    import comfy_cli.command.run as run_mod

    monkeypatch.setenv("DO_NOT_TRACK", "1")
    fetched, converted = [], []
    real_convert = run_mod.convert_ui_to_api

    def fake_fetch(host, port, timeout):
        fetched.append((host, port))
        return info

    def spy_convert(workflow, oi):
        converted.append(real_convert(workflow, oi))
        return converted[-1]

    monkeypatch.setattr(run_mod, "fetch_object_info", fake_fetch)
    monkeypatch.setattr(run_mod, "convert_ui_to_api", spy_convert)
    name = NAMES[0]
    run_mod.execute(str(WORKFLOWS_DIR / f"{name}.json"), "127.0.0.1", 8188, print_prompt=True)
    api = json.loads((WORKFLOWS_DIR / "api" / f"{name}.json").read_text())
    assert fetched == [("127.0.0.1", 8188)]
    assert len(converted) == 1 and _strip(converted[0]) == _strip(api)


def test_comfy_cli_preflight_names_a_missing_model_file(w2a, tmp_path):
    """With the file absent from the server's combo, `comfy run` stops before POST /prompt."""
    from comfy_cli.cql.engine import Graph

    configure_standalone_dirs(str(tmp_path / "nothing"), str(tmp_path / "out"))
    info = object_info(NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS)
    prompt = w2a.convert_ui_to_api(json.loads((WORKFLOWS_DIR / "flux1_dev_lora.json").read_text()), info)
    api = json.loads((WORKFLOWS_DIR / "api" / "flux1_dev_lora.json").read_text())
    assert _strip(prompt) == _strip(api)  # values are kept as saved, not replaced by the first option
    result = Graph.from_object_info(info).validate_workflow(prompt)
    assert result["valid"] is False
    assert {(e["node_id"], e["field"]) for e in result["errors"]} == {("1", "checkpoint"), ("2", "text_encoders")}
