"""Settings that moved from a pack node to a small options node plugged into it (issue 43): the one home of how
such a node takes them.

A node whose rarely changed settings moved (Train LoRA to Training Options and Preview Options, Offload Config to
Offload Tuning) takes each options node in an optional socket. Unplugged, the options node's defaults apply, which
are the values the node used before the move, so a saved workflow behaves as before. A workflow saved while the
settings were the node's own widgets still gives them to the node by name:

- UI format (values by position): the node declares the old order (``LEGACY_WIDGETS``, told by
  ``is_legacy_layout``); the headless runner reads such a file by those names (host/workflow.py) and the editor's
  extension (web/moved_settings.js, the same lists) adds the options node with the file's values;
- API format (by name): ComfyUI passes a node only its declared inputs, so the node reads the moved ones from the
  whole prompt (its hidden ``prompt``; :func:`legacy_values`), and the host checks them as the options node would
  (``Node.moved_inputs``); ``--set ID.name`` lands on the plugged options node.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional


def defaults(node: type) -> dict:
    """The options node's widget defaults by name: what its socket left unplugged means."""
    return {i.id: i.default for i in node.GET_SCHEMA().inputs}


def option_values(node: type, values: dict) -> dict:
    """Every setting of the options node by name: the given values over the defaults. A name the node does not have
    is a TypeError naming the ones it has (a Python caller's typo must not pass as a default)."""
    base = defaults(node)
    unknown = sorted(set(values) - set(base))
    if unknown:
        raise TypeError(f"{node.GET_SCHEMA().display_name} has no setting {', '.join(unknown)}; it has "
                        f"{', '.join(base)}")
    return {**base, **values}


def moved_inputs(option_nodes: Mapping[str, type]) -> dict:
    """``Node.moved_inputs`` of a node that takes these options nodes (socket -> node): name -> the options node's
    ``Input``."""
    return {i.id: i for node in option_nodes.values() for i in node.GET_SCHEMA().inputs}


def legacy_values(cls: type, prompt, node_id) -> dict:
    """The moved settings an API-format prompt still gives node ``node_id`` by name (a workflow saved before they
    moved), read from the whole prompt (the node's hidden ``prompt``): ComfyUI passes a node only its declared
    inputs. Links are not settings: skipped."""
    inputs = ((prompt or {}).get(str(node_id)) or {}).get("inputs") or {}
    moved = cls.moved_inputs()
    return {k: v for k, v in inputs.items() if k in moved and not isinstance(v, list)}


def merge(owner: str, option_nodes: Mapping[str, type], plugged: Mapping[str, Optional[dict]], legacy: dict,
          log: Optional[Callable[[str], None]] = None) -> dict:
    """Every moved setting of node ``owner`` by name: a value given to it by name (``legacy``: an old workflow, or
    a script that sets it there) over the plugged options node's values, over that node's defaults. ``log`` is told
    when a by-name value overrides a plugged node's, so the graph's two answers are seen. A name no options node
    has is a TypeError."""
    out, legacy = {}, dict(legacy)
    for socket, node in option_nodes.items():
        given = {k: legacy.pop(k) for k in list(legacy) if k in defaults(node)}
        base = plugged.get(socket) or {}
        for k in sorted(k for k, v in given.items() if k in base and base[k] != v and log is not None):
            log(f"{k}={given[k]!r} given to {owner} by name overrides the plugged "
                f"{node.GET_SCHEMA().display_name} node's {base[k]!r}")
        out |= option_values(node, {**base, **given})
    if legacy:
        raise TypeError(f"{owner} has no input {', '.join(sorted(legacy))}")
    return out
