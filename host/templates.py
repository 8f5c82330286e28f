"""The shipped workflows, described once and written in both ComfyUI formats.

Each family describes its own templates (``engine/families/<id>/templates.py``, ``TrainingTemplate``s);
this module lays them out as graphs and writes them. ComfyUI lists a pack's templates only from a flat
folder at the pack's root, so those files are generated from the registry. The folder is
``example_workflows/``: ComfyUI (``app/custom_node_manager.py``) also scans ``example``, ``examples``,
``workflow`` and ``workflows``, but logs a suggestion to rename any of those to ``example_workflows``.

``python -m lowvram_lora.host.templates`` (re)writes ``example_workflows/*.json`` (UI
format, what the editor loads and lists as templates), ``example_workflows/api/*.json``
(API format, what ``/prompt`` takes) and a ``<name>.jpg`` thumbnail of each (its title, description and graph:
``host/template_cards.py``).
Tests check the shipped files equal what this module produces, so the two
formats cannot drift apart.

Model files a template names get the ``properties.models`` entries ComfyUI's own templates carry
(``{"name", "url", "directory"}`` on the node whose widget holds the file name): the editor's Missing
Models dialog then offers the download. The URLs are the family's data (``TrainingTemplate.downloads``).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..engine.families import TrainingTemplate, families, family_templates
from . import reroutes
from .workflow import REROUTE_TYPE, input_specs, return_types

WORKFLOWS_DIR = Path(__file__).resolve().parent.parent / "example_workflows"
#: The folder the templates sat in before (``lowvram-lora run workflows/NAME.json`` still finds them).
OLD_WORKFLOWS_DIRNAME = "workflows"

#: The widgets that hold a model file name, and the ComfyUI models folder each reads (nodes/paths.py: the
#: first of TRANSFORMER_FOLDERS, TEXT_ENCODER_FOLDERS, VAE_FOLDERS), for ``properties.models``.
MODEL_FOLDERS = {"checkpoint": "diffusion_models", "text_encoder_1": "text_encoders",
                 "text_encoder_2": "text_encoders", "vae_file": "vae"}


@dataclass
class NodeSpec:
    id: int
    class_type: str
    title: str
    pos: tuple[int, int]
    widgets: dict[str, Any] = field(default_factory=dict)
    links: dict[str, tuple[int, int]] = field(default_factory=dict)  # input -> (source node id, output slot)
    size: tuple[int, int] = (320, 200)
    models: list[dict] = field(default_factory=list)  # properties.models: [{name, url, directory}]
    #: Inputs whose link the UI file draws through Reroute nodes (a link between chains); the API form is direct.
    rerouted: set[str] = field(default_factory=set)


@dataclass
class NoteSpec:
    id: int
    text: str
    pos: tuple[int, int]
    size: tuple[int, int] = (420, 260)


def _links(nodes: list[NodeSpec], mappings: Mapping[str, type]) -> list[list]:
    """[link_id, from_node, from_slot, to_node, to_slot, type] for every connection."""
    out, link_id = [], 0
    for node in nodes:
        specs = [s for s in input_specs(mappings[node.class_type]) if s.name in node.links]
        for slot, spec in enumerate(specs):
            src, src_slot = node.links[spec.name]
            src_type = return_types(mappings[next(n.class_type for n in nodes if n.id == src)])[src_slot]
            link_id += 1
            out.append([link_id, src, src_slot, node.id, slot, src_type])
    return out


TITLE_H = 30  # LiteGraph draws the title bar above ``pos``
GAP = 30
#: The space a column leaves to the next one; a column beside which a rerouted link runs up or down leaves
#: ``ROUTE_GAP``: the frontend draws a link as a spline whose control points stand a quarter of its length out
#: sideways, so a link running 700 px down bows about 50 px to each side (``host/reroutes.py``).
COLUMN_GAP, ROUTE_GAP = 40, 120


#: A widget row's width in the frontend's widget font (LiteGraph, 12 px): about this many pixels per character of
#: its label and value, plus the arrows and padding. Checked against screenshots of frontend 1.49: below this a
#: label is cut to "t…" (Wan's "text_encoder_1" beside umt5_xxl_fp8_e4m3fn_scaled.safetensors at 340 px).
WIDGET_CHAR_PX, WIDGET_PAD_PX, MAX_NODE_W = 7.5, 70, 640


def _fitted_size(node: NodeSpec, cls: type) -> tuple[int, int]:
    """At least the height LiteGraph needs for the node's slots and widgets (frontends 1.27-1.49:
    ~22 px per slot row, up to ~28 px per widget), so the stored size never cuts widgets off; and at least the
    width that shows every widget's label beside its value (long file names), up to ``MAX_NODE_W``."""
    specs = input_specs(cls)
    # Advanced inputs are drawn only with the node's advanced toggle on: one row for the toggle instead.
    shown = [s for s in specs if s.is_widget and s.name not in node.links and not s.options.get("advanced")]
    widgets = sum(1 + s.control_slots for s in shown) + (len(shown) < sum(
        1 for s in specs if s.is_widget and s.name not in node.links))
    slot_rows = max(len(node.links), len(return_types(cls)))
    rows = [len(s.name) + len(str(node.widgets.get(s.name, s.options.get("default", ""))))
            for s in specs if s.is_widget and s.name not in node.links and not s.options.get("multiline")]
    wide = math.ceil(WIDGET_PAD_PX + WIDGET_CHAR_PX * max(rows, default=0))
    return max(node.size[0], 320, min(wide, MAX_NODE_W)), max(node.size[1], 22 * slot_rows + 28 * widgets + 16)


def _reflow_columns(nodes: list[NodeSpec], boxes: dict[int, list]) -> None:
    """Nodes stand in columns (the same ``pos`` x); a column widened by ``_fitted_size`` pushes the columns to its
    right along, so keeping the gap between them (nothing overlaps sideways). The gaps a rerouted link runs
    through (right of its source's column, left of its target's) are ``ROUTE_GAP`` wide."""
    columns = sorted({n.pos[0] for n in nodes})
    by_id = {n.id: n for n in nodes}
    routed = {by_id[n.links[name][0]].pos[0] for n in nodes for name in n.rerouted}
    routed |= {max(c for c in columns if c < n.pos[0]) for n in nodes if n.rerouted and n.pos[0] > columns[0]}
    x, shift = {}, 0
    for i, col in enumerate(columns):
        x[col] = col + shift
        if i + 1 < len(columns):
            right = max(x[col] + boxes[n.id][2] for n in nodes if n.pos[0] == col)
            shift = max(shift, right + (ROUTE_GAP if col in routed else COLUMN_GAP) - columns[i + 1])
    for n in nodes:
        boxes[n.id][0] = x[n.pos[0]]


def _layout(boxes: list[list]) -> None:
    """Push boxes ([x, y, w, h], body coordinates) down until none overlaps an earlier one
    (title bars included): nodes are stacked in their columns, notes go below what they would hide."""
    placed: list[list] = []
    for b in boxes:
        while True:
            hit = [p for p in placed if b[0] < p[0] + p[2] and p[0] < b[0] + b[2]
                   and b[1] - TITLE_H < p[1] + p[3] + GAP and p[1] - TITLE_H < b[1] + b[3] + GAP]
            if not hit:
                break
            b[1] = max(p[1] + p[3] for p in hit) + TITLE_H + GAP
        placed.append(b)


def to_ui(nodes: list[NodeSpec], notes: list[NoteSpec], mappings: Mapping[str, type],
          display: Mapping[str, str]) -> dict:
    links = _links(nodes, mappings)
    boxes = {n.id: [n.pos[0], n.pos[1], *_fitted_size(n, mappings[n.class_type])] for n in nodes}
    _reflow_columns(nodes, boxes)
    boxes.update({n.id: [n.pos[0], n.pos[1], *n.size] for n in notes})
    _layout([boxes[i] for i in sorted(boxes, key=lambda i: (boxes[i][1], boxes[i][0]))])
    routes = _reroute(nodes, notes, mappings, boxes, links)
    ui_nodes = []
    for order, node in enumerate(nodes):
        cls = mappings[node.class_type]
        specs = input_specs(cls)
        inputs = [{"name": s.name, "type": s.type, "link": next(l[0] for l in links if l[3] == node.id and l[4] == i)}
                  for i, s in enumerate(x for x in specs if x.name in node.links)]
        outputs = [{"name": name, "type": t, "links": [l[0] for l in links if l[1] == node.id and l[2] == slot],
                    "slot_index": slot}
                   for slot, (t, name) in enumerate(zip(return_types(cls), getattr(cls, "RETURN_NAMES", return_types(cls))))]
        values = []
        for s in specs:
            if s.name in node.links or not s.is_widget:
                continue
            values.append(node.widgets.get(s.name, s.options.get("default")))
            # the "control after generate" widget(s) ComfyUI adds after seeds
            values += ["fixed", ""][: s.control_slots]
        ui_nodes.append({
            "id": node.id, "type": node.class_type, "pos": boxes[node.id][:2], "size": boxes[node.id][2:], "flags": {},
            "order": order, "mode": 0, "inputs": inputs, "outputs": outputs, "title": node.title,
            # The frontend's convention: the class name (used for %Node.widget% lookups).
            "properties": {"Node name for S&R": node.class_type, **({"models": node.models} if node.models else {})},
            "widgets_values": values,
        })
    for note in notes:
        ui_nodes.append({
            "id": note.id, "type": "Note", "pos": boxes[note.id][:2], "size": boxes[note.id][2:], "flags": {},
            "order": len(ui_nodes), "mode": 0, "inputs": [], "outputs": [], "properties": {},
            "widgets_values": [note.text], "color": "#432", "bgcolor": "#653",
        })
    for rid, box, link_in, link_out, link_type in routes:
        # What the frontend saves for its classic Reroute (a RerouteNode, e.g. ComfyUI's hidream_e1_1 template).
        ui_nodes.append({
            "id": rid, "type": REROUTE_TYPE, "pos": box[:2], "size": box[2:], "flags": {}, "order": len(ui_nodes),
            "mode": 0, "inputs": [{"name": "", "type": "*", "link": link_in}],
            "outputs": [{"name": "", "type": link_type, "links": [link_out], "slot_index": 0}],
            "properties": {"showOutputText": False, "horizontal": False},
        })
    return {
        "last_node_id": max(n["id"] for n in ui_nodes), "last_link_id": len(links), "nodes": ui_nodes,
        "links": links, "groups": [], "config": {}, "extra": {"ds": {"scale": 1.0, "offset": [0, 0]}}, "version": 0.4,
    }


def _reroute(nodes: list[NodeSpec], notes: list[NoteSpec], mappings: Mapping[str, type], boxes: dict[int, list],
             links: list[list]) -> list[tuple[int, list, int, int, str]]:
    """Draw each ``NodeSpec.rerouted`` input's link through two Reroute nodes (``host/reroutes.py``): the link
    into the input now comes from the second reroute (keeping its id), and new links join the source to the
    first reroute and the first to the second. Returns ``(id, box, input link, output link, type)`` per reroute."""
    requests, held = [], []
    for node in nodes:
        cls = mappings[node.class_type]
        linked = [s.name for s in input_specs(cls) if s.name in node.links]
        sockets = [s.name for s in input_specs(cls) if not s.is_widget]
        for name in sorted(node.rerouted, key=linked.index):
            link = next(l for l in links if l[3] == node.id and l[4] == linked.index(name))
            requests.append(reroutes.Request(link[1], link[2], node.id, sockets.index(name),
                                             link[1] // CHAIN_IDS, node.id // CHAIN_IDS))
            held.append(link)
    if not requests:
        return []
    frames = {i: [b[0], b[1] - TITLE_H, b[2], b[3] + TITLE_H] for i, b in boxes.items()}
    chain = {n.id: n.id // CHAIN_IDS for n in nodes}
    first = (max(boxes) // CHAIN_IDS + 1) * CHAIN_IDS + 1  # after every chain's block of ids
    out = []
    for link, route in zip(held, reroutes.plan(requests, boxes, frames, chain, first, GAP, ROUTE_GAP)):
        (r1, box1), (r2, box2) = route
        a, b = len(links) + 1, len(links) + 2
        links += [[a, link[1], link[2], r1, 0, link[5]], [b, r1, 0, r2, 0, link[5]]]
        link[1], link[2] = r2, 0
        out += [(r1, box1, a, b, link[5]), (r2, box2, b, link[0], link[5])]
    return out


def to_api(nodes: list[NodeSpec], mappings: Mapping[str, type]) -> dict:
    graph = {}
    for node in nodes:
        inputs: dict[str, Any] = {}
        for s in input_specs(mappings[node.class_type]):
            if s.name in node.links:
                src, slot = node.links[s.name]
                inputs[s.name] = [str(src), slot]
            elif s.is_widget:
                inputs[s.name] = node.widgets.get(s.name, s.options.get("default"))
        graph[str(node.id)] = {"class_type": node.class_type, "inputs": inputs, "_meta": {"title": node.title}}
    return graph


def render_thumbnail(name: str, ui: dict, path: Path) -> None:
    """The template browser's picture of a template: its title, description and graph (``host/template_cards.py``)."""
    from .template_cards import card_for, render_card
    from .template_needs import cached_needs

    t, family, kind_note = card_source(name)
    render_card(card_for(t, family, cached_needs(t), name=name, kind_note=kind_note), ui, path)


def card_source(name: str):
    """(the training template, its family, what the named template adds to it) of a shipped template: what its
    card in the template browser says (``host/template_cards.py``)."""
    try_t = TRY_TEMPLATES.get(name)
    t = SHIPPED[try_t.base if try_t else name]
    family = next(f for f in families().values() if any(x.name == t.name for x in family_templates(f)))
    return t, family, "sampled by ComfyUI in the same graph" if try_t else ""


# --- the shipped graphs ------------------------------------------------------------


def _train_graph(load: dict, cache: dict, offload: dict, train: dict, save: dict) -> list[NodeSpec]:
    """The training graph every shipped workflow uses, with its widget values: the five main nodes, and Training
    Options and Preview Options (ids 8 and 9) plugged into Train LoRA, so a user sees where those settings are."""
    from ..nodes.training_options import OPTION_NODES, defaults

    nodes = [
        NodeSpec(1, "LowVRAMLoadQuantizedSlab", "Load Quantized Slab", (40, 80), load, size=(320, 130)),
        NodeSpec(2, "LowVRAMCacheTextEmbeds", "Cache Text Embeds", (400, 80),
                 {"trigger_word": "ohwx", "default_caption": "", "repeats": 1, "flip": False,
                  "max_sequence_length": 0, **cache}, {"model": (1, 0)}, size=(340, 330)),
        NodeSpec(3, "LowVRAMOffloadConfig", "Offload Config", (40, 260), _offload_widgets(offload),
                 size=(320, 150)),
        NodeSpec(4, "LowVRAMTrainLoRA", "Train LoRA (LowVRAM)", (780, 80), {"batch_size": 1, **train},
                 {"model": (1, 0), "dataset": (2, 0), "offload": (3, 0)}, size=(330, 300)),
        NodeSpec(5, "LowVRAMSaveLoRA", "Save LoRA (LowVRAM)", (1150, 80), {"format": "comfyui", "dtype": "bf16", **save},
                 {"lora": (4, 0)}, size=(320, 150)),
    ]
    # A family's template names every training setting as Train LoRA's (engine/families/*/templates.py): the ones
    # that moved to an options node go there: below Cache Text Embeds (laid out further down if it is taller), so
    # their links run forward into Train LoRA and keep the channel left of its column free for rerouted links.
    y = 460
    for node_id, (socket, cls) in enumerate(OPTION_NODES.items(), 8):
        names = defaults(cls)
        values = {k: nodes[3].widgets.pop(k) for k in list(nodes[3].widgets) if k in names}
        nodes.append(NodeSpec(node_id, cls.__name__, cls.GET_SCHEMA().display_name, (400, y), values, size=(340, 60)))
        nodes[3].links[socket] = (node_id, 0)
        y += 260
    return nodes


def _offload_widgets(offload: dict) -> dict:
    """Offload Config's widgets of a family's template. The shipped graphs carry no Offload Tuning node: every
    template leaves the planner's choices at Offload Tuning's defaults, and a setting of it here would be lost."""
    from ..nodes.offload_tuning import LowVRAMOffloadTuning, defaults

    tuned = sorted(set(offload) & set(defaults(LowVRAMOffloadTuning)))
    if tuned:
        raise ValueError(f"a template's offload sets {', '.join(tuned)}, which Offload Tuning holds; the shipped "
                         f"graphs plug no Offload Tuning node: set only mode, compile, vram_budget_gb and "
                         f"ram_budget_gb there (or add the node to host/templates.py _train_graph)")
    return dict(offload)


#: A further chain's node ids: the first chain's plus 10 per chain (the first uses 1-9); its rows this far below.
CHAIN_IDS, CHAIN_DY = 10, 1400


def _graph(t: TrainingTemplate) -> tuple[list[NodeSpec], list[NoteSpec]]:
    """A family's template as nodes: the training graph, plus Dual-GPU Split when it has one, plus each further
    chain (``TrainingTemplate.chains``) below, its values over the template's."""
    nodes = _labelled(_train_graph(t.load, t.cache, t.offload, t.train, t.save), t.label)
    if t.split is not None:
        next(n for n in nodes if n.class_type == "LowVRAMTrainLoRA").links["split"] = (7, 0)
        nodes.append(NodeSpec(7, "LowVRAMDualGPUSplit", "Dual-GPU Split", (400, 440), dict(t.split), size=(340, 170)))
    for k, chain in enumerate(t.chains, 1):
        unknown = set(chain) - {"load", "cache", "offload", "train", "save", "label"}
        if unknown:
            raise ValueError(f"template {t.name!r}: chain {k} has sections {sorted(unknown)}; a chain updates load, "
                             f"cache, offload, train or save (and may have a label)")
        parts = [{**getattr(t, s), **chain.get(s, {})} for s in ("load", "cache", "offload", "train", "save")]
        for node in _labelled(_train_graph(*parts), chain.get("label", "")):
            node.id += k * CHAIN_IDS
            node.pos = (node.pos[0], node.pos[1] + k * CHAIN_DY)
            node.links = {name: (src + k * CHAIN_IDS, slot) for name, (src, slot) in node.links.items()}
            nodes.append(node)
    for chain, name, source in t.chain_links:
        if not (0 <= chain <= len(t.chains) and 0 <= source <= len(t.chains)) or chain == source:
            raise ValueError(f"template {t.name!r}: chain link {(chain, name, source)} must join two different "
                             f"chains of 0..{len(t.chains)}")
        train = next(n for n in nodes if n.id == 4 + chain * CHAIN_IDS)
        train.links[name] = (1 + source * CHAIN_IDS, 0)
        train.rerouted.add(name)  # drawn around the nodes between the chains, not behind them
    _attach_models(t, nodes)
    from .template_needs import cached_needs, needs  # the planner's VRAM and RAM figures (imports torch)

    figures = cached_needs(t) if SHIPPED.get(t.name) is t else needs(t)
    return nodes, [NoteSpec(6, f"{t.note}\n\n{figures.text()}", t.note_pos)]


def _labelled(nodes: list[NodeSpec], label: str) -> list[NodeSpec]:
    """The chain's label at the end of its nodes' titles (which expert a chain trains)."""
    for node in nodes:
        node.title += f" · {label}" if label else ""
    return nodes


def _attach_models(t: TrainingTemplate, nodes: list[NodeSpec]) -> None:
    """``properties.models`` for each node whose file widgets name a file with a download URL. A URL for a
    file no widget names is an error: it would never be offered, and it means the data went stale."""
    used = set()
    for node in nodes:
        for widget, folder in MODEL_FOLDERS.items():
            name = node.widgets.get(widget)
            if name in t.downloads:
                node.models.append({"name": name, "url": t.downloads[name],
                                    "directory": t.download_folders.get(name, folder)})
                used.add(name)
    unused = sorted(set(t.downloads) - used)
    if unused:
        raise ValueError(f"template {t.name!r}: downloads names {unused}, which no file widget of the template "
                         f"holds; remove them or fix the file names in its load/cache values")


# --- train, then try: ComfyUI's own sampling on the trained LoRA ----------------------------------------------


@dataclass(frozen=True)
class TryTemplate:
    """A shipped training template (``base``) plus ComfyUI's own nodes sampling with its LoRA in the same graph:
    Load Diffusion Model (the base's checkpoint) -> Load LoRA Model (Train LoRA's ``lora_model``) -> KSampler
    (Sample Prompt Conditioning's ``prompt``; ConditioningZeroOut as the negative) -> VAE Decode (``vae``) ->
    Preview Image. For ComfyUI only: ``lowvram-lora run`` has no KSampler."""

    name: str
    base: str
    vae: str
    note: str
    prompt: int = 1
    sampler: dict = field(default_factory=dict)  # KSampler's widgets
    size: tuple[int, int] = (128, 128)


TRY_TEMPLATES = {t.name: t for t in [
    TryTemplate(
        name="demo_train_and_try", base="demo_tiny_lora", vae="flux1-tiny-taesd.safetensors", prompt=1,
        sampler={"seed": 0, "steps": 8, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0},
        note=(
            "Demo, train and try in one graph: the demo's LoRA (the nodes on the left, as in demo_tiny_lora) goes "
            "from Train LoRA's lora_model output into ComfyUI's own Load LoRA Model, on the same tiny model loaded "
            "by ComfyUI's Load Diffusion Model; KSampler draws 'a red circle on a ohwx background' (Sample Prompt "
            "Conditioning: line 1 of Cache Text Embeds' sample_prompts, no text encoder loaded again) and Preview Image shows it. "
            "Set strength_model to 0 to see the base model.\n\n"
            "Prepare the files once with:\n  lowvram-lora demo --prepare-only --dir <ComfyUI root>\n"
            "(it also writes models/vae/flux1-tiny-taesd.safetensors: the demo VAE in a form ComfyUI loads; its "
            "previews are drawn in 8x8-pixel cells). Then press Run."),
    ),
]}

#: Where ComfyUI's nodes of a try graph stand: right of the training graph's Save LoRA, one row.
TRY_X, TRY_Y = 1510, 80


def _try_graph(t: TryTemplate) -> tuple[list[NodeSpec], list[NoteSpec]]:
    base = SHIPPED[t.base]
    nodes, _ = _graph(base)
    next(n for n in nodes if n.class_type == "LowVRAMSaveLoRA").widgets["filename_prefix"] = f"loras/{t.name}"
    x, y = TRY_X, TRY_Y
    nodes += [
        NodeSpec(21, "UNETLoader", "Load Diffusion Model", (x, y), {"unet_name": base.load["checkpoint"],
                                                                      "weight_dtype": "default"}, size=(320, 110)),
        NodeSpec(22, "LoraModelLoader", "Load LoRA Model", (x, y + 170), {"strength_model": 1.0, "bypass": False},
                 {"model": (21, 0), "lora": (4, 3)}, size=(320, 130)),
        NodeSpec(23, "LowVRAMSamplePromptConditioning", "Sample Prompt Conditioning", (x, y + 360),
                 {"prompt": t.prompt}, {"dataset": (2, 0)}, size=(320, 100)),
        NodeSpec(24, "ConditioningZeroOut", "ConditioningZeroOut", (x, y + 520), {}, {"conditioning": (23, 0)},
                 size=(320, 60)),
        NodeSpec(25, "EmptyLatentImage", "Empty Latent Image", (x, y + 640),
                 {"width": t.size[0], "height": t.size[1], "batch_size": 1}, size=(320, 130)),
        NodeSpec(26, "KSampler", "KSampler", (x + 380, y), dict(t.sampler),
                 {"model": (22, 0), "positive": (23, 0), "negative": (24, 0), "latent_image": (25, 0)},
                 size=(320, 270)),
        NodeSpec(27, "VAELoader", "Load VAE", (x + 380, y + 330), {"vae_name": t.vae}, size=(320, 60)),
        NodeSpec(28, "VAEDecode", "VAE Decode", (x + 380, y + 450), {}, {"samples": (26, 0), "vae": (27, 0)},
                 size=(320, 50)),
        NodeSpec(29, "PreviewImage", "Preview Image", (x + 760, y), {}, {"images": (28, 0)}, size=(300, 320)),
    ]
    return nodes, [NoteSpec(6, t.note, base.note_pos, size=(460, 300))]


def build_try(name: str) -> tuple[dict, dict]:
    """A train-and-try template in both formats (ComfyUI's nodes declared by ``host/comfy_nodes.py``)."""
    from ..nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
    from .comfy_nodes import COMFY_NODES

    mappings = {**NODE_CLASS_MAPPINGS, **COMFY_NODES}
    display = {**NODE_DISPLAY_NAME_MAPPINGS, **{k: c.DISPLAY_NAME for k, c in COMFY_NODES.items()}}
    nodes, notes = _try_graph(TRY_TEMPLATES[name])
    return to_ui(nodes, notes, mappings, display), to_api(nodes, mappings)


def shipped() -> dict[str, TrainingTemplate]:
    """Every family's templates (``engine/families/<id>/templates.py``), by name."""
    out: dict[str, TrainingTemplate] = {}
    for family in families().values():
        for t in family_templates(family):
            if t.name in out:
                raise ValueError(f"two families ship a template named {t.name!r}")
            out[t.name] = t
    return dict(sorted(out.items()))


SHIPPED = shipped()


def build(name: str, mappings: Mapping[str, type], display: Mapping[str, str]) -> tuple[dict, dict]:
    nodes, notes = _graph(SHIPPED[name])
    return to_ui(nodes, notes, mappings, display), to_api(nodes, mappings)


def write_all(folder: Path = WORKFLOWS_DIR) -> list[Path]:
    from ..nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

    written = []
    (folder / "api").mkdir(parents=True, exist_ok=True)
    for name in SHIPPED:
        ui, api = build(name, NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS)
        (folder / f"{name}.json").write_text(json.dumps(ui, indent=2) + "\n")
        (folder / "api" / f"{name}.json").write_text(json.dumps(api, indent=2) + "\n")
        render_thumbnail(name, ui, folder / f"{name}.jpg")
        written += [folder / f"{name}.json", folder / "api" / f"{name}.json", folder / f"{name}.jpg"]
    for name in TRY_TEMPLATES:
        ui, api = build_try(name)
        (folder / f"{name}.json").write_text(json.dumps(ui, indent=2) + "\n")
        (folder / "api" / f"{name}.json").write_text(json.dumps(api, indent=2) + "\n")
        render_thumbnail(name, ui, folder / f"{name}.jpg")
        written += [folder / f"{name}.json", folder / "api" / f"{name}.json", folder / f"{name}.jpg"]
    return written


if __name__ == "__main__":
    import sys

    if "--needs" in sys.argv[1:]:  # the README's table "What each template needs"
        from .template_needs import cached_needs, markdown

        print(markdown([cached_needs(t) for t in SHIPPED.values()]))
    else:
        for p in write_all():
            print(p)
