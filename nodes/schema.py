"""The one home of each node's schema: a small declarative copy of ComfyUI's V3 ``io.Schema``.

ComfyUI's V3 node API (``comfy_api.latest``: ``io.ComfyNode``, ``define_schema`` -> ``io.Schema``,
classmethod ``execute`` -> ``io.NodeOutput``) is not installable outside ComfyUI, yet the pack's nodes
must also run headless (``lowvram-lora run`` / ``serve``). So each node declares its schema once, here,
with the same names and meanings as ``io`` (``Int``, ``Float``, ``String``, ``Boolean``, ``Combo``,
``Custom``; ``Output``; ``Hidden``), and:

- inside ComfyUI, ``nodes/v3.py`` turns it into a real ``io.Schema`` and each node into an
  ``io.ComfyNode`` (registered by ``comfy_entrypoint``);
- headless, :class:`Node` gives the node the same V1-compatibility face that ComfyUI's
  ``_ComfyNodeBaseInternal`` gives a V3 node (``INPUT_TYPES``, ``RETURN_TYPES``, ``GET_NODE_INFO_V1``,
  ``PREPARE_CLASS_CLONE``, ``EXECUTE_NORMALIZED``...), ported from ComfyUI 0.33's
  ``comfy_api/latest/_io.py``, so our executor and ``/object_info`` treat it as ComfyUI treats a V3 node.

Nothing here imports ComfyUI or torch.
"""
from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, field
from typing import Any

# --------------------------------------------------------------------------- inputs and outputs


def _prune(d: dict) -> dict:
    """ComfyUI's ``prune_dict``: drop the None values (False and 0 stay)."""
    return {k: v for k, v in d.items() if v is not None}


@dataclass
class Input:
    """One input, as ``io.<Type>.Input``: ``kind`` is the io class (Int, Float, String, Boolean, Combo or
    Custom), ``io_type`` the socket type, ``options`` the type's own keyword arguments (min, max, step,
    round, multiline, options...)."""

    kind: str
    id: str
    io_type: str
    tooltip: str | None = None
    optional: bool = False
    default: Any = None
    options: dict = field(default_factory=dict)
    # Drawn behind the node's "advanced inputs" toggle (ComfyUI's ``advanced=True``): rarely changed settings. The
    # widget stays in its place, so UI-format workflows (widget values by position) load unchanged.
    advanced: bool = False

    @property
    def is_widget(self) -> bool:
        return self.kind != "Custom"

    def as_dict(self) -> dict:
        """``io.<Type>.Input.as_dict()`` (V1 form: without ``optional``), key for key."""
        d = _prune({"tooltip": self.tooltip, "advanced": self.advanced or None})
        if not self.is_widget:
            return d
        d |= _prune({"default": self.default})
        o = self.options
        if self.kind == "Int":
            d |= _prune({k: o.get(k) for k in ("min", "max", "step", "control_after_generate")})
        elif self.kind == "Float":
            d |= _prune({k: o.get(k) for k in ("min", "max", "step", "round")})
        elif self.kind == "String":
            d |= _prune({"forceInput": o.get("force_input"), "multiline": o.get("multiline", False),
                         "placeholder": o.get("placeholder")})
        elif self.kind == "Combo":
            d |= _prune({"multiselect": False, "options": list(o["options"])})
        return d


def Int(id: str, *, default: int | None = None, min: int | None = None, max: int | None = None,  # noqa: A002
        step: int | None = None, tooltip: str | None = None, optional: bool = False,
        control_after_generate: bool | None = None, advanced: bool = False) -> Input:
    return Input("Int", id, "INT", tooltip, optional, default,
                 {"min": min, "max": max, "step": step, "control_after_generate": control_after_generate}, advanced)


def Float(id: str, *, default: float | None = None, min: float | None = None, max: float | None = None,  # noqa: A002
          step: float | None = None, round: float | bool | None = None, tooltip: str | None = None,
          optional: bool = False, advanced: bool = False) -> Input:
    return Input("Float", id, "FLOAT", tooltip, optional, default, {"min": min, "max": max, "step": step, "round": round},
                 advanced)


def String(id: str, *, default: str | None = None, multiline: bool = False, tooltip: str | None = None,  # noqa: A002
           optional: bool = False, force_input: bool | None = None) -> Input:
    """``force_input``: a socket only (no widget), for text that comes from another node's output."""
    return Input("String", id, "STRING", tooltip, optional, default,
                 {"multiline": multiline, **({"force_input": True} if force_input else {})})


def Boolean(id: str, *, default: bool | None = None, tooltip: str | None = None, optional: bool = False,  # noqa: A002
            advanced: bool = False) -> Input:
    return Input("Boolean", id, "BOOLEAN", tooltip, optional, default, advanced=advanced)


def Combo(id: str, options: list, *, default: Any = None, tooltip: str | None = None,  # noqa: A002
          optional: bool = False, advanced: bool = False) -> Input:
    return Input("Combo", id, "COMBO", tooltip, optional, default, {"options": list(options)}, advanced)


def Custom(io_type: str, id: str, *, tooltip: str | None = None, optional: bool = False) -> Input:  # noqa: A002
    """A socket of the pack's own type (``io.Custom(io_type).Input``), e.g. LOWVRAM_MODEL."""
    return Input("Custom", id, io_type, tooltip, optional)


@dataclass
class Output:
    """``io.<Type>.Output(id, display_name=id, tooltip)``; ``io_type`` IMAGE is ComfyUI's ``io.Image``."""

    io_type: str
    id: str
    tooltip: str | None = None
    is_output_list: bool = False


#: ``io.Hidden``: the hidden inputs a node may ask for (name -> ComfyUI's value), in ComfyUI's order.
HIDDEN = {"unique_id": "UNIQUE_ID", "prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO", "dynprompt": "DYNPROMPT",
          "auth_token_comfy_org": "AUTH_TOKEN_COMFY_ORG", "api_key_comfy_org": "API_KEY_COMFY_ORG",
          "comfy_usage_source": "COMFY_USAGE_SOURCE"}


@dataclass
class Schema:
    """``io.Schema``, with the fields the pack uses."""

    node_id: str
    display_name: str | None = None
    category: str = "sd"
    inputs: list[Input] = field(default_factory=list)
    outputs: list[Output] = field(default_factory=list)
    hidden: list[str] = field(default_factory=list)  # names of HIDDEN
    description: str = ""
    search_aliases: list[str] = field(default_factory=list)
    is_output_node: bool = False
    not_idempotent: bool = False
    # Every input arrives as a list (ComfyUI runs the node once on whole lists, not once per list item).
    is_input_list: bool = False

    def finalize(self) -> "Schema":
        """``Schema.finalize``: an output node also gets the prompt and extra_pnginfo hidden inputs."""
        if self.is_output_node:
            for name in ("prompt", "extra_pnginfo"):
                if name not in self.hidden:
                    self.hidden.append(name)
        return self

    def validate(self) -> None:
        """``Schema.validate``: input and output ids unique; hidden names known."""
        for what, ids in (("Input", [i.id for i in self.inputs]), ("Output", [o.id for o in self.outputs])):
            dupes = sorted({i for i in ids if ids.count(i) > 1})
            if dupes:
                raise ValueError(f"{self.node_id}: {what} ids must be unique, but {dupes} are not")
        unknown = [h for h in self.hidden if h not in HIDDEN]
        if unknown:
            raise ValueError(f"{self.node_id}: unknown hidden inputs {unknown}; known: {', '.join(HIDDEN)}")

    def v1_inputs(self) -> dict:
        """``create_input_dict_v1`` plus the hidden section: what ``INPUT_TYPES()`` of the V3 node returns."""
        d: dict = {"required": {}}
        for i in self.inputs:
            d.setdefault("optional" if i.optional else "required", {})[i.id] = (i.io_type, i.as_dict())
        for h in self.hidden:
            d.setdefault("hidden", {})[h] = (HIDDEN[h],)
        return d

    def v1_info(self, python_module: str) -> dict:
        """``asdict(Schema.get_v1_info(cls))``: the node's ``/object_info`` entry, before JSON encoding."""
        inputs = self.v1_inputs()
        return asdict(_NodeInfoV1(
            input=inputs, input_order={k: list(v) for k, v in inputs.items()}, is_input_list=self.is_input_list,
            output=[o.io_type for o in self.outputs], output_is_list=[o.is_output_list for o in self.outputs],
            output_name=[o.id or o.io_type for o in self.outputs],
            output_tooltips=[o.tooltip or None for o in self.outputs], output_matchtypes=None,
            name=self.node_id, display_name=self.display_name, description=self.description,
            python_module=python_module, category=self.category, output_node=self.is_output_node,
            deprecated=False, experimental=False, dev_only=False, api_node=False, price_badge=None,
            search_aliases=self.search_aliases or None, essentials_category=None, has_intermediate_output=False))


@dataclass
class _NodeInfoV1:
    """``io.NodeInfoV1``, field for field and in its order (the JSON keys' order)."""

    input: dict = None
    input_order: dict = None
    is_input_list: bool = None
    output: list = None
    output_is_list: list = None
    output_name: list = None
    output_tooltips: list = None
    output_matchtypes: list = None
    name: str = None
    display_name: str = None
    description: str = None
    python_module: Any = None
    category: str = None
    output_node: bool = None
    deprecated: bool = None
    experimental: bool = None
    dev_only: bool = None
    api_node: bool = None
    price_badge: dict = None
    search_aliases: list = None
    essentials_category: str = None
    has_intermediate_output: bool = None


# --------------------------------------------------------------------------- results and hidden values


class NodeOutput:
    """``io.NodeOutput``: the output values, and ``ui`` (every value a list) for the editor."""

    def __init__(self, *args: Any, ui: dict | None = None):
        self.args, self.ui = args, ui

    @property
    def result(self):
        return self.args if self.args else None


class HiddenHolder:
    """``io.HiddenHolder``: the hidden values of one call, as attributes; a missing one is None."""

    def __init__(self, values: dict | None = None):
        for name, kind in HIDDEN.items():
            setattr(self, name, (values or {}).get(kind))


def normalize_output(raw: Any) -> NodeOutput:
    """What ``EXECUTE_NORMALIZED`` accepts from ``execute``: a NodeOutput (ours or ComfyUI's), a tuple,
    ``{"result": ..., "ui": ...}`` or None."""
    if raw is None:
        return NodeOutput()
    if hasattr(raw, "args") and hasattr(raw, "ui"):
        if getattr(raw, "expand", None) is not None or getattr(raw, "block_execution", None) is not None:
            raise TypeError("node expansion and execution blockers are not supported outside ComfyUI")
        ui = raw.ui if raw.ui is None or isinstance(raw.ui, dict) else raw.ui.as_dict()
        return NodeOutput(*raw.args, ui=ui)
    if isinstance(raw, tuple):
        return NodeOutput(*raw)
    if isinstance(raw, dict):
        return NodeOutput(*(raw.get("result") or ()), ui=raw.get("ui"))
    raise TypeError(f"Invalid return type from node: {type(raw)}")


# --------------------------------------------------------------------------- the node base class


class classproperty:  # noqa: N801 (ComfyUI's name)
    def __init__(self, f):
        self.f = f

    def __get__(self, obj, owner):
        return self.f(owner)


def overrides(cls: type, name: str) -> bool:
    """Whether ``cls`` defines ``name`` itself, below :class:`Node` (ComfyUI's ``first_real_override``)."""
    for klass in cls.__mro__:
        if klass is Node:
            return False
        if name in vars(klass):
            return True
    return False


class Node:
    """A pack node, written as a V3 ``io.ComfyNode``: classmethods ``define_schema`` -> :class:`Schema` and
    ``execute(**inputs)`` -> :class:`NodeOutput` (may be ``async``), optional ``validate_inputs`` and
    ``fingerprint_inputs``; hidden values on ``cls.hidden`` during a call. The V1 names below are the
    compatibility face ComfyUI's ``_ComfyNodeBaseInternal`` derives from the schema (read by our host)."""

    hidden: HiddenHolder = HiddenHolder()
    RELATIVE_PYTHON_MODULE = None
    #: A node whose widgets changed: the order UI-format workflows saved before hold their values in, read by name
    #: when ``is_legacy_layout`` tells such a list (host/workflow.py). Empty: the widgets never changed order.
    LEGACY_WIDGETS: tuple = ()

    @staticmethod
    def is_legacy_layout(values: list) -> bool:
        return False

    @classmethod
    def moved_inputs(cls) -> dict[str, Input]:
        """Widgets that moved from this node to an options node it takes, which the node still accepts by name
        (from a workflow saved before the move): name -> the options node's ``Input``. Not declared inputs: the
        host checks their values and the node reads them from the prompt (its hidden ``prompt``)."""
        return {}

    @classmethod
    def define_schema(cls) -> Schema:
        raise TypeError(f"{cls.__name__} declares no schema: a pack node defines define_schema, as io.ComfyNode")

    @classmethod
    def execute(cls, **kwargs) -> NodeOutput:
        raise TypeError(f"{cls.__name__} has no execute: a pack node defines it, as io.ComfyNode")

    @classmethod
    def GET_SCHEMA(cls) -> Schema:
        schema = cls.define_schema().finalize()
        schema.validate()
        return schema

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return cls.GET_SCHEMA().v1_inputs()

    @classmethod
    def GET_NODE_INFO_V1(cls) -> dict:
        # As ComfyUI: the attribute exists (None) until its loader stamps the pack module on the class.
        return cls.GET_SCHEMA().v1_info(getattr(cls, "RELATIVE_PYTHON_MODULE", "nodes"))

    @classmethod
    def PREPARE_CLASS_CLONE(cls, hidden: dict | HiddenHolder | None) -> type:
        """A subclass holding this call's hidden values (ComfyUI clones the class so calls never share them)."""
        holder = hidden if isinstance(hidden, HiddenHolder) or hasattr(hidden, "unique_id") else HiddenHolder(hidden)
        return type(cls.__name__, (cls,), {"hidden": holder, "__module__": cls.__module__, "__doc__": cls.__doc__})

    @classmethod
    def EXECUTE_NORMALIZED(cls, **kwargs) -> NodeOutput:
        return normalize_output(cls.execute(**kwargs))

    @classmethod
    async def EXECUTE_NORMALIZED_ASYNC(cls, **kwargs) -> NodeOutput:
        return normalize_output(await cls.execute(**kwargs))

    @classproperty
    def FUNCTION(cls):  # noqa: N802
        return "EXECUTE_NORMALIZED_ASYNC" if inspect.iscoroutinefunction(cls.execute) else "EXECUTE_NORMALIZED"

    @classproperty
    def RETURN_TYPES(cls):  # noqa: N802
        return tuple(o.io_type for o in cls.GET_SCHEMA().outputs)

    @classproperty
    def RETURN_NAMES(cls):  # noqa: N802
        return tuple(o.id for o in cls.GET_SCHEMA().outputs)

    @classproperty
    def OUTPUT_TOOLTIPS(cls):  # noqa: N802
        return tuple(o.tooltip for o in cls.GET_SCHEMA().outputs)

    @classproperty
    def INPUT_IS_LIST(cls):  # noqa: N802
        return cls.GET_SCHEMA().is_input_list

    @classproperty
    def OUTPUT_NODE(cls):  # noqa: N802
        return cls.GET_SCHEMA().is_output_node

    @classproperty
    def DESCRIPTION(cls):  # noqa: N802
        return cls.GET_SCHEMA().description

    @classproperty
    def CATEGORY(cls):  # noqa: N802
        return cls.GET_SCHEMA().category


def is_v3(cls: type) -> bool:
    """A V3-style node (ours, or ComfyUI's ``io.ComfyNode``): described by a schema, run through a class clone."""
    return hasattr(cls, "define_schema") and hasattr(cls, "PREPARE_CLASS_CLONE")


def call_with_accepted(fn, values: dict):
    """Call ``fn`` with the values its signature takes (all of them when it has ``**kwargs``), as ComfyUI
    does for ``validate_inputs`` / ``fingerprint_inputs`` (it reads their argspec)."""
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())
    return fn(**{k: v for k, v in values.items() if takes_all or k in params})
