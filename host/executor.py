"""Run an API graph with our node classes, in dependency order, without ComfyUI.

This is the headless counterpart of ComfyUI's executor (``execution.py``),
reduced to what our pack needs but faithful where a node could tell the
difference:

- every node runs inside ``torch.inference_mode()``, as ComfyUI's
  ``PromptExecutor.execute_async`` does: a node that needs autograd must leave it
  itself (``torch.inference_mode(False)``), and tensors made by an earlier node
  are inference tensors;
- inputs travel as ComfyUI passes them: every widget value and every link is a
  list, the node is called once per list element (``_async_map_node_over_list``),
  and each output slot is the list of the calls' results (``merge_result_data``);
- ``ui`` dicts are merged as ComfyUI merges them (every value must be a list,
  which is what the websocket ``executed`` message carries).

- V3 nodes (nodes/schema.py; ComfyUI's ``io.ComfyNode`` works the same way) run as
  ComfyUI runs them: classmethod ``execute`` on a class clone holding the hidden
  values (``cls.hidden.unique_id``), awaited when async, its ``NodeOutput``
  unwrapped (values and ``ui``); ``validate_inputs`` runs when the graph is
  validated (host/workflow.py). Classic nodes keep the V1 protocol (instance,
  ``FUNCTION``, hidden values as arguments, ``VALIDATE_INPUTS``).

Not supported (our nodes use none of them): ``INPUT_IS_LIST`` /
``OUTPUT_IS_LIST``, lazy inputs, ``IS_CHANGED`` / ``fingerprint_inputs`` and result
caching between runs, node expansion, and the ``DYNPROMPT`` hidden input.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from tqdm import tqdm

from .workflow import hidden_inputs, input_specs, is_link, node_sort_key, validate_graph

#: ``on_node(event, node_id, ui)``: event is "executing" (before, ui None) or
#: "executed" (after, with the node's ui dict or None) -- ComfyUI's websocket names.
NodeCallback = Callable[[str, str, "dict | None"], None]


class NodeExecutionError(Exception):
    """A node raised while running; names the node so the user knows where to look.

    The original exception is chained (``__cause__``) and kept as ``original``.
    """

    def __init__(self, node_id: str, title: str, class_type: str, original: BaseException):
        shown = f' "{title}"' if title and title != class_type else ""
        super().__init__(f"node {node_id}{shown} ({class_type}) failed: {type(original).__name__}: {original}")
        self.node_id = node_id
        self.title = title
        self.class_type = class_type
        self.original = original


class ExecutionResults(dict):
    """Outputs of the nodes that ran: ``{node_id: output tuple}``, in execution order.

    ``ui`` holds the ``{"ui": {...}}`` dicts that nodes returned (``{node_id: ui}``,
    only for nodes that returned one), which is what ComfyUI would show in the
    editor; ``order`` lists the node ids as they ran.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ui: dict[str, dict] = {}
        self.order: list[str] = []
        #: ComfyUI's form of each node's outputs: one list per output slot.
        self.slots: dict[str, list[list]] = {}


def _is_output_node(cls: type) -> bool:
    return bool(getattr(cls, "OUTPUT_NODE", False))


def _dependencies(node: Mapping[str, Any]) -> set[str]:
    return {str(v[0]) for v in node["inputs"].values() if is_link(v)}


def _needed_nodes(graph: Mapping[str, dict], node_class_mappings: Mapping[str, type]) -> set[str]:
    """Output nodes and everything they depend on; all nodes when there is no output node.

    ComfyUI only runs what an output needs; running everything when the graph has no
    output keeps "run this loader to check it" workflows useful.
    """
    outputs = [i for i, n in graph.items() if _is_output_node(node_class_mappings[n["class_type"]])]
    if not outputs:
        return set(graph)
    needed: set[str] = set()
    todo = list(outputs)
    while todo:
        node_id = todo.pop()
        if node_id not in needed:
            needed.add(node_id)
            todo.extend(_dependencies(graph[node_id]))
    return needed


def execution_order(graph: Mapping[str, dict], node_class_mappings: Mapping[str, type]) -> list[str]:
    """Node ids to run, sources before consumers, ties broken by node id (stable runs)."""
    needed = _needed_nodes(graph, node_class_mappings)
    waiting = {i: _dependencies(graph[i]) & needed for i in needed}
    order: list[str] = []
    while waiting:
        ready = sorted((i for i, deps in waiting.items() if not deps), key=node_sort_key)
        if not ready:  # validate_graph rejects cycles; this guards hand-built graphs
            raise RuntimeError(f"cycle among nodes {sorted(waiting, key=node_sort_key)}")
        node_id = ready[0]
        order.append(node_id)
        del waiting[node_id]
        for deps in waiting.values():
            deps.discard(node_id)
    return order


def _hidden_values(cls: type, node_id: str, graph: Mapping[str, dict]) -> dict[str, list]:
    """Values ComfyUI fills for the class's ``hidden`` inputs, by kind (``"UNIQUE_ID"``: ``[node_id]``); the
    kinds a headless run has no value for (``DYNPROMPT``, ``AUTH_TOKEN_COMFY_ORG``...) are None."""
    known = {"UNIQUE_ID": node_id, "PROMPT": graph, "EXTRA_PNGINFO": None}
    return {kind: [known.get(kind)] for kind in hidden_inputs(cls).values()}


def _hidden_kwargs(cls: type, hidden: Mapping[str, list]):
    """A classic node's hidden inputs as (argument name, value list) pairs, for the kinds ComfyUI fills."""
    return [(name, hidden[kind]) for name, kind in hidden_inputs(cls).items()
            if kind in ("UNIQUE_ID", "PROMPT", "EXTRA_PNGINFO")]


def _input_lists(
    node_id: str, cls: type, graph: Mapping[str, dict], slots: Mapping[str, list[list]]
) -> dict[str, list]:
    """Declared inputs present in the graph as ComfyUI's ``get_input_data`` builds them: a widget
    value becomes ``[value]``, a link the source's whole output list for that slot.

    Optional inputs absent from the graph are not passed: the node method's defaults apply.
    """
    inputs = graph[node_id]["inputs"]
    lists: dict[str, list] = {}
    for spec in input_specs(cls):
        if spec.name not in inputs:
            continue
        value = inputs[spec.name]
        if is_link(value):
            src, slot = str(value[0]), value[1]
            outputs = slots[src]
            if slot >= len(outputs):
                raise ValueError(
                    f'input "{spec.name}" needs output {slot} of node {src}, which returned {len(outputs)} value(s)'
                )
            lists[spec.name] = outputs[slot]
        else:
            lists[spec.name] = [value]
    return lists


def _split_result(raw: Any) -> tuple[tuple, dict | None]:
    """A node's return value as (outputs, ui): a ``NodeOutput`` (V3), a tuple/list, None, or
    ``{"result": ..., "ui": ...}``."""
    if hasattr(raw, "args") and hasattr(raw, "ui"):  # NodeOutput, ours or ComfyUI's
        from ..nodes.schema import normalize_output

        out = normalize_output(raw)
        return tuple(out.args), out.ui
    if isinstance(raw, Mapping):
        result = raw.get("result", ())
        return tuple(result or ()), raw.get("ui")
    if raw is None:
        return (), None
    if isinstance(raw, (tuple, list)):
        return tuple(raw), None
    raise TypeError(f"returned {type(raw).__name__}; a node must return a tuple or {{'result': ..., 'ui': ...}}")


def _merge_ui(uis: list[dict]) -> dict | None:
    """ComfyUI's ``get_output_from_returns``: ``{k: [y for x in uis for y in x[k]]}``. A value that is
    not a list would be split into characters (a str) or raise there, so it is an error here."""
    if not uis:
        return None
    for ui in uis:
        for key, value in ui.items():
            if not isinstance(value, (list, tuple)):
                raise TypeError(f'ui["{key}"] is a {type(value).__name__}; ComfyUI needs every ui value to be a '
                                f"list (wrap it: [value])")
    return {k: [y for x in uis for y in x[k]] for k in uis[0].keys()}


def _run_node(
    node_id: str, cls: type, graph: Mapping[str, dict], slots: Mapping[str, list[list]]
) -> tuple[list[list], dict | None]:
    """Call the node once per element of its input lists (ComfyUI's ``_async_map_node_over_list``: call i
    takes element i of each list, or its last). Returns (one list per output slot, merged ui).

    A V3 node (nodes/schema.py, like ComfyUI's ``io.ComfyNode``) is not instantiated: each call runs its
    ``FUNCTION`` (``EXECUTE_NORMALIZED`` or ``..._ASYNC``) on ``PREPARE_CLASS_CLONE(hidden values)``, the
    hidden values never travel as arguments, a coroutine is awaited, and the ``NodeOutput`` is unwrapped
    into its values and ``ui``, as ComfyUI's ``get_output_from_returns`` does. A classic node is instantiated
    and its ``FUNCTION`` gets the hidden values as keyword arguments."""
    from ..nodes.schema import is_v3

    lists = _input_lists(node_id, cls, graph, slots)
    hidden = _hidden_values(cls, node_id, graph)
    calls = max((len(v) for v in lists.values()), default=0)
    returns = []
    for i in range(max(calls, 1)):
        args = {k: v[i if len(v) > i else -1] for k, v in lists.items()}
        if is_v3(cls):
            clone = cls.PREPARE_CLASS_CLONE({kind: v[0] for kind, v in hidden.items()})
            returns.append(_await(getattr(clone, cls.FUNCTION)(**args)))
        else:
            returns.append(getattr(cls(), cls.FUNCTION)(**args, **{k: v[0] for k, v in _hidden_kwargs(cls, hidden)}))
    split = [_split_result(r) for r in returns]
    n_out = len(split[0][0])
    outputs = [[out[i] for out, _ in split] for i in range(n_out)]
    return outputs, _merge_ui([ui for _, ui in split if ui is not None])


def _await(value: Any) -> Any:
    """A coroutine's result (an async ``execute``), run to completion on this thread's own event loop, as
    ComfyUI awaits it; any other value as is."""
    import asyncio
    import inspect

    return asyncio.run(value) if inspect.iscoroutine(value) else value


def _title(graph: Mapping[str, dict], node_id: str) -> str:
    node = graph[node_id]
    meta = node.get("_meta") or {}
    return str(meta.get("title") or node["class_type"])


def execute_graph(
    graph: dict[str, dict],
    node_class_mappings: Mapping[str, type],
    *,
    progress: bool = True,
    on_node: NodeCallback | None = None,
) -> ExecutionResults:
    """Validate the API graph, then run the needed nodes in dependency order.

    Returns an :class:`ExecutionResults` (a ``dict[str, tuple]`` of outputs by node
    id, plus ``.ui`` and ``.order``). A node that raises is reported as
    :class:`NodeExecutionError` (original chained); KeyboardInterrupt propagates
    unchanged so the command can exit 130.
    """
    import torch  # here, not at module level: importing the host stays cheap

    validate_graph(graph, node_class_mappings)
    order = execution_order(graph, node_class_mappings)
    results = ExecutionResults()
    # ComfyUI's PromptExecutor.execute_async runs the whole prompt under inference mode.
    from ..nodes.progress import console_bars

    # ``progress=False`` (--no-progress): no bar here, and none from the nodes' console callbacks either.
    with torch.inference_mode(), console_bars(progress), \
            tqdm(total=len(order), unit="node", disable=not progress, leave=True) as bar:
        for index, node_id in enumerate(order, start=1):
            class_type = graph[node_id]["class_type"]
            title = _title(graph, node_id)
            bar.set_description(f"node {index}/{len(order)}: {title}")
            if on_node is not None:
                on_node("executing", node_id, None)
            try:
                slots, ui = _run_node(node_id, node_class_mappings[class_type], graph, results.slots)
            except Exception as exc:
                raise NodeExecutionError(node_id, title, class_type, exc) from exc
            results.slots[node_id] = slots
            results[node_id] = tuple(slot[0] for slot in slots)  # one call per node: its outputs
            results.order.append(node_id)
            if ui is not None:
                results.ui[node_id] = ui
            if on_node is not None:
                on_node("executed", node_id, ui)
            bar.update(1)
    return results


__all__ = ["NodeExecutionError", "ExecutionResults", "execute_graph", "execution_order"]
