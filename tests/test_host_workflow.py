"""UI/API workflow conversion, validation and --set overrides (no ComfyUI, no torch)."""

import copy
import json

import pytest

from lowvram_lora.host.workflow import (
    WorkflowError,
    apply_overrides,
    detect_format,
    input_specs,
    load_workflow,
    to_api_graph,
)

# ----------------------------------------------------------------- fake node classes


class FakeLoader:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "ckpt_name": (["a.safetensors", "b.safetensors"],),
                "strength": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 2.0, "step": 0.1}),
            }
        }

    RETURN_TYPES = ("FAKE_MODEL",)
    RETURN_NAMES = ("model",)
    FUNCTION = "load"
    CATEGORY = "test"

    def load(self, ckpt_name, strength):
        return ({"ckpt": ckpt_name, "strength": strength},)


class FakeConfig:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "steps": ("INT", {"default": 10, "min": 1, "max": 1000}),
                "seed": ("INT", {"default": 0, "min": 0, "max": 2**32 - 1}),
                "mode": (["fast", "slow"], {"default": "fast"}),
            },
            "optional": {"note": ("STRING", {"default": ""}), "verbose": ("BOOLEAN", {"default": False})},
        }

    RETURN_TYPES = ("FAKE_CONFIG",)
    RETURN_NAMES = ("config",)
    FUNCTION = "make"
    CATEGORY = "test"

    def make(self, steps, seed, mode, note="", verbose=False):
        return ({"steps": steps, "seed": seed, "mode": mode, "note": note},)


class FakeTrain:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("FAKE_MODEL",),
                "config": ("FAKE_CONFIG",),
                "lr": ("FLOAT", {"default": 1e-4, "min": 0.0, "max": 1.0, "step": 1e-5}),
            },
            "optional": {"rank": ("INT", {"default": 16, "min": 1, "max": 128})},
        }

    RETURN_TYPES = ("FAKE_LORA", "FLOAT")
    RETURN_NAMES = ("lora", "final_loss")
    FUNCTION = "train"
    CATEGORY = "test"

    def train(self, model, config, lr, rank=16):
        return ({"model": model, "config": config, "lr": lr, "rank": rank}, 0.5)


class FakeSave:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"lora": ("FAKE_LORA",), "filename_prefix": ("STRING", {"default": "lora"})}}

    RETURN_TYPES = ()
    FUNCTION = "save"
    CATEGORY = "test"
    OUTPUT_NODE = True

    def save(self, lora, filename_prefix):
        return {"ui": {"text": [filename_prefix]}}


class FakePass:
    """A config pass-through, to build cycles and bypass chains."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"config": ("FAKE_CONFIG",)}, "optional": {"scale": ("FLOAT", {"default": 1.0})}}

    RETURN_TYPES = ("FAKE_CONFIG",)
    FUNCTION = "run"
    CATEGORY = "test"

    def run(self, config, scale=1.0):
        return (config,)


class FakeControls:
    """Control-after-generate edge cases: opted-out seed, FLOAT and combo with controls."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "seed": ("INT", {"default": 0, "control_after_generate": False}),
                "jitter": ("FLOAT", {"default": 0.0, "control_after_generate": True}),
                "pick": (["x", "y", "z"], {"control_after_generate": True}),
                "tag": ("STRING", {"default": ""}),
            }
        }

    RETURN_TYPES = ()
    FUNCTION = "run"
    CATEGORY = "test"
    OUTPUT_NODE = True

    def run(self, **kwargs):
        return ()


MAPPINGS = {c.__name__: c for c in (FakeLoader, FakeConfig, FakeTrain, FakeSave, FakePass, FakeControls)}

# ----------------------------------------------------------------- workflow builders


def ui_node(node_id, node_type, *, inputs=(), outputs=(), widgets=None, title=None, mode=0, order=0):
    node = {
        "id": node_id,
        "type": node_type,
        "pos": [100 * node_id, 100],
        "size": [315, 130],
        "flags": {},
        "order": order,
        "mode": mode,
        "inputs": list(inputs),
        "outputs": list(outputs),
        "properties": {"Node name for S&R": node_type},
    }
    if widgets is not None:
        node["widgets_values"] = widgets
    if title is not None:
        node["title"] = title
    return node


def ui_in(name, type_, link, widget=False):
    entry = {"name": name, "type": type_, "link": link}
    if widget:
        entry["widget"] = {"name": name}
    return entry


def ui_out(name, type_, links, slot=0, widget=None):
    entry = {"name": name, "type": type_, "links": list(links), "slot_index": slot}
    if widget:
        entry["widget"] = {"name": widget}
    return entry


def ui_workflow(nodes, links):
    return {
        "last_node_id": max(n["id"] for n in nodes),
        "last_link_id": max((link[0] for link in links), default=0),
        "nodes": nodes,
        "links": links,
        "groups": [],
        "config": {},
        "extra": {"ds": {"scale": 1.0, "offset": [0, 0]}},
        "version": 0.4,
    }


def make_ui():
    """Loader + config -> Reroute -> train (lr from a PrimitiveNode) -> save, plus a note."""
    nodes = [
        ui_node(1, "FakeLoader", title="Load Model", outputs=[ui_out("model", "FAKE_MODEL", [1])],
                widgets=["b.safetensors", 0.5]),
        ui_node(2, "FakeConfig", outputs=[ui_out("config", "FAKE_CONFIG", [2])],
                widgets=[200, 42, "randomize", "slow", "hello", True]),
        ui_node(3, "FakeTrain",
                inputs=[ui_in("model", "FAKE_MODEL", 1), ui_in("config", "FAKE_CONFIG", 3),
                        ui_in("lr", "FLOAT", 4, widget=True)],
                outputs=[ui_out("lora", "FAKE_LORA", [5]), ui_out("final_loss", "FLOAT", [], slot=1)],
                widgets=[0.001, 32]),
        ui_node(4, "FakeSave", inputs=[ui_in("lora", "FAKE_LORA", 5)], widgets=["my_lora"]),
        ui_node(5, "Note", widgets=["Remember to set the dataset path."]),
        ui_node(7, "Reroute", inputs=[ui_in("", "*", 2)], outputs=[ui_out("", "FAKE_CONFIG", [3])],
                widgets=None),
        ui_node(8, "PrimitiveNode", outputs=[ui_out("FLOAT", "FLOAT", [4], widget="lr")],
                widgets=[0.0005, "fixed"]),
    ]
    links = [
        [1, 1, 0, 3, 0, "FAKE_MODEL"],
        [2, 2, 0, 7, 0, "FAKE_CONFIG"],
        [3, 7, 0, 3, 1, "FAKE_CONFIG"],
        [4, 8, 0, 3, 2, "FLOAT"],
        [5, 3, 0, 4, 0, "FAKE_LORA"],
    ]
    return ui_workflow(nodes, links)


def make_api():
    return {
        "1": {"class_type": "FakeLoader", "inputs": {"ckpt_name": "b.safetensors", "strength": 0.5},
              "_meta": {"title": "Load Model"}},
        "2": {"class_type": "FakeConfig",
              "inputs": {"steps": 200, "seed": 42, "mode": "slow", "note": "hello", "verbose": True},
              "_meta": {"title": "FakeConfig"}},
        "3": {"class_type": "FakeTrain",
              "inputs": {"model": ["1", 0], "config": ["2", 0], "lr": 0.0005, "rank": 32},
              "_meta": {"title": "FakeTrain"}},
        "4": {"class_type": "FakeSave", "inputs": {"lora": ["3", 0], "filename_prefix": "my_lora"},
              "_meta": {"title": "FakeSave"}},
    }


def expect_error(workflow, *fragments):
    with pytest.raises(WorkflowError) as info:
        to_api_graph(workflow, MAPPINGS)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    assert "Fix:" in message
    return info.value


# ----------------------------------------------------------------- conversion


def test_formats_are_detected():
    assert detect_format(make_ui()) == "ui"
    assert detect_format(make_api()) == "api"
    with pytest.raises(WorkflowError):
        detect_format({"hello": 1})


def test_ui_and_api_twins_convert_to_the_same_graph():
    assert to_api_graph(make_ui(), MAPPINGS) == make_api()
    assert to_api_graph(make_api(), MAPPINGS) == make_api()


def test_reroute_primitive_and_note_are_resolved_away():
    graph = to_api_graph(make_ui(), MAPPINGS)
    assert set(graph) == {"1", "2", "3", "4"}  # no note 5, reroute 7, primitive 8
    assert graph["3"]["inputs"]["config"] == ["2", 0]  # through the reroute
    assert graph["3"]["inputs"]["lr"] == 0.0005  # the primitive's value wins over the stale widget


def test_chained_reroutes_are_followed():
    wf = make_ui()
    wf["nodes"].append(ui_node(9, "Reroute", inputs=[ui_in("", "*", 2)], outputs=[ui_out("", "FAKE_CONFIG", [6])]))
    wf["nodes"][5]["inputs"][0]["link"] = 6  # reroute 7 now fed by reroute 9
    wf["links"][1] = [2, 2, 0, 9, 0, "FAKE_CONFIG"]
    wf["links"].append([6, 9, 0, 7, 0, "FAKE_CONFIG"])
    assert to_api_graph(wf, MAPPINGS)["3"]["inputs"]["config"] == ["2", 0]


def test_seed_control_value_is_consumed():
    graph = to_api_graph(make_ui(), MAPPINGS)
    assert graph["2"]["inputs"] == {"steps": 200, "seed": 42, "mode": "slow", "note": "hello", "verbose": True}


def test_seed_without_stored_control_value_still_maps():
    wf = make_ui()
    wf["nodes"][1]["widgets_values"] = [200, 42, "slow", "hello", True]  # frontend that stores no control
    assert to_api_graph(wf, MAPPINGS)["2"]["inputs"]["mode"] == "slow"


def test_control_after_generate_options_are_honoured():
    # seed opted out (no slot); FLOAT control (1 slot); combo control + filter list (2 slots)
    wf = ui_workflow([ui_node(1, "FakeControls", widgets=[7, 0.25, "fixed", "y", "increment", "", "t"])], [])
    assert to_api_graph(wf, MAPPINGS)["1"]["inputs"] == {"seed": 7, "jitter": 0.25, "pick": "y", "tag": "t"}


def test_dict_widgets_values_are_supported():
    wf = make_ui()
    wf["nodes"][1]["widgets_values"] = {"steps": 200, "seed": 42, "control_after_generate": "fixed",
                                       "mode": "slow", "note": "hello", "verbose": True}
    assert to_api_graph(wf, MAPPINGS) == make_api()


def test_short_widgets_values_take_declared_defaults():
    wf = make_ui()
    wf["nodes"][1]["widgets_values"] = [200, 42, "fixed", "slow"]  # saved before note/verbose existed
    inputs = to_api_graph(wf, MAPPINGS)["2"]["inputs"]
    assert inputs["note"] == "" and inputs["verbose"] is False


def test_converted_widget_keeps_its_slot_when_linked():
    graph = to_api_graph(make_ui(), MAPPINGS)
    assert graph["3"]["inputs"]["rank"] == 32  # widgets_values [lr(stale), rank]: rank is 2nd


def test_muted_node_is_dropped_and_dependants_fail():
    wf = make_ui()
    wf["nodes"][3]["mode"] = 2  # mute the save node: fine, it is just gone
    assert "4" not in to_api_graph(wf, MAPPINGS)
    wf = make_ui()
    wf["nodes"][0]["mode"] = 2  # mute the loader: the train node loses a required input
    expect_error(wf, "node 3", '"model"', "muted")


def test_bypassed_node_passes_its_matching_input_through():
    wf = make_ui()
    wf["nodes"].append(ui_node(10, "FakePass", mode=4, inputs=[ui_in("config", "FAKE_CONFIG", 3)],
                               outputs=[ui_out("FAKE_CONFIG", "FAKE_CONFIG", [7])], widgets=[1.0]))
    wf["links"][2] = [3, 7, 0, 10, 0, "FAKE_CONFIG"]
    wf["links"].append([7, 10, 0, 3, 1, "FAKE_CONFIG"])
    wf["nodes"][2]["inputs"][1]["link"] = 7
    graph = to_api_graph(wf, MAPPINGS)
    assert "10" not in graph
    assert graph["3"]["inputs"]["config"] == ["2", 0]


def test_object_links_of_the_version_1_schema():
    wf = make_ui()
    wf["version"] = 1
    wf["links"] = [dict(zip(["id", "origin_id", "origin_slot", "target_id", "target_slot", "type"], link))
                   for link in wf["links"]]
    assert to_api_graph(wf, MAPPINGS) == make_api()


def test_load_workflow_reads_json(tmp_path):
    path = tmp_path / "wf.json"
    path.write_text(json.dumps(make_ui()))
    assert load_workflow(path) == make_ui()
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(WorkflowError, match="not valid JSON"):
        load_workflow(tmp_path / "bad.json")
    with pytest.raises(WorkflowError, match="cannot read"):
        load_workflow(tmp_path / "missing.json")


def test_input_specs_follow_declaration_order():
    names = [s.name for s in input_specs(FakeConfig)]
    assert names == ["steps", "seed", "mode", "note", "verbose"]
    assert [s.control_slots for s in input_specs(FakeConfig)] == [0, 1, 0, 0, 0]


# ----------------------------------------------------------------- validation errors


def test_unknown_node_type_lists_registered_ones():
    api = make_api()
    api["5"] = {"class_type": "KSampler", "inputs": {}}
    err = expect_error(api, "node 5", "KSampler", "FakeLoader", "FakeTrain")
    assert err.node_id == "5"


def test_unknown_node_type_in_ui_format():
    wf = make_ui()
    wf["nodes"].append(ui_node(11, "CheckpointLoaderSimple", widgets=["x.safetensors"]))
    expect_error(wf, "node 11", "CheckpointLoaderSimple", "FakeSave")


def test_link_to_missing_node():
    api = make_api()
    api["3"]["inputs"]["model"] = ["99", 0]
    err = expect_error(api, "node 3", '"model"', "99")
    assert err.input_name == "model"


def test_ui_link_from_missing_node_and_missing_link():
    wf = make_ui()
    wf["links"][0] = [1, 99, 0, 3, 0, "FAKE_MODEL"]
    expect_error(wf, "node 3", '"model"', "99")
    wf = make_ui()
    wf["nodes"][2]["inputs"][0]["link"] = 42
    expect_error(wf, "node 3", '"model"', "42")


def test_link_to_missing_output_slot():
    api = make_api()
    api["3"]["inputs"]["model"] = ["1", 3]
    expect_error(api, "node 3", '"model"', "output 3")


def test_link_type_mismatch():
    api = make_api()
    api["3"]["inputs"]["model"] = ["2", 0]
    expect_error(api, "node 3", '"model"', "FAKE_MODEL", "FAKE_CONFIG")


def test_required_input_missing():
    api = make_api()
    del api["3"]["inputs"]["config"]
    expect_error(api, "node 3", '"config"', "required")


def test_literal_given_to_a_link_input():
    api = make_api()
    api["3"]["inputs"]["model"] = "flux.safetensors"
    expect_error(api, "node 3", '"model"', "FAKE_MODEL")


def test_unknown_input_name():
    api = make_api()
    api["2"]["inputs"]["stepz"] = 5
    expect_error(api, "node 2", '"stepz"', "steps")


@pytest.mark.parametrize(
    "node_id, name, value, fragment",
    [
        ("2", "steps", "abc", "integer"),
        ("2", "steps", 2.5, "integer"),
        ("2", "steps", True, "integer"),
        ("1", "strength", "high", "number"),
        ("2", "verbose", "yes", "true or false"),
        ("2", "note", 5, "string"),
    ],
)
def test_wrong_widget_type(node_id, name, value, fragment):
    api = make_api()
    api[node_id]["inputs"][name] = value
    expect_error(api, f"node {node_id}", f'"{name}"', fragment)


def test_out_of_range():
    api = make_api()
    api["1"]["inputs"]["strength"] = 5.0
    expect_error(api, "node 1", '"Load Model"', '"strength"', "between 0.0 and 2.0")
    api = make_api()
    api["2"]["inputs"]["steps"] = 0
    expect_error(api, "node 2", '"steps"', "between 1 and 1000")


def test_bad_combo_value():
    api = make_api()
    api["1"]["inputs"]["ckpt_name"] = "zzz.safetensors"
    expect_error(api, "node 1", '"ckpt_name"', "a.safetensors")


def test_wrong_widget_type_in_ui_format():
    wf = make_ui()
    wf["nodes"][1]["widgets_values"][0] = "two hundred"
    expect_error(wf, "node 2", '"steps"')


def test_cycle_names_its_nodes():
    api = {
        "10": {"class_type": "FakePass", "inputs": {"config": ["11", 0]}},
        "11": {"class_type": "FakePass", "inputs": {"config": ["10", 0]}},
        "12": {"class_type": "FakeConfig", "inputs": {"steps": 1, "seed": 0, "mode": "fast"}},
    }
    err = expect_error(api, "cycle", "node 10", "node 11", '"config"')
    assert err.node_id == "10"


def test_integral_float_is_accepted_as_int():
    api = make_api()
    api["2"]["inputs"]["steps"] = 200.0
    graph = to_api_graph(api, MAPPINGS)
    assert graph["2"]["inputs"]["steps"] == 200 and isinstance(graph["2"]["inputs"]["steps"], int)


def test_input_is_not_modified():
    api = make_api()
    before = copy.deepcopy(api)
    to_api_graph(api, MAPPINGS)
    assert api == before


# ----------------------------------------------------------------- --set overrides


def graph():
    return to_api_graph(make_api(), MAPPINGS)


def test_overrides_parse_and_coerce():
    g = apply_overrides(graph(), ["2.steps=500", "3.lr=1e-4", "1.ckpt_name=a.safetensors",
                                  "2.note=123", '2.mode="fast"', "2.verbose=false", "1.strength=1"], MAPPINGS)
    assert g["2"]["inputs"]["steps"] == 500
    assert g["3"]["inputs"]["lr"] == 1e-4
    assert g["1"]["inputs"]["ckpt_name"] == "a.safetensors"
    assert g["2"]["inputs"]["note"] == "123"
    assert g["2"]["inputs"]["mode"] == "fast"
    assert g["2"]["inputs"]["verbose"] is False
    assert g["1"]["inputs"]["strength"] == 1.0 and isinstance(g["1"]["inputs"]["strength"], float)


def test_override_by_unique_title_and_value_with_equals():
    g = apply_overrides(graph(), ["Load Model.strength=1.5", "4.filename_prefix=a=b.c"], MAPPINGS)
    assert g["1"]["inputs"]["strength"] == 1.5
    assert g["4"]["inputs"]["filename_prefix"] == "a=b.c"


def test_override_sets_an_absent_optional_input():
    g = graph()
    del g["3"]["inputs"]["rank"]
    assert apply_overrides(g, ["3.rank=8"], MAPPINGS)["3"]["inputs"]["rank"] == 8


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("99.steps=1", ["99", "1 \"Load Model\"", "2 \"FakeConfig\""]),
        ("2.stepz=1", ["node 2", '"stepz"', "steps", "seed"]),
        ("2.steps=abc", ["node 2", '"steps"', "integer"]),
        ("2.steps=5000", ["node 2", '"steps"', "between 1 and 1000"]),
        ("1.ckpt_name=c.safetensors", ["node 1", '"ckpt_name"', "b.safetensors"]),
        ("3.model=1", ["node 3", '"model"', "link"]),
        ("steps=1", ["ID.INPUT=VALUE"]),
        ("2.steps", ["ID.INPUT=VALUE"]),
    ],
)
def test_override_errors(override, fragments):
    with pytest.raises(WorkflowError) as info:
        apply_overrides(graph(), [override], MAPPINGS)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
