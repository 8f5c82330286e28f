"""The shipped templates' folder and model metadata (issue 28), and how ``lowvram-lora run`` finds them.

- ComfyUI reads a pack's templates from ``example_workflows/`` without the rename suggestion it logs for the
  other folder names (``app/custom_node_manager.py``).
- Each model file a template names carries ComfyUI's ``properties.models`` entry ({name, url, directory}) on
  the node whose widget holds it, with the URL ComfyUI's own templates give for that file: checked against
  the ``comfyui_workflow_templates`` package of a ComfyUI install where one is found.
"""
import glob
import importlib.util
import json
import math
import os
from pathlib import Path

import pytest

from lowvram_lora.engine.families import TrainingTemplate
from lowvram_lora.host import templates as T
from lowvram_lora.host.run_command import find_workflow
from lowvram_lora.host.workflow import WorkflowError
from lowvram_lora.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
from lowvram_lora.nodes.paths import TEXT_ENCODER_FOLDERS, TRANSFORMER_FOLDERS, VAE_FOLDERS

from helpers import train_input

ROOT = Path(__file__).resolve().parent.parent


def _ui(name):
    return json.loads((T.WORKFLOWS_DIR / f"{name}.json").read_text())


def test_templates_live_in_example_workflows_only():
    assert T.WORKFLOWS_DIR == ROOT / "example_workflows"
    # ComfyUI's glob (custom_node_manager.get_workflow_templates): <pack>/<folder>/*.json, one level
    listed = sorted(Path(p).stem for p in glob.glob(str(ROOT / "example_workflows" / "*.json")))
    assert listed == sorted([*T.SHIPPED, *T.TRY_TEMPLATES])
    # none of the folders ComfyUI would log "consider renaming it to 'example_workflows'" for
    for other in ("example", "examples", "workflow", "workflows"):
        assert not (ROOT / other).exists(), f"{other}/ makes ComfyUI suggest a rename; templates go in example_workflows/"


def test_model_folders_are_the_ones_the_nodes_read():
    assert T.MODEL_FOLDERS["checkpoint"] == TRANSFORMER_FOLDERS[0]
    assert T.MODEL_FOLDERS["text_encoder_1"] == T.MODEL_FOLDERS["text_encoder_2"] == TEXT_ENCODER_FOLDERS[0]
    assert T.MODEL_FOLDERS["vae_file"] == VAE_FOLDERS[0]


def _selected_models(node):
    """The frontend's rule (missingModelScan getSelectedModelsMetadata, 1.58): a node's declared models whose
    name is one of its string widget values."""
    values = {v for v in node.get("widgets_values", []) if isinstance(v, str) and v.strip()}
    return [m for m in node.get("properties", {}).get("models", []) if m["name"] in values]


@pytest.mark.parametrize("name", sorted(T.SHIPPED))
def test_every_download_is_declared_on_the_node_that_names_the_file(name):
    template = T.SHIPPED[name]
    declared = {}
    for node in _ui(name)["nodes"]:
        models = node.get("properties", {}).get("models", [])
        assert _selected_models(node) == models, f"{node['type']}: a declared model no widget selects"
        for m in models:
            assert set(m) == {"name", "url", "directory"}
            # a folder the widget lists (nodes/paths.py: an all-in-one checkpoint in checkpoints, an image encoder
            # in clip_vision)
            assert m["directory"] in set(T.MODEL_FOLDERS.values()) | set(TRANSFORMER_FOLDERS + TEXT_ENCODER_FOLDERS)
            assert m["url"].startswith("https://huggingface.co/") and "/resolve/main/" in m["url"]
            assert m["url"].rsplit("/", 1)[-1] == m["name"], "the downloaded file must keep the name the widget holds"
            declared[m["name"]] = m["url"]
    assert declared == template.downloads


def test_demo_and_files_without_an_official_url_declare_nothing():
    assert not any(n.get("properties", {}).get("models") for n in _ui("demo_tiny_lora")["nodes"])
    lumina = {m["name"] for n in _ui("lumina2_lora")["nodes"] for m in n.get("properties", {}).get("models", [])}
    assert lumina == {"ae.safetensors"}  # ComfyUI's templates give no URL for its split transformer or Gemma


def test_a_download_no_widget_names_is_refused():
    t = T.SHIPPED["flux1_dev_lora"]
    stale = TrainingTemplate(**{**t.__dict__, "downloads": {**t.downloads, "flux1-schnell.safetensors": "https://x"}})
    nodes = T._train_graph(stale.load, stale.cache, stale.offload, stale.train, stale.save)
    with pytest.raises(ValueError, match="flux1-schnell.safetensors"):
        T._attach_models(stale, nodes)


def _comfyui_template_dirs():
    found = []
    spec = importlib.util.find_spec("comfyui_workflow_templates_json")
    if spec and spec.submodule_search_locations:
        found += [Path(p) / "templates" for p in spec.submodule_search_locations]
    comfy = os.environ.get("LOWVRAM_COMFYUI_DIR")
    if comfy:
        found += [Path(p) for p in glob.glob(f"{comfy}/venv/lib/python*/site-packages/comfyui_workflow_templates_json/templates")]
    return [d for d in found if d.is_dir()]


def test_urls_are_the_ones_comfyuis_own_templates_give():
    dirs = _comfyui_template_dirs()
    if not dirs:
        pytest.skip("no comfyui_workflow_templates_json here (set LOWVRAM_COMFYUI_DIR to a ComfyUI with its venv)")
    official: dict[tuple[str, str], set[str]] = {}

    def walk(graph):
        for node in graph.get("nodes", []):
            for m in (node.get("properties") or {}).get("models") or []:
                if isinstance(m, dict) and {"name", "url", "directory"} <= set(m):
                    official.setdefault((m["name"], m["directory"]), set()).add(m["url"].split("?")[0])
        for sub in (graph.get("definitions") or {}).get("subgraphs", []):
            walk(sub)

    for d in dirs:
        for f in d.glob("*.json"):
            try:
                graph = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(graph, dict):
                walk(graph)
    assert len(official) > 50, "ComfyUI's templates were not read"
    known_names = {n for n, _ in official}
    unverified = []
    for name in T.SHIPPED:
        for node in _ui(name)["nodes"]:
            for m in node.get("properties", {}).get("models", []):
                if m["name"] not in known_names:  # a model newer than this ComfyUI's templates (Krea 2 in 0.33)
                    unverified.append(f"{name}: {m['name']}")
                    continue
                assert m["url"] in official.get((m["name"], m["directory"]), set()), (
                    f"{name}: {m['name']} ({m['directory']}) -> {m['url']} is not a URL ComfyUI's own templates use")
    if unverified:
        import warnings

        warnings.warn(f"not in this ComfyUI's templates, URLs unverified: {', '.join(unverified)}")


def test_build_matches_the_shipped_files_with_models():
    ui, _ = T.build("flux2_dev_lora", NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS)
    assert ui == _ui("flux2_dev_lora")


# ----------------------------------------------------------------- lowvram-lora run: which file


def test_run_finds_a_shipped_template_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no example_workflows/ here: an installed package, run from anywhere
    assert find_workflow("demo_tiny_lora") == T.WORKFLOWS_DIR / "demo_tiny_lora.json"
    assert find_workflow("flux1_dev_lora.json") == T.WORKFLOWS_DIR / "flux1_dev_lora.json"
    assert find_workflow("api/z_image_lora") == T.WORKFLOWS_DIR / "api" / "z_image_lora.json"


def test_run_finds_an_old_workflows_path_and_says_where_it_moved(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert find_workflow("workflows/demo_tiny_lora.json") == T.WORKFLOWS_DIR / "demo_tiny_lora.json"
    assert "example_workflows/" in capsys.readouterr().err
    assert find_workflow("x/workflows/api/flux1_dev_lora.json") == T.WORKFLOWS_DIR / "api" / "flux1_dev_lora.json"


def test_run_prefers_a_file_that_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo_tiny_lora").write_text("{}")
    assert find_workflow("demo_tiny_lora") == Path("demo_tiny_lora")


def test_run_names_the_templates_when_nothing_is_found(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for given in ("nope.json", "workflows/nope.json"):
        with pytest.raises(WorkflowError, match="no such file") as e:
            find_workflow(given)
        assert "demo_tiny_lora" in str(e.value) and "flux1_dev_lora" in str(e.value)


def test_a_template_with_chains_lays_out_one_full_training_chain_each():
    """Wan 2.2 A14B: one Load -> Cache -> Train -> Save chain per expert file, each linked within itself only,
    labelled, saving its own LoRA; the chain's values over the template's (the API form the server runs)."""
    ui, api = T.build("wan22_t2v_lora", NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS)
    t = T.SHIPPED["wan22_t2v_lora"]
    trains = {k: v for k, v in api.items() if v["class_type"] == "LowVRAMTrainLoRA"}
    assert sorted(trains) == ["14", "4"]
    for train_id, expert, ckpt in (("4", "high noise", t.load["checkpoint"]),
                                   ("14", "low noise", t.chains[0]["load"]["checkpoint"])):
        chain = {str(int(train_id) - 4 + i) for i in range(1, 6)}
        train = api[train_id]
        assert {train["inputs"][k][0] for k in ("model", "dataset", "offload")} <= chain
        assert api[train["inputs"]["model"][0]]["inputs"]["checkpoint"] == ckpt
        assert all(expert in api[i]["_meta"]["title"] for i in chain)
        save = next(v for i, v in api.items() if v["class_type"] == "LowVRAMSaveLoRA" and i in chain)
        assert save["inputs"]["lora"] == [train_id, 0]
    prefixes = {v["inputs"]["filename_prefix"] for v in api.values() if v["class_type"] == "LowVRAMSaveLoRA"}
    assert prefixes == {"loras/wan22_t2v_high_noise_lora", "loras/wan22_t2v_low_noise_lora"}
    assert train_input(api, "14", "sample_guidance") == 3.0 and train_input(api, "4", "sample_guidance") == 4.0
    # The only links across chains: each Train LoRA's preview_partner is the other chain's Load (the other expert).
    assert api["4"]["inputs"]["preview_partner"] == ["11", 0] and api["14"]["inputs"]["preview_partner"] == ["1", 0]
    assert api["11"]["inputs"]["checkpoint"] == t.chains[0]["load"]["checkpoint"]
    assert api["4"]["inputs"]["sample_every"] == api["14"]["inputs"]["sample_every"] == 250
    # In the UI file each runs through Reroute nodes (host/reroutes.py): followed back to its real source.
    crossing = [l for l in ui["links"] if _kind(ui, l[3]) != "Reroute" and _source(ui, l)[1] // 10 != l[3] // 10]
    assert sorted((_source(ui, l)[1], l[3]) for l in crossing) == [(1, 14), (11, 4)]
    train_ui = next(n for n in ui["nodes"] if n["id"] == 4)
    slot = next(i for i, x in enumerate(train_ui["inputs"]) if x["name"] == "preview_partner")
    assert all(l[4] == slot and l[5] == "LOWVRAM_MODEL" for l in crossing)
    with pytest.raises(ValueError, match="two different chains"):
        T._graph(TrainingTemplate(**{**t.__dict__, "chain_links": ((0, "preview_partner", 0),)}))
    bad = TrainingTemplate(**{**t.__dict__, "chains": ({"laod": {}},)})
    with pytest.raises(ValueError, match="laod"):
        T._graph(bad)


@pytest.mark.parametrize("path", sorted(T.WORKFLOWS_DIR.glob("*.json")), ids=lambda p: p.stem)
def test_shipped_nodes_are_wide_enough_for_their_values_and_never_overlap(path):
    """Frontend 1.49 cuts a widget's label to "t…" when label and value do not fit the node (Wan's
    text_encoder_1 beside umt5_xxl_fp8_e4m3fn_scaled.safetensors at 340 px): every node is at least as wide as its
    longest single-line widget row needs (``templates._fitted_size``'s estimate), and no two boxes (title bars
    included) overlap after the columns were pushed along."""
    from lowvram_lora.host.comfy_nodes import COMFY_NODES  # the train-and-try graphs' ComfyUI nodes
    from lowvram_lora.host.workflow import input_specs

    ui = json.loads(path.read_text())
    boxes = []
    for n in ui["nodes"]:
        boxes.append((n["pos"][0], n["pos"][1] - T.TITLE_H, n["size"][0], n["size"][1] + T.TITLE_H, n["id"]))
        if n["type"] in ("Note", "Reroute"):
            continue
        specs = [s for s in input_specs({**NODE_CLASS_MAPPINGS, **COMFY_NODES}[n["type"]])
                 if s.is_widget and s.name not in {i["name"] for i in n["inputs"]}]
        values = iter(n["widgets_values"])
        for s in specs:
            value = next(values)
            for _ in range(s.control_slots):
                next(values)
            if not s.options.get("multiline"):
                need = min(T.WIDGET_PAD_PX + T.WIDGET_CHAR_PX * (len(s.name) + len(str(value))), T.MAX_NODE_W)
                assert n["size"][0] >= need, (n["type"], s.name, value)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            apart = a[0] + a[2] <= b[0] or b[0] + b[2] <= a[0] or a[1] + a[3] <= b[1] or b[1] + b[3] <= a[1]
            assert apart, (a[4], b[4])


# ------------------------------------------------------------- links between chains: drawn where they can be seen


def _kind(ui, node_id):
    return next(n["type"] for n in ui["nodes"] if n["id"] == node_id)


def _source(ui, link):
    """The link that leaves a real node, followed back through Reroute nodes."""
    while _kind(ui, link[1]) == "Reroute":
        link = next(l for l in ui["links"] if l[3] == link[1])
    return link


def _input_name(ui, link):
    return next(n for n in ui["nodes"] if n["id"] == link[3])["inputs"][link[4]]["name"]


def _painted(node):
    """The area the editor paints for a node: its title bar stands TITLE_H above pos (a Reroute has none)."""
    x, y = node["pos"]
    w, h = node["size"]
    return (x, y, w, h) if node["type"] == "Reroute" else (x, y - T.TITLE_H, w, h + T.TITLE_H)


def _passes_under(p, q, box):
    """Whether segment p-q enters the inside of box (x, y, w, h): sampled at least every half pixel."""
    steps = int(2 * max(abs(q[0] - p[0]), abs(q[1] - p[1]))) + 2
    for i in range(steps + 1):
        x, y = p[0] + (q[0] - p[0]) * i / steps, p[1] + (q[1] - p[1]) * i / steps
        if box[0] < x < box[0] + box[2] and box[1] < y < box[1] + box[3]:
            return True
    return False


def _bezier(p, q):
    """The link p -> q as the frontend's default spline mode draws it (LGraphCanvas.renderLink, frontend 1.49:
    control points a quarter of the distance right of the output and left of the input), every ~half pixel."""
    d = math.dist(p, q)
    a, b = (p[0] + d / 4, p[1]), (q[0] - d / 4, q[1])
    n = int(3 * d) + 4
    for i in range(n + 1):
        t = i / n
        yield tuple((1 - t) ** 3 * p[k] + 3 * (1 - t) ** 2 * t * a[k] + 3 * (1 - t) * t ** 2 * b[k] + t ** 3 * q[k]
                    for k in (0, 1))


def _segments(ui, link):
    """The straight pieces a link is drawn as, from its real source through every Reroute to its target:
    [(from node id, point, to node id, point)]. Slots sit where LiteGraph draws them: outputs on the right edge,
    inputs on the left, slot i (i + 0.7) * 20 px below pos, counted over the node's socket inputs (the frontend
    draws widgets' sockets at the widgets); a Reroute's in the middle of its left and right edges."""
    from lowvram_lora.host.workflow import input_specs

    nodes = {n["id"]: n for n in ui["nodes"]}
    out = []
    while True:
        src, dst = nodes[link[1]], nodes[link[3]]
        if src["type"] == "Reroute":
            p = (src["pos"][0] + src["size"][0], src["pos"][1] + src["size"][1] / 2)
        else:
            p = (src["pos"][0] + src["size"][0], src["pos"][1] + (link[2] + 0.7) * 20)
        if dst["type"] == "Reroute":
            q = (dst["pos"][0], dst["pos"][1] + dst["size"][1] / 2)
        else:
            name = dst["inputs"][link[4]]["name"]
            sockets = [s.name for s in input_specs(NODE_CLASS_MAPPINGS[dst["type"]]) if not s.is_widget]
            q = (dst["pos"][0], dst["pos"][1] + (sockets.index(name) + 0.7) * 20)
        out.insert(0, (src["id"], p, dst["id"], q))
        if src["type"] != "Reroute":
            return out
        link = next(l for l in ui["links"] if l[3] == src["id"])


@pytest.mark.parametrize("name", sorted(n for n, t in T.SHIPPED.items() if t.chain_links))
def test_links_between_chains_run_clear_of_every_node(name, models_with_empty_files):
    """Each link between chains (chain_links: Wan 2.2 A14B's preview_partner) is drawn through Reroute nodes,
    and no piece of it passes under a node (the two it joins included; its slots are on their edges), drawn
    straight (the linear and straight link modes) or as the default spline: drawn directly it would run behind
    the Cache Text Embeds column. The API form is untouched: the Train LoRA's input names the other
    chain's Load node, and the UI file (its reroutes followed, as the frontend's graphToPrompt does) gives the
    same prompt."""
    from lowvram_lora.host.workflow import load_workflow, to_api_graph

    ui = _ui(name)
    api = json.loads((T.WORKFLOWS_DIR / "api" / f"{name}.json").read_text())
    template = T.SHIPPED[name]
    boxes = {n["id"]: _painted(n) for n in ui["nodes"]}
    ends = [l for l in ui["links"]
            if _kind(ui, l[3]) != "Reroute" and _source(ui, l)[1] // T.CHAIN_IDS != l[3] // T.CHAIN_IDS]
    assert len(ends) == len(template.chain_links)
    for chain, input_name, source in template.chain_links:
        train, load = str(4 + chain * T.CHAIN_IDS), str(1 + source * T.CHAIN_IDS)
        assert api[train]["inputs"][input_name] == [load, 0]
    for link in ends:
        pieces = _segments(ui, link)
        assert len(pieces) >= 2, f"link {link} is drawn directly"
        (a, p, _, _), (_, _, b, q) = pieces[0], pieces[-1]
        assert a == int(api[str(b)]["inputs"][_input_name(ui, link)][0])
        direct = [i for i, box in boxes.items() if i not in (a, b) and _passes_under(p, q, box)]
        assert direct, "drawn straight this link would be visible anyway; the check below proves nothing"
        for a, p, b, q in pieces:  # the two nodes a piece joins included: it may only touch their edges
            under = [i for i, box in boxes.items() if _passes_under(p, q, box)]
            assert not under, f"{name}: the piece {a} -> {b} of link {link[0]} passes under node(s) {under}"
            curve = list(_bezier(p, q))
            under = [i for i, (x, y, w, h) in boxes.items()
                     if any(x < cx < x + w and y < cy < y + h for cx, cy in curve)]
            assert not under, f"{name}: the spline {a} -> {b} of link {link[0]} passes under node(s) {under}"
    strip = lambda g: {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in g.items()}
    from_ui = to_api_graph(load_workflow(T.WORKFLOWS_DIR / f"{name}.json"), NODE_CLASS_MAPPINGS)
    assert strip(from_ui) == strip(api)
    # ... and it is what the graph gives without the reroutes
    nodes, _ = T._graph(template)
    for node in nodes:
        node.rerouted.clear()
    assert T.to_api(nodes, NODE_CLASS_MAPPINGS) == api
