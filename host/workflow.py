"""Read ComfyUI workflow JSON and turn it into a validated graph we can execute.

ComfyUI saves workflows in two shapes:

- **UI format** (what the editor saves and what ``example_workflows/*.json`` ship as):
  ``{"nodes": [...], "links": [...], "version": 0.4, ...}``. Widget values sit in
  each node's ``widgets_values`` list by position, so they only make sense next to
  the node classes' ``INPUT_TYPES``.
- **API format** (what the editor's "Export (API)" writes and what ``/prompt``
  takes): ``{"5": {"class_type": ..., "inputs": {name: value | [src_id, slot]}}}``.

The headless runner has no ComfyUI frontend to do the UI → API conversion, so this
module does it, following the frontend's own rules (``graphToPrompt``): notes and
muted nodes are dropped, reroutes are followed through, bypassed nodes pass their
matching-type input through, a ``PrimitiveNode``'s value becomes a literal, and
the extra "control after generate" widget values are consumed and ignored.

Everything a user can get wrong in a hand-edited file is reported as a
:class:`WorkflowError` naming the node, its title and the input, with a fix,
because the headless runner prints these messages instead of a traceback.
"""

from __future__ import annotations

import inspect
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

#: Input types the frontend draws as widgets (everything else is a link socket).
WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"})
#: Values of the frontend's "control after generate" combo.
CONTROL_MODES = frozenset({"fixed", "increment", "decrement", "randomize", "increment-wrap"})
#: INT inputs that get a control widget unless their options say otherwise.
SEED_NAMES = frozenset({"seed", "noise_seed"})
#: UI-only node types that never reach the backend.
NOTE_TYPES = frozenset({"Note", "MarkdownNote"})
REROUTE_TYPE = "Reroute"
PRIMITIVE_TYPE = "PrimitiveNode"
#: LiteGraph node modes (``node.mode``): 2 = never (muted), 4 = bypass.
MODE_MUTED = 2
MODE_BYPASS = 4


class WorkflowError(Exception):
    """A workflow file that cannot be run as written; the message says how to fix it.

    ``node_id`` and ``input_name`` are kept as attributes (``None`` when not about
    one node or input) so callers such as a future ``serve`` can point at them.
    """

    def __init__(self, message: str, *, node_id: str | None = None, input_name: str | None = None):
        super().__init__(message)
        self.node_id = node_id
        self.input_name = input_name
        #: True when a combo value (a model file or folder) is not among the choices found on disk.
        self.missing_choice = False


# --------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class InputSpec:
    """One declared input of a node class, in ``INPUT_TYPES`` order."""

    name: str
    type: str  # "INT", "LOWVRAM_MODEL", "COMBO" (for list options), ...
    options: Mapping[str, Any]
    required: bool
    choices: tuple | None = None  # combo options

    @property
    def is_widget(self) -> bool:
        """True when the frontend draws a widget (and stores a ``widgets_values`` slot)."""
        return self.type in WIDGET_TYPES and not self.options.get("forceInput", False)

    @property
    def control_slots(self) -> int:
        """How many extra ``widgets_values`` slots the frontend stores after this widget.

        Mirrors ``useIntWidget``/``useFloatWidget``/``useComboWidget``: INT named
        seed/noise_seed gets a control combo unless ``control_after_generate`` is set
        to a false value; other INT/FLOAT/COMBO only when it is truthy; a combo's
        control is followed by a ``control_filter_list`` string.
        """
        if not self.is_widget:
            return 0
        flag = self.options.get("control_after_generate")
        if self.type == "INT" and flag is None:
            flag = self.name in SEED_NAMES
        if not flag or self.type not in ("INT", "FLOAT", "COMBO"):
            return 0
        return 2 if self.type == "COMBO" else 1

    @property
    def display_type(self) -> str:
        """The type as a user reads it in messages (combos list their options)."""
        if self.choices is not None:
            return "one of " + ", ".join(json.dumps(c) for c in self.choices)
        return self.type


def _parse_spec(name: str, raw: Any, required: bool) -> InputSpec:
    """Read one ``INPUT_TYPES`` entry: ``("INT", {...})``, ``(["a", "b"],)``, ``("COMBO", {"options": [...]})``."""
    if isinstance(raw, str):
        raw = (raw,)
    kind = raw[0] if raw else "*"
    options = dict(raw[1]) if len(raw) > 1 and isinstance(raw[1], Mapping) else {}
    if isinstance(kind, (list, tuple)):
        return InputSpec(name, "COMBO", options, required, tuple(kind))
    if kind == "COMBO":
        return InputSpec(name, "COMBO", options, required, tuple(options.get("options", ())))
    return InputSpec(name, str(kind), options, required)


def input_specs(cls: type) -> list[InputSpec]:
    """Declared required then optional inputs of a node class, in declaration order.

    Order matters: it is the order of the UI format's ``widgets_values``.
    """
    declared = cls.INPUT_TYPES()
    specs = []
    for section, required in (("required", True), ("optional", False)):
        for name, raw in (declared.get(section) or {}).items():
            specs.append(_parse_spec(name, raw, required))
    return specs


def moved_input_specs(cls: type) -> list[InputSpec]:
    """Widgets that moved from a pack node to an options node it takes, still accepted by name (a workflow saved
    before the move; ``Node.moved_inputs``), as optional widget specs: their values are checked as the options
    node checks them. None for other nodes."""
    from ..nodes.schema import Node

    if not (isinstance(cls, type) and issubclass(cls, Node)):
        return []
    return [_parse_spec(name, (i.io_type, i.as_dict()), False) for name, i in cls.moved_inputs().items()]


def hidden_inputs(cls: type) -> dict[str, str]:
    """The ``hidden`` section (name -> ``"UNIQUE_ID"``, ``"PROMPT"``, ...), which ComfyUI fills itself."""
    hidden = cls.INPUT_TYPES().get("hidden") or {}
    return {name: (raw[0] if isinstance(raw, (list, tuple)) else raw) for name, raw in hidden.items()}


def return_types(cls: type) -> tuple:
    """The class's ``RETURN_TYPES`` as a tuple (empty for pure output nodes)."""
    return tuple(getattr(cls, "RETURN_TYPES", ()) or ())


def is_link(value: Any) -> bool:
    """API-format link: ``[source_node_id, output_index]`` (ComfyUI's own test)."""
    return (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and isinstance(value[0], (str, int))
        and not isinstance(value[0], bool)
        and isinstance(value[1], int)
        and not isinstance(value[1], bool)
    )


def types_compatible(output_type: Any, input_type: str) -> bool:
    """Whether a link from ``output_type`` may feed ``input_type``.

    ``*`` matches anything; comma-separated unions match when they share a member
    (ComfyUI's rule); an output that is a list of options feeds a combo.
    """
    if isinstance(output_type, (list, tuple)):
        output_type = "COMBO"
    output_type = str(output_type)
    if output_type == "*" or input_type == "*":
        return True
    return bool(set(output_type.split(",")) & set(input_type.split(",")))


def node_sort_key(node_id: str) -> tuple:
    """Sort node ids numerically where they are numbers, so messages and order are stable."""
    return (0, int(node_id), "") if node_id.isdigit() else (1, 0, node_id)


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class _Where:
    """Which node a message is about: id, title and class, as users see them."""

    node_id: str
    title: str | None
    class_type: str

    def describe(self, input_name: str | None = None) -> str:
        title = f' "{self.title}"' if self.title and self.title != self.class_type else ""
        text = f"node {self.node_id}{title} ({self.class_type})"
        return f'{text}, input "{input_name}"' if input_name else text

    def error(self, input_name: str | None, problem: str, fix: str) -> WorkflowError:
        return WorkflowError(
            f"{self.describe(input_name)}: {problem}. Fix: {fix}",
            node_id=self.node_id,
            input_name=input_name,
        )


def _title_of(node: Mapping[str, Any]) -> str | None:
    meta = node.get("_meta")
    return meta.get("title") if isinstance(meta, Mapping) else None


def _where(node_id: str, node: Mapping[str, Any]) -> _Where:
    return _Where(node_id, _title_of(node), str(node.get("class_type", "?")))


def _registered(node_class_mappings: Mapping[str, type]) -> str:
    names = sorted(node_class_mappings)
    return ", ".join(names) if names else "(none registered)"


def _node_class(where: _Where, node_class_mappings: Mapping[str, type]) -> type:
    """The class for ``where.class_type`` or an error listing the registered ones."""
    cls = node_class_mappings.get(where.class_type)
    if cls is None:
        raise where.error(
            None,
            f'unknown node type "{where.class_type}"',
            "this runner only knows the node types "
            f"{_registered(node_class_mappings)}; replace or remove the node",
        )
    return cls


# --------------------------------------------------------------------------- loading


def detect_format(workflow: Any) -> str:
    """``"ui"`` or ``"api"``; raises WorkflowError for anything else."""
    if isinstance(workflow, Mapping) and isinstance(workflow.get("nodes"), list) and isinstance(
        workflow.get("links"), list
    ):
        return "ui"
    if isinstance(workflow, Mapping) and workflow and all(
        isinstance(node, Mapping) and "class_type" in node for node in workflow.values()
    ):
        return "api"
    raise WorkflowError(
        "this JSON is neither a ComfyUI UI-format workflow (with \"nodes\" and \"links\") nor an "
        "API-format prompt ({id: {\"class_type\", \"inputs\"}}). Fix: save it from ComfyUI with "
        "Workflow > Save, or Export (API)"
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) or (
        isinstance(value, str) and value.strip().lstrip("-").isdigit())


def _shape_error(problem: str) -> WorkflowError:
    return WorkflowError(f"the workflow JSON is malformed: {problem}. Fix: re-save it from ComfyUI "
                         f"(Workflow > Save, or Export (API)) or correct that entry by hand")


def check_shape(workflow: Any) -> None:
    """Check the JSON's structure before anything reads it, so a hand-edited or truncated file
    gets a message naming the bad entry instead of a KeyError/TypeError traceback."""
    if detect_format(workflow) == "api":
        for node_id, node in workflow.items():
            if not isinstance(node.get("class_type"), str):
                raise _shape_error(f'node {node_id}: "class_type" must be a string')
            if not isinstance(node.get("inputs", {}), Mapping):
                raise _shape_error(f'node {node_id}: "inputs" must be an object {{"name": value}}, '
                                   f'not {type(node.get("inputs")).__name__}')
            for name, value in node.get("inputs", {}).items():
                if isinstance(value, list) and len(value) == 2 and isinstance(value[0], (str, int)) \
                        and not isinstance(value[0], bool) and not _is_int(value[1]):
                    raise _shape_error(f'node {node_id}, input "{name}": a link [node_id, output_index] '
                                       f"needs a whole number as output index, got {json.dumps(value[1])}")
        return
    ids = set()
    for i, node in enumerate(workflow["nodes"]):
        if not isinstance(node, Mapping):
            raise _shape_error(f'"nodes"[{i}] is not an object')
        if not _is_int(node.get("id")) and not isinstance(node.get("id"), str):
            raise _shape_error(f'"nodes"[{i}] (type {node.get("type")!r}) has no "id"')
        if str(node["id"]) in ids:
            raise _shape_error(f'two nodes have the id {node["id"]}')
        ids.add(str(node["id"]))
        if not isinstance(node.get("type"), str):
            raise _shape_error(f'node {node["id"]} has no "type" string')
        for key, kinds in (("inputs", list), ("outputs", list), ("widgets_values", (list, Mapping))):
            if node.get(key) is not None and not isinstance(node[key], kinds):
                raise _shape_error(f'node {node["id"]}: "{key}" has the wrong type ({type(node[key]).__name__})')
        for entry in node.get("inputs") or []:
            if not isinstance(entry, Mapping) or (entry.get("link") is not None and not _is_int(entry["link"])):
                raise _shape_error(f'node {node["id"]}: input entry {json.dumps(entry)[:80]} is not '
                                   f'{{"name": ..., "link": number or null}}')
    for i, link in enumerate(workflow["links"]):
        if link is None:
            continue
        if isinstance(link, Mapping):
            fields = [link.get(k) for k in ("id", "origin_id", "origin_slot", "target_id", "target_slot")]
        elif isinstance(link, list) and len(link) >= 5:
            fields = link[:5]
        else:
            raise _shape_error(f'"links"[{i}] must be [id, origin_id, origin_slot, target_id, target_slot, type] '
                               f"or an object, got {json.dumps(link)[:80]}")
        bad = [f for j, f in enumerate(fields) if not (_is_int(f) or j in (1, 3) and isinstance(f, str) and f)]
        if bad:
            raise _shape_error(f'"links"[{i}] = {json.dumps(link)[:80]}: {json.dumps(bad[0])} is not a number')


def load_workflow(path: str | Path) -> dict:
    """Read a workflow file and check it is UI or API format (see :func:`detect_format`)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise WorkflowError(f"cannot read workflow {path}: {exc.strerror or exc}. Fix: check the path") from exc
    try:
        workflow = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WorkflowError(
            f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}). "
            "Fix: re-save the workflow from ComfyUI"
        ) from exc
    check_shape(workflow)
    return workflow


# --------------------------------------------------------------------------- UI -> API


@dataclass(frozen=True)
class _Link:
    id: int
    origin_id: str
    origin_slot: int
    target_id: str
    target_slot: int
    type: Any


def _parse_link(raw: Any) -> _Link:
    """A link as an array (version 0.4) or an object (version 1 schema)."""
    if isinstance(raw, Mapping):
        return _Link(
            int(raw["id"]), str(raw["origin_id"]), int(raw["origin_slot"]),
            str(raw["target_id"]), int(raw["target_slot"]), raw.get("type"),
        )
    link_id, origin, origin_slot, target, target_slot, link_type = list(raw) + [None] * (6 - len(raw))
    return _Link(int(link_id), str(origin), int(origin_slot), str(target), int(target_slot), link_type)


@dataclass(frozen=True)
class _Source:
    """Where an input's value comes from after reroutes/bypasses/primitives are resolved."""

    link: list | None = None  # [node_id, slot]
    value: Any = None
    has_value: bool = False
    dropped: str | None = None  # why the link was dropped (muted source, empty reroute, ...)


class _UiGraph:
    """The UI-format nodes and links, indexed for resolving a link to its real source."""

    def __init__(self, workflow: Mapping[str, Any]):
        self.nodes: dict[str, dict] = {str(n["id"]): n for n in workflow["nodes"]}
        self.links: dict[int, _Link] = {}
        for raw in workflow["links"]:
            if raw is not None:
                link = _parse_link(raw)
                self.links[link.id] = link
        subgraphs = (workflow.get("definitions") or {}).get("subgraphs") or []
        self.subgraph_ids = {str(s.get("id")) for s in subgraphs if isinstance(s, Mapping)}

    def link(self, link_id: int, where: _Where, input_name: str) -> _Link:
        link = self.links.get(int(link_id))
        if link is None:
            raise where.error(
                input_name,
                f"its link {link_id} is not in the workflow's \"links\" list",
                "reconnect the input in ComfyUI and save again",
            )
        if link.origin_id not in self.nodes:
            raise where.error(
                input_name,
                f"its link {link_id} comes from node {link.origin_id}, which is not in the workflow",
                "reconnect the input to an existing node",
            )
        return link

    def resolve(self, link_id: int, where: _Where, input_name: str) -> _Source:
        """Follow reroutes and bypassed nodes back to a real output, a primitive value, or nothing."""
        seen: set[int] = set()
        while True:
            if link_id in seen:
                raise where.error(input_name, "its link loops through reroutes/bypassed nodes", "reconnect it")
            seen.add(link_id)
            link = self.link(link_id, where, input_name)
            node = self.nodes[link.origin_id]
            step = self._step(node, link)
            if isinstance(step, _Source):
                return step
            link_id = step

    def _step(self, node: Mapping[str, Any], link: _Link) -> _Source | int:
        """One hop back: a final source, or the next link id to follow."""
        node_type, mode = node.get("type"), node.get("mode", 0)
        if node_type == REROUTE_TYPE:
            upstream = _first_input_link(node)
            return upstream if upstream is not None else _Source(dropped=f"reroute {node['id']} has no input")
        if node_type == PRIMITIVE_TYPE:
            return _primitive_source(node)
        if node_type in NOTE_TYPES:
            return _Source(dropped=f"node {node['id']} is a note")
        if mode == MODE_MUTED:
            return _Source(dropped=f"node {node['id']} is muted")
        if mode == MODE_BYPASS:
            upstream = _bypass_input_link(node, link)
            if upstream is None:
                return _Source(dropped=f"node {node['id']} is bypassed and has no connected input of that type")
            return upstream
        return _Source(link=[link.origin_id, link.origin_slot])


def _first_input_link(node: Mapping[str, Any]) -> int | None:
    for entry in node.get("inputs") or []:
        if entry.get("link") is not None:
            return int(entry["link"])
    return None


def _bypass_input_link(node: Mapping[str, Any], link: _Link) -> int | None:
    """The input a bypassed node passes through for output ``link.origin_slot``.

    As the frontend does: the input at the same index if its type matches the
    output's, else the first connected input of that type.
    """
    outputs = node.get("outputs") or []
    slot = link.origin_slot
    out_type = outputs[slot].get("type") if slot < len(outputs) else link.type
    inputs = node.get("inputs") or []
    candidates = ([inputs[slot]] if slot < len(inputs) else []) + list(inputs)
    for entry in candidates:
        if entry.get("link") is not None and entry.get("type") == out_type:
            return int(entry["link"])
    return None


def _primitive_source(node: Mapping[str, Any]) -> _Source:
    """A PrimitiveNode's first widget value is the literal fed to every input it is linked to."""
    values = node.get("widgets_values")
    if isinstance(values, list) and values:
        return _Source(value=values[0], has_value=True)
    if isinstance(values, Mapping) and "value" in values:
        return _Source(value=values["value"], has_value=True)
    return _Source(dropped=f"primitive node {node['id']} has no value")


def _consume_controls(spec: InputSpec, values: list, cursor: int, exact: bool | None) -> int:
    """Skip the control-after-generate slot(s) after ``spec``'s widget; return the new cursor.

    ``exact`` is True/False when the value count told us whether control slots are
    stored; ``None`` means guess from the values (newer frontends may not store them).
    Randomize/increment are ignored: the stored seed is used as is, so a headless
    run is reproducible.
    """
    slots = spec.control_slots
    if not slots or exact is False:
        return cursor
    if exact:
        return cursor + slots
    if cursor < len(values) and values[cursor] in CONTROL_MODES:
        cursor += 1
        if slots == 2 and cursor < len(values) and isinstance(values[cursor], str):
            cursor += 1
    return cursor


def _widget_values(node: Mapping[str, Any], specs: list[InputSpec], cls: type | None = None) -> dict[str, Any]:
    """Map a UI node's ``widgets_values`` (list or name -> value dict) onto widget inputs. A node class whose widgets
    changed declares the old order (``LEGACY_WIDGETS``, recognised by its ``is_legacy_layout``): a file saved then
    is read by those names, which may include inputs the node now takes from elsewhere (Train LoRA)."""
    raw = node.get("widgets_values")
    widgets = [s for s in specs if s.is_widget]
    from ..nodes.schema import Node

    pack_node = isinstance(cls, type) and issubclass(cls, Node)
    if pack_node and cls.LEGACY_WIDGETS and isinstance(raw, list) and cls.is_legacy_layout(raw):
        return dict(zip(cls.LEGACY_WIDGETS, raw))
    if isinstance(raw, Mapping):
        return {s.name: raw[s.name] for s in widgets if s.name in raw}
    values = list(raw or [])
    plain = len(widgets)
    full = plain + sum(s.control_slots for s in widgets)
    exact = True if len(values) == full else False if len(values) == plain else None
    out: dict[str, Any] = {}
    cursor = 0
    for spec in widgets:
        if cursor >= len(values):
            break
        out[spec.name] = values[cursor]
        cursor = _consume_controls(spec, values, cursor + 1, exact)
    return out


def _ui_inputs(
    ui: _UiGraph, node: Mapping[str, Any], specs: list[InputSpec], where: _Where, cls: type | None = None
) -> dict[str, Any]:
    """API ``inputs`` for one UI node: links (resolved) win over widget values."""
    widget_values = _widget_values(node, specs, cls)
    linked = {e.get("name"): e["link"] for e in node.get("inputs") or [] if e.get("link") is not None}
    inputs: dict[str, Any] = {}
    for spec in specs:
        if spec.name in linked:
            source = ui.resolve(linked[spec.name], where, spec.name)
            if source.link is not None:
                inputs[spec.name] = source.link
            elif source.has_value:
                inputs[spec.name] = source.value
            elif spec.required:
                raise where.error(
                    spec.name, f"its link was dropped because {source.dropped}",
                    "unmute/un-bypass the source node or connect the input to another node",
                )
        elif spec.name in widget_values:
            inputs[spec.name] = widget_values[spec.name]
        elif spec.is_widget and "default" in spec.options:
            inputs[spec.name] = spec.options["default"]  # a widget added after the file was saved
            print(f"note: {where.describe(spec.name)} has no saved value (the file predates it, or its "
                  f"widgets_values is short); using the default {json.dumps(spec.options['default'])}",
                  file=sys.stderr)
    # An old layout's values for inputs the node no longer declares: kept by name, for the node to read.
    declared = {s.name for s in specs}
    inputs |= {k: v for k, v in widget_values.items() if k not in declared}
    return inputs


def _ui_class(ui: _UiGraph, node: Mapping[str, Any], where: _Where, mappings: Mapping[str, type]) -> type:
    """The node's class, with a specific hint for subgraphs and group nodes (not supported)."""
    node_type = str(node.get("type"))
    if node_type in ui.subgraph_ids or node_type.startswith(("workflow>", "workflow/")):
        raise where.error(
            None, "subgraphs and group nodes are not supported by the headless runner",
            "in ComfyUI, unpack the subgraph / convert the group node back to nodes and save again",
        )
    return _node_class(where, mappings)


def _is_backend_node(node: Mapping[str, Any]) -> bool:
    """False for nodes the frontend never sends: notes, reroutes, primitives, muted, bypassed."""
    if node.get("type") in NOTE_TYPES or node.get("type") in (REROUTE_TYPE, PRIMITIVE_TYPE):
        return False
    return node.get("mode", 0) not in (MODE_MUTED, MODE_BYPASS)


def _ui_to_api(
    workflow: Mapping[str, Any], mappings: Mapping[str, type], display_names: Mapping[str, str]
) -> dict[str, dict]:
    ui = _UiGraph(workflow)
    graph: dict[str, dict] = {}
    for node_id in sorted(ui.nodes, key=node_sort_key):
        node = ui.nodes[node_id]
        if not _is_backend_node(node):
            continue
        class_type = str(node.get("type"))
        title = node.get("title") or display_names.get(class_type) or class_type
        where = _Where(node_id, title, class_type)
        cls = _ui_class(ui, node, where, mappings)
        specs = input_specs(cls)
        graph[node_id] = {
            "class_type": class_type,
            "inputs": _ui_inputs(ui, node, specs, where, cls),
            "_meta": {"title": title},
        }
    return graph


def _normalize_api(
    workflow: Mapping[str, Any], display_names: Mapping[str, str]
) -> dict[str, dict]:
    """Copy an API-format prompt with string ids, list links and a ``_meta.title`` on every node."""
    graph: dict[str, dict] = {}
    for node_id, node in workflow.items():
        class_type = str(node["class_type"])
        inputs = {
            name: [str(v[0]), v[1]] if is_link(v) else v for name, v in (node.get("inputs") or {}).items()
        }
        title = _title_of(node) or display_names.get(class_type) or class_type
        graph[str(node_id)] = {"class_type": class_type, "inputs": inputs, "_meta": {"title": title}}
    return graph


def to_api_graph(
    workflow: Mapping[str, Any],
    node_class_mappings: Mapping[str, type],
    display_names: Mapping[str, str] | None = None,
    overrides: Iterable[str] = (),
) -> dict[str, dict]:
    """Convert a UI- or API-format workflow to a validated API graph, with ``--set`` overrides applied.

    Returns ``{node_id: {"class_type": str, "inputs": {name: value | [src_id, out_index]},
    "_meta": {"title": str}}}`` with string node ids. ``display_names`` (the pack's
    ``NODE_DISPLAY_NAME_MAPPINGS``) supplies titles for nodes saved without one.

    Bypassed nodes (mode 4) pass through: a link from their output is rewired to
    their connected input of the same type (same index first), as the frontend
    does; with no such input the link is dropped, which is an error when the input
    is required. Muted nodes (mode 2) are dropped with their links. A seed's
    "control after generate" mode (randomize/increment/...) is not applied: the
    stored value is used, so a headless run repeats what the file says.

    ``overrides`` (``ID.INPUT=VALUE`` texts, see ``apply_overrides``) replace the file's values
    *before* the graph is validated, so an override can repair a value that is invalid in the
    file (``--set 2.text_encoder_1=(none)`` for a file this machine lacks), and checks that
    look at several inputs at once (``VALIDATE_INPUTS``) see the values that will run.
    """
    names = display_names or {}
    check_shape(workflow)
    if detect_format(workflow) == "ui":
        graph = _ui_to_api(workflow, node_class_mappings, names)
    else:
        graph = _normalize_api(workflow, names)
    apply_overrides(graph, overrides, node_class_mappings)
    validate_graph(graph, node_class_mappings)
    return graph


# --------------------------------------------------------------------------- validation


def _check_number(spec: InputSpec, value: Any, where: _Where) -> int | float:
    """INT/FLOAT type and min/max; an integral float is accepted as INT (JSON has one number type)."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if spec.type == "INT" and is_number and float(value).is_integer():
        value = int(value)
    elif spec.type == "FLOAT" and is_number and math.isfinite(value):
        value = float(value)
    elif spec.type == "FLOAT" and is_number:  # NaN passes every min/max comparison
        raise where.error(spec.name, f"{value} is not a finite number", "give a finite number")
    else:
        kind = "an integer" if spec.type == "INT" else "a number"
        raise where.error(spec.name, f"expected {kind}, got {json.dumps(value)}", f"give {kind}")
    low, high = spec.options.get("min"), spec.options.get("max")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"between {low} and {high}" if low is not None and high is not None else (
            f"at least {low}" if low is not None else f"at most {high}")
        raise where.error(spec.name, f"{value} is out of range", f"use a value {bounds}")
    return value


def check_widget_value(spec: InputSpec, value: Any, where: _Where) -> Any:
    """Check a literal against a widget input's type, range or options; return it normalized."""
    if spec.type in ("INT", "FLOAT"):
        return _check_number(spec, value, where)
    if spec.type == "BOOLEAN" and not isinstance(value, bool):
        raise where.error(spec.name, f"expected true or false, got {json.dumps(value)}", "give true or false")
    if spec.type == "STRING" and not isinstance(value, str):
        raise where.error(spec.name, f"expected a string, got {json.dumps(value)}", "give a quoted string")
    if spec.type == "COMBO" and spec.choices is not None and value not in spec.choices:
        if spec.choices:
            err = where.error(spec.name, f"{json.dumps(value)} is not an allowed value", f"use {spec.display_type}")
        else:
            err = where.error(spec.name, f"{json.dumps(value)} is not available, and this input has no choices at "
                                         f"all (no matching files were found)", "put the file where it is looked up")
        err.missing_choice = True
        raise err
    return value


def _check_link(
    spec: InputSpec, value: list, where: _Where, graph: Mapping[str, dict], mappings: Mapping[str, type]
) -> list:
    """A link must name an existing node, an existing output, and a compatible type."""
    src_id, slot = str(value[0]), value[1]
    source = graph.get(src_id)
    if source is None:
        raise where.error(spec.name, f"linked to node {src_id}, which is not in the graph", "reconnect the input")
    src_where = _where(src_id, source)
    outputs = return_types(_node_class(src_where, mappings))
    if not 0 <= slot < len(outputs):
        raise where.error(
            spec.name, f"linked to output {slot} of {src_where.describe()}, which has {len(outputs)} output(s)",
            "reconnect the input to an existing output",
        )
    if not types_compatible(outputs[slot], spec.type):
        raise where.error(
            spec.name,
            f"expects {spec.type} but is linked to output {slot} of {src_where.describe()}, "
            f"which gives {outputs[slot]}",
            f"connect it to an output of type {spec.type}",
        )
    return [src_id, slot]


def _check_input(
    spec: InputSpec, node: dict, where: _Where, graph: Mapping[str, dict], mappings: Mapping[str, type]
) -> None:
    inputs = node["inputs"]
    if spec.name not in inputs:
        if spec.required:
            how = "connect it" if not spec.is_widget else "give it a value"
            raise where.error(spec.name, "required input has neither a link nor a value", how)
        return
    value = inputs[spec.name]
    if is_link(value):
        inputs[spec.name] = _check_link(spec, value, where, graph, mappings)
    elif spec.type not in WIDGET_TYPES and spec.type != "*":
        raise where.error(
            spec.name, f"needs a link from a node that outputs {spec.type}, got the value {json.dumps(value)}",
            f"connect it to an output of type {spec.type}",
        )
    else:
        inputs[spec.name] = check_widget_value(spec, value, where)


def _check_node(node_id: str, node: Any, graph: Mapping[str, dict], mappings: Mapping[str, type]) -> None:
    if not isinstance(node, dict) or not isinstance(node.get("inputs", {}), dict):
        raise WorkflowError(f"node {node_id}: not a {{\"class_type\", \"inputs\"}} object. Fix: re-export it",
                            node_id=node_id)
    node.setdefault("inputs", {})
    where = _where(node_id, node)
    cls = _node_class(where, mappings)
    specs = input_specs(cls)
    declared = {s.name for s in specs}
    moved = [s for s in moved_input_specs(cls) if s.name in node["inputs"] and s.name not in declared]
    for name in node["inputs"]:
        if name not in declared and name not in {s.name for s in moved}:
            raise where.error(
                name, "this node type has no such input",
                f"remove it; valid inputs are {', '.join(sorted(declared)) or '(none)'}",
            )
    for spec in specs + moved:
        _check_input(spec, node, where, graph, mappings)


def _call_validate_inputs(cls: type, node: dict, where: _Where) -> None:
    """ComfyUI's input-validation hook, run when the prompt is queued (before any node runs): a V3 node's
    ``validate_inputs`` (only where the node overrides it; called on a class clone holding the hidden values),
    a classic one's ``VALIDATE_INPUTS``. It gets the widget values it names (linked inputs as None: not known
    yet) and returns True or a message."""
    from ..nodes.schema import is_v3, overrides

    if is_v3(cls):
        if not overrides(cls, "validate_inputs"):
            return
        validate = cls.PREPARE_CLASS_CLONE({"UNIQUE_ID": where.node_id}).validate_inputs
    else:
        validate = getattr(cls, "VALIDATE_INPUTS", None)
    if validate is None:
        return
    params = inspect.signature(validate).parameters
    takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())
    # A linked input is not known yet: None, as ComfyUI passes it (an unconnected optional one is left out).
    values = {k: None if is_link(v) else v for k, v in node["inputs"].items() if takes_all or k in params}
    outcome = validate(**values)
    if outcome is not True:
        raise where.error(None, str(outcome), "change the value and run again")


def _edges(graph: Mapping[str, dict]) -> dict[str, list[tuple[str, str]]]:
    """For each node, its (source node id, input name) links, in stable order."""
    return {
        node_id: [(str(v[0]), name) for name, v in node["inputs"].items() if is_link(v)]
        for node_id, node in graph.items()
    }


def _find_cycle(edges: Mapping[str, list[tuple[str, str]]]) -> list[tuple[str, str]] | None:
    """A cycle as [(node id, input name that links back), ...], or None (iterative DFS)."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    for root in sorted(edges, key=node_sort_key):
        if state.get(root):
            continue
        stack: list[tuple[str, int]] = [(root, 0)]
        path: list[tuple[str, str]] = []
        state[root] = 1
        while stack:
            node_id, index = stack[-1]
            deps = edges.get(node_id, [])
            if index == len(deps):
                state[node_id] = 2
                stack.pop()
                if path:
                    path.pop()
                continue
            stack[-1] = (node_id, index + 1)
            src, name = deps[index]
            if state.get(src) == 1:
                on_stack = [n for n, _ in stack]
                start = on_stack.index(src)
                return list(zip(on_stack[start:], [p[1] for p in path[start:]] + [name]))
            if src in edges and not state.get(src):
                state[src] = 1
                path.append((node_id, name))
                stack.append((src, 0))
    return None


def _check_cycles(graph: Mapping[str, dict]) -> None:
    cycle = _find_cycle(_edges(graph))
    if cycle is None:
        return
    hops = " <- ".join(f'{_where(n, graph[n]).describe(name)}' for n, name in cycle)
    first_id, first_input = cycle[0]
    raise WorkflowError(
        f"the graph has a cycle: {hops} <- node {first_id}. Fix: remove one of these links",
        node_id=first_id, input_name=first_input,
    )


def validate_graph(graph: dict[str, dict], node_class_mappings: Mapping[str, type]) -> None:
    """Check an API graph in place (normalizing links and numbers) or raise WorkflowError.

    Checks: known node types, declared input names, required inputs present, link
    sources/outputs exist with compatible types, widget types/ranges/options, no cycles.
    """
    if not isinstance(graph, dict) or not graph:
        raise WorkflowError("the workflow has no nodes to run. Fix: add nodes in ComfyUI and save again")
    order = sorted(graph, key=node_sort_key)
    for node_id in order:
        _check_node(node_id, graph[node_id], graph, node_class_mappings)
    _check_cycles(graph)
    # The nodes' own checks last: they may read files (a dataset folder), and a typo in a number must not hide
    # behind a missing folder, nor be found only after the folder is fixed.
    for node_id in order:
        node = graph[node_id]
        _call_validate_inputs(_node_class(_where(node_id, node), node_class_mappings), node, _where(node_id, node))


# --------------------------------------------------------------------------- overrides


def _find_node_ref(graph: Mapping[str, dict], ref: str) -> str:
    """A node by id, or by title when the title is unique."""
    if ref in graph:
        return ref
    matches = [i for i, n in graph.items() if _title_of(n) == ref]
    if len(matches) == 1:
        return matches[0]
    listing = ", ".join(f'{i} "{_title_of(graph[i])}"' for i in sorted(graph, key=node_sort_key))
    problem = f'several nodes are titled "{ref}"' if matches else f'no node "{ref}" in the workflow'
    raise WorkflowError(f"--set {ref}...: {problem}. Fix: use one of the node ids: {listing}", node_id=ref)


def _parse_override(text: str) -> tuple[str, str, str]:
    """Split ``ID.INPUT=VALUE`` (the id may be a node title; VALUE may contain '=' and '.')."""
    target, sep, raw = text.partition("=")
    ref, dot, name = target.rpartition(".")
    if not sep or not dot or not ref or not name:
        raise WorkflowError(f'--set "{text}": expected ID.INPUT=VALUE. Fix: write e.g. --set 5.steps=200')
    return ref, name, raw


def _parse_value(raw: str) -> Any:
    """JSON when it parses (5, 1e-4, true, "x"), else the raw text."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _coerce(spec: InputSpec, raw: str, where: _Where) -> Any:
    """Turn ``--set`` text into the input's type, then check it like a widget value."""
    parsed = _parse_value(raw)
    if spec.type == "STRING":
        value = parsed if isinstance(parsed, str) else raw
    elif spec.type == "COMBO":
        value = next((v for v in (parsed, raw) if spec.choices and v in spec.choices), raw)
    elif spec.type == "BOOLEAN" and isinstance(parsed, (int, str)) and not isinstance(parsed, bool):
        words = {"1": True, "0": False, "true": True, "false": False, "yes": True, "no": False}
        value = words.get(str(parsed).lower(), parsed)
    else:
        value = parsed
    return check_widget_value(spec, value, where)


def apply_overrides(
    graph: dict[str, dict], overrides: Iterable[str], node_class_mappings: Mapping[str, type]
) -> dict[str, dict]:
    """Apply ``--set ID.INPUT=VALUE`` overrides to an API graph in place; returns the graph.

    ``ID`` is a node id (or a unique node title). Only widget inputs can be set; a
    value replaces a link there too (like a widget converted back from an input).
    Each value is checked on its own; the graph's other values are not: pass the
    overrides to ``to_api_graph`` to have them applied before the file is validated.
    """
    for text in overrides:
        ref, name, raw = _parse_override(text)
        node_id = _find_node_ref(graph, ref)
        node = graph[node_id]
        where = _where(node_id, node)
        cls = _node_class(where, node_class_mappings)
        specs = {s.name: s for s in input_specs(cls)}
        spec = specs.get(name)
        moved = {s.name: s for s in moved_input_specs(cls)}
        if spec is None and name in moved:
            # A setting that moved to an options node: set it there when one is plugged in, else by name here.
            node_id, node, spec = _moved_target(graph, node_id, node, name, moved[name], node_class_mappings)
            where = _where(node_id, node)
        if spec is None:
            raise where.error(name, "this node type has no such input",
                              f"use one of {', '.join(n for n, s in specs.items() if s.is_widget) or '(none)'}")
        if not spec.is_widget:
            raise where.error(name, f"is a {spec.type} link, not a value", "connect it in the workflow instead")
        node["inputs"][name] = _coerce(spec, raw, where)
    return graph


def _moved_target(graph: dict, node_id: str, node: dict, name: str, spec: InputSpec,
                  mappings: Mapping[str, type]) -> tuple[str, dict, InputSpec]:
    """Where ``--set ID.NAME`` lands for a setting that moved from node ID to an options node: the linked source
    node that has that widget, else node ID itself (which takes it by name)."""
    for value in node["inputs"].values():
        if is_link(value) and str(value[0]) in graph:
            source = graph[str(value[0])]
            found = next((s for s in input_specs(_node_class(_where(str(value[0]), source), mappings))
                          if s.name == name and s.is_widget), None)
            if found is not None:
                return str(value[0]), source, found
    return node_id, node, spec


__all__ = [
    "WorkflowError", "InputSpec", "input_specs", "hidden_inputs", "return_types", "is_link",
    "types_compatible", "detect_format", "load_workflow", "to_api_graph", "validate_graph",
    "check_widget_value", "apply_overrides", "node_sort_key",
]
