"""What the route groups of ``lowvram-lora serve`` share: the API's limits and defaults, the request checks (same
origin, paths kept inside their folder, JSON bodies) and ``Routes``, which registers a handler at a path with and
without the ``/api`` prefix, as ComfyUI's routes answer."""
from __future__ import annotations

import json
import os
import sys
import traceback
import urllib.parse
from pathlib import Path
from typing import Any

MAX_BODY_BYTES = 20 << 20
WS_MAX_MESSAGE_BYTES = 1 << 20
FEATURE_FLAGS = {"supports_preview_metadata": True, "max_upload_size": MAX_BODY_BYTES}  # comfy_api/feature_flags.py
#: The oldest frontend serve works with (the extras' lower bound; tests/test_host_jobs.py checks they agree).
#: Reported as /system_stats' required_frontend_version: an older frontend shows ComfyUI's "outdated" warning.
MIN_FRONTEND_VERSION = "1.27.10"
#: The newest frontend checked in the browser under serve (tests/comfyui/editor_queue.py: the queue panel shows the
#: running job, no console errors; docs/screenshots/issue28-serve158/). A newer one is served, with a notice.
NEWEST_CHECKED_FRONTEND = "1.58.1"
#: Settings serve answers while the user has not set them. The frontend asks api.comfy.org about ComfyUI releases
#: for the version /system_stats reports; serve is no ComfyUI (its "lowvram-lora ... (serve)" is no release),
#: so the answer could only announce updates that do not apply, and offline it logs two console errors.
SETTING_DEFAULTS = {"Comfy.Notification.ShowVersionUpdates": False}
#: User files the editor loads on every start (index.html links both user.css; the legacy node-template manager
#: reads comfy.templates.json): while absent, serve answers what an empty one means. ComfyUI answers 404, which the
#: frontend handles but the browser logs as a console error on every page load.
EDITOR_USERDATA_DEFAULTS = {"user.css": ("text/css", ""), "comfy.templates.json": ("application/json", "[]")}
PACK = "lowvram-lora"
WEB_DIR = Path(__file__).resolve().parent.parent / "web"
SERVE_WEB_DIR = Path(__file__).resolve().parent / "serve_web"  # extensions only this server loads
WORKFLOWS_DIR = Path(__file__).resolve().parent.parent / "example_workflows"  # = templates.WORKFLOWS_DIR


class BadRequest(Exception):
    """A malformed request: answered with HTTP 400 and this message (never a traceback)."""


#: Methods that read only. Every other one (POST, PUT, PATCH, DELETE) changes state, and so does opening the
#: websocket (a GET, but not bound by CORS: a page of any site may open one and read every message).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def _host_port(netloc: str, scheme: str) -> tuple[str, int | None] | None:
    """(lower-case host, port; the scheme's default when absent) of ``host[:port]``, or None if unparsable."""
    try:
        parts = urllib.parse.urlsplit("//" + netloc)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not host:
        return None
    return host.lower(), port if port is not None else _DEFAULT_PORTS.get(scheme)


def foreign_origin(method: str, headers, scheme: str = "http", websocket: bool = False) -> str | None:
    """Why a request comes from another site's page and must be refused (HTTP 403), or None.

    Browsers send any page's POST to 127.0.0.1 (a ``text/plain`` body needs no CORS preflight), so without
    this a page on any site could queue prompts, write workflow files or settings, or stop a run. As
    ComfyUI's ``create_origin_only_middleware`` (server.py) does, a request whose ``Origin`` names another
    host than its ``Host`` header is refused; unlike it, the check holds on every address we listen on (not
    only loopback), the ports are compared too (another local server's page is another site), and a
    state-changing request (``SAFE_METHODS``, the websocket) is also refused when the browser marks it
    ``Sec-Fetch-Site: cross-site`` or sends ``Origin: null`` (a sandboxed page, a local file). Clients that
    are not browsers (comfy-cli, scripts) send no ``Origin`` and pass."""
    changes_state = websocket or method.upper() not in SAFE_METHODS
    if changes_state and headers.get("Sec-Fetch-Site", "").lower() == "cross-site":
        return "the browser marks it as sent by another site's page (Sec-Fetch-Site: cross-site)"
    origin = headers.get("Origin")
    if origin is None:
        return None
    if origin.strip().lower() == "null":
        return "its Origin is 'null' (a sandboxed page or a local file)" if changes_state else None
    parsed = urllib.parse.urlsplit(origin.strip())
    mine = _host_port(headers.get("Host", ""), scheme)
    theirs = _host_port(parsed.netloc, parsed.scheme.lower())
    if theirs is None or mine is None or theirs != mine:
        return f"its Origin {origin!r} is not this server ({headers.get('Host', 'no Host header')})"
    return None


def inside(root: Path, relative: str) -> Path:
    """``root/relative``, refused unless it stays inside ``root`` after resolving symlinks."""
    if not relative or "\x00" in relative or os.path.isabs(relative) or relative.startswith(("/", "\\")):
        raise BadRequest(f"bad path {relative!r}")
    if any(part == ".." for part in Path(relative).parts):
        raise BadRequest(f"bad path {relative!r}: '..' is not allowed")
    root = root.resolve()
    target = (root / relative).resolve()
    if target != root and root not in target.parents:
        raise BadRequest(f"bad path {relative!r}: outside its folder")
    return target


async def read_json(request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"the request body is not valid JSON ({exc})") from None


def object_body(data, route: str, shape: str) -> dict:
    if not isinstance(data, dict):
        raise BadRequest(f"{route} takes a JSON object ({shape}), not {type(data).__name__}")
    return data


def id_list(data: dict, route: str) -> list[str]:
    ids = data.get("delete", [])
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise BadRequest(f"{route}: \"delete\" must be a list of prompt ids (strings), not {ids!r}"[:300])
    return ids


class Routes:
    """An aiohttp route table that route groups add to: ``both`` registers a handler at ``path`` and at
    ``/api`` + ``path`` (ComfyUI's routes answer both), ``only`` at exactly ``path``."""

    def __init__(self):
        from aiohttp import web

        self.table = web.RouteTableDef()

    def both(self, method: str, path: str):
        def deco(fn):
            self.table.route(method, path)(fn)
            self.table.route(method, "/api" + path)(fn)
            return fn
        return deco

    def only(self, method: str, path: str):
        return self.table.route(method, path)


def middlewares() -> list:
    """Every request passes ``same_origin_only`` (``foreign_origin``), then ``errors`` (a ``BadRequest`` is a 400
    with its message; anything else a 500 with a one-line message, the traceback on the console)."""
    from aiohttp import web

    @web.middleware
    async def same_origin_only(request, handler):
        why = foreign_origin(request.method, request.headers, request.scheme,
                             websocket=request.headers.get("Upgrade", "").lower() == "websocket")
        if why is not None:
            print(f"[lowvram-lora serve] refused {request.method} {request.path}: {why}", file=sys.stderr,
                  flush=True)
            return web.json_response(
                {"error": f"refused: {why}. lowvram-lora serve only takes requests from its own editor page "
                          f"(open it at http://{request.headers.get('Host', '127.0.0.1:8188')}/) and from "
                          f"clients that are not browsers"}, status=403)
        return await handler(request)

    @web.middleware
    async def errors(request, handler):
        try:
            return await handler(request)
        except BadRequest as exc:
            return web.json_response({"error": str(exc)}, status=400)
        except web.HTTPException:
            raise
        except Exception as exc:  # never a traceback to the client; the console has it
            traceback.print_exc()
            return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=500)

    return [same_origin_only, errors]
