"""The pack's nodes as ComfyUI V3 nodes (``comfy_api.latest``), built from their schemas (nodes/schema.py).

Imported only inside ComfyUI (by ``comfy_entrypoint`` in the package root): ``comfy_api`` is not
installable elsewhere. Each node becomes an ``io.ComfyNode`` subclass with the same class id; its
``define_schema`` translates the declarative schema into ``io.Schema`` (``io.Int.Input``, ...), its
``execute`` calls the node's own classmethod on a clone holding ComfyUI's hidden values and returns an
``io.NodeOutput``. ``validate_inputs`` / ``fingerprint_inputs`` exist on the V3 class only where the node
defines them (ComfyUI looks for a real override).
"""
from __future__ import annotations

import inspect

from .schema import Input, Node, Output, Schema, call_with_accepted, normalize_output, overrides


def to_io_input(io, i: Input):
    o = i.options
    common = {"tooltip": i.tooltip, "optional": i.optional}
    # Only when set, and where this ComfyUI's inputs know it (0.3.64's have no ``advanced``).
    if i.advanced and "advanced" in inspect.signature(io.Int.Input.__init__).parameters:
        common["advanced"] = True
    if i.kind == "Custom":
        return (io.Image if i.io_type == "IMAGE" else io.Custom(i.io_type)).Input(i.id, **common)
    if i.kind == "Combo":
        return io.Combo.Input(i.id, options=list(o["options"]), default=i.default, **common)
    if i.kind == "Int":
        return io.Int.Input(i.id, default=i.default, min=o.get("min"), max=o.get("max"), step=o.get("step"),
                            control_after_generate=o.get("control_after_generate"), **common)
    if i.kind == "Float":
        return io.Float.Input(i.id, default=i.default, min=o.get("min"), max=o.get("max"), step=o.get("step"),
                              round=o.get("round"), **common)
    if i.kind == "String":
        return io.String.Input(i.id, default=i.default, multiline=o.get("multiline", False),
                               **({"force_input": True} if o.get("force_input") else {}), **common)
    if i.kind == "Boolean":
        return io.Boolean.Input(i.id, default=i.default, **common)
    raise ValueError(f"input {i.id!r}: no V3 type for kind {i.kind!r}")


def to_io_output(io, o: Output):
    kind = io.Image if o.io_type == "IMAGE" else io.Custom(o.io_type)
    return kind.Output(o.id, display_name=o.id, tooltip=o.tooltip, is_output_list=o.is_output_list)


def to_io_schema(io, schema: Schema):
    return io.Schema(
        node_id=schema.node_id, display_name=schema.display_name, category=schema.category,
        description=schema.description,
        inputs=[to_io_input(io, i) for i in schema.inputs], outputs=[to_io_output(io, o) for o in schema.outputs],
        hidden=[io.Hidden[h] for h in schema.hidden], is_output_node=schema.is_output_node,
        not_idempotent=schema.not_idempotent,
        **({"is_input_list": True} if schema.is_input_list else {}),
        # Only when set: older V3 schemas (ComfyUI 0.3.64) have no search_aliases field.
        **({"search_aliases": list(schema.search_aliases)} if schema.search_aliases else {}))


class PackError(Exception):
    """A problem the user can fix (the engine's ``LowVRAMError``), as a node raises it inside ComfyUI, with the
    same message; the original is its ``__cause__`` (the server log prints both).

    ComfyUI names a failed node's exception ``module.qualname`` (``execution.full_type_name``) except a builtin's,
    which goes by its name alone, and the editor's Errors panel opens with "<that name>: <message>". So this class
    is named like a builtin, after the pack: the panel's first line reads "lowvram-lora: <our sentence>" instead of
    "lowvram_lora.engine.checkpoint.files.UnreadableSafetensors: <our sentence>". (The toast above it is the
    frontend's own fixed text for any node's failure: "<node> failed / This node threw an error during execution".)
    """


PackError.__module__, PackError.__qualname__, PackError.__name__ = "builtins", "lowvram-lora", "lowvram-lora"


def _run(call):
    """``call()``, a user-fixable error re-raised as :class:`PackError` (its message unchanged)."""
    from ..engine.errors import LowVRAMError

    try:
        return call()
    except LowVRAMError as exc:
        raise PackError(str(exc)) from exc


async def _run_async(call):
    from ..engine.errors import LowVRAMError

    try:
        return await call()
    except LowVRAMError as exc:
        raise PackError(str(exc)) from exc


def to_comfy_node(node: type[Node], io) -> type:
    """``node`` as an ``io.ComfyNode`` subclass named like it (the class id stays ``schema.node_id``)."""

    def define_schema(cls):
        return to_io_schema(io, node.define_schema())

    def _to_io(out):
        out = normalize_output(out)
        return io.NodeOutput(*out.args, ui=out.ui)

    if inspect.iscoroutinefunction(node.execute):
        async def execute(cls, **kwargs):
            return _to_io(await _run_async(lambda: node.PREPARE_CLASS_CLONE(cls.hidden).execute(**kwargs)))
    else:
        def execute(cls, **kwargs):
            return _to_io(_run(lambda: node.PREPARE_CLASS_CLONE(cls.hidden).execute(**kwargs)))

    body = {"define_schema": classmethod(define_schema), "execute": classmethod(execute),
            "__doc__": node.__doc__, "__module__": node.__module__, "PACK_NODE": node}
    for hook in ("validate_inputs", "fingerprint_inputs"):
        if overrides(node, hook):
            def call(cls, __hook=hook, **kwargs):
                return call_with_accepted(getattr(node.PREPARE_CLASS_CLONE(cls.hidden), __hook), kwargs)
            # ComfyUI reads the hook's argspec: with **kwargs it skips its own type and range checks of every
            # input and files a failed check once per input (17 copies of one message on Cache Text Embeds).
            # The node's own parameters, shown as the wrapper's, keep both as ComfyUI means them.
            own = inspect.signature(getattr(node, hook))
            call.__signature__ = own.replace(parameters=[
                inspect.Parameter("cls", inspect.Parameter.POSITIONAL_OR_KEYWORD), *own.parameters.values()])
            body[hook] = classmethod(call)
    return type(node.__name__, (io.ComfyNode,), body)


def comfy_extension(nodes: list[type[Node]]):
    """The ``ComfyExtension`` that ``comfy_entrypoint`` returns: one V3 class per pack node."""
    from comfy_api.latest import ComfyExtension, io  # type: ignore[import-not-found]

    classes = [to_comfy_node(n, io) for n in nodes]

    class LowVRAMLoRAExtension(ComfyExtension):
        async def on_load(self):
            from .model_traits import register_routes

            register_routes()  # which inputs apply to the loaded model (web/lowvram_lora.js hides the rest)

        async def get_node_list(self):
            return list(classes)

    return LowVRAMLoRAExtension()
