"""A port of how ComfyUI's ``GET /object_info`` describes a node class: a classic (V1) one field by field,
a V3 one (our nodes, nodes/schema.py) by its ``GET_NODE_INFO_V1`` as ComfyUI's ``node_info`` does.

Ported from ComfyUI ``server.py``, ``PromptServer.__init__`` -> ``node_info(node_class)``
and the ``/object_info`` route, at Comfy-Org/ComfyUI commit
002c3fb9a504255ccb3edb668c08b8f56e63d14a (the older comfyanonymous/ComfyUI
005f3ba4aefab4d69f63a3188d2caf069e9c3fed has the same core fields, without
``is_input_list``, ``has_intermediate_output``, ``search_aliases`` and
``essentials_category``). The module path ComfyUI reports comes from
``nodes.load_custom_node``, which stamps every class of a pack with
``RELATIVE_PYTHON_MODULE = "custom_nodes.<folder name>"``.

What the frontend and comfy-cli see is this dict after ``web.json_response``,
i.e. ``json.dumps``: tuples become lists and non-JSON values fail the request,
so :func:`object_info` returns the JSON round trip. A node whose description
raises is logged and left out of the answer, as ComfyUI does.

Used by `lowvram-lora serve` (host/serve.py) for its /object_info, and by the tests (ComfyUI itself is not
installable in CI).
"""
from __future__ import annotations

import json
import logging
import traceback
from typing import Any, Mapping

#: Where README.md tells users to put the pack: ``ComfyUI/custom_nodes/lowvram-lora``.
PACK_MODULE = "custom_nodes.lowvram-lora"


def node_info(node_class: str, node_class_mappings: Mapping[str, type],
              node_display_name_mappings: Mapping[str, str],
              relative_python_module: str | None = PACK_MODULE) -> dict[str, Any]:
    """ComfyUI's ``node_info`` for one class, before JSON encoding.

    ``relative_python_module`` plays the part of the ``RELATIVE_PYTHON_MODULE``
    attribute ComfyUI's loader sets on the class (``None``: use the class's own
    attribute, else ``"nodes"``, as ``server.py`` does).
    """
    obj_class = node_class_mappings[node_class]
    if hasattr(obj_class, "GET_NODE_INFO_V1"):
        # V3 nodes (ComfyUI's io.ComfyNode, and ours: nodes/schema.py) describe themselves from their schema
        # (``asdict(schema.get_v1_info(cls))``), with the module the loader stamped on the class.
        info = obj_class.GET_NODE_INFO_V1()
        if relative_python_module is not None:
            info["python_module"] = relative_python_module
        return info
    info: dict[str, Any] = {}
    info['input'] = obj_class.INPUT_TYPES()
    info['input_order'] = {key: list(value.keys()) for (key, value) in obj_class.INPUT_TYPES().items()}
    info['is_input_list'] = getattr(obj_class, "INPUT_IS_LIST", False)
    info['output'] = obj_class.RETURN_TYPES
    info['output_is_list'] = obj_class.OUTPUT_IS_LIST if hasattr(obj_class, 'OUTPUT_IS_LIST') else [False] * len(obj_class.RETURN_TYPES)
    info['output_name'] = obj_class.RETURN_NAMES if hasattr(obj_class, 'RETURN_NAMES') else info['output']
    info['name'] = node_class
    info['display_name'] = node_display_name_mappings[node_class] if node_class in node_display_name_mappings.keys() else node_class
    info['description'] = obj_class.DESCRIPTION if hasattr(obj_class, 'DESCRIPTION') else ''
    if relative_python_module is None:
        info['python_module'] = getattr(obj_class, "RELATIVE_PYTHON_MODULE", "nodes")
    else:
        info['python_module'] = relative_python_module
    info['category'] = 'sd'
    if hasattr(obj_class, 'OUTPUT_NODE') and obj_class.OUTPUT_NODE == True:  # noqa: E712 (as in ComfyUI)
        info['output_node'] = True
    else:
        info['output_node'] = False

    if hasattr(obj_class, 'HAS_INTERMEDIATE_OUTPUT') and obj_class.HAS_INTERMEDIATE_OUTPUT == True:  # noqa: E712
        info['has_intermediate_output'] = True
    else:
        info['has_intermediate_output'] = False

    if hasattr(obj_class, 'CATEGORY'):
        info['category'] = obj_class.CATEGORY

    if hasattr(obj_class, 'OUTPUT_TOOLTIPS'):
        info['output_tooltips'] = obj_class.OUTPUT_TOOLTIPS

    if getattr(obj_class, "DEPRECATED", False):
        info['deprecated'] = True
    if getattr(obj_class, "EXPERIMENTAL", False):
        info['experimental'] = True
    if getattr(obj_class, "DEV_ONLY", False):
        info['dev_only'] = True

    if hasattr(obj_class, 'API_NODE'):
        info['api_node'] = obj_class.API_NODE

    info['search_aliases'] = getattr(obj_class, 'SEARCH_ALIASES', [])

    if hasattr(obj_class, 'ESSENTIALS_CATEGORY'):
        info['essentials_category'] = obj_class.ESSENTIALS_CATEGORY

    return info


def object_info(node_class_mappings: Mapping[str, type], node_display_name_mappings: Mapping[str, str],
                relative_python_module: str | None = PACK_MODULE,
                errors: list[str] | None = None) -> dict[str, Any]:
    """The body of ``GET /object_info`` as a client decodes it.

    Like the route, a class whose ``node_info`` raises is logged and skipped; its
    name and traceback are appended to ``errors`` when given. The JSON round trip
    is what ``web.json_response`` (``json.dumps``) puts on the wire; a value it
    cannot encode raises TypeError here, where ComfyUI answers HTTP 500.
    """
    out = {}
    for x in node_class_mappings:
        try:
            out[x] = node_info(x, node_class_mappings, node_display_name_mappings, relative_python_module)
        except Exception:
            logging.error(f"[ERROR] An error occurred while retrieving information for the '{x}' node.")
            logging.error(traceback.format_exc())
            if errors is not None:
                errors.append(f"{x}: {traceback.format_exc()}")
    # A value json.dumps cannot encode fails the whole response (HTTP 500), not one node.
    return json.loads(json.dumps(out))
