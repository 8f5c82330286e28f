"""``lowvram-lora serve``: the official ComfyUI editor (comfyui-frontend-package) for our nodes, without ComfyUI.

The editor is ComfyUI's own frontend, served from the installed ``comfyui_frontend_package`` (its
``static/`` folder, found with importlib.resources, as ComfyUI's ``app/frontend_management.py`` does).
This module implements the part of ComfyUI's HTTP and websocket API the editor and comfy-cli use,
backed by our node classes and the executor ``lowvram-lora run`` uses (host/executor.py). Routes and
message shapes follow ComfyUI 0.3.64 (``server.py``, ``app/user_manager.py``, ``app/app_settings.py``,
``app/custom_node_manager.py``, ``execution.py``, ``main.py``), which serves frontend 1.27, the oldest the
``editor`` extra accepts; every route answers with and without the ``/api`` prefix, as ComfyUI's do. Newer
frontends (1.5x; 1.58.1 checked: NEWEST_CHECKED_FRONTEND) read the queue and history only from ComfyUI 0.33's
``/api/jobs`` (host/jobs.py) and ask for ``/global_subgraphs``; both are here too, so 1.27 to 1.58 work. The
startup line names the installed frontend and says when it lies outside that range.

- One prompt runs at a time, in a worker thread (the event loop stays free for the websocket);
  ``POST /interrupt`` stops it at the next step (the engine saves its resumable state).
- Safety: binds 127.0.0.1 unless told otherwise; a request from another site's page is refused with
  HTTP 403 (``foreign_origin``: the check of ComfyUI's ``create_origin_only_middleware``, applied whatever
  address we listen on); ``/view`` and ``/userdata`` resolve every path inside their folder (no ``..``, no
  absolute paths, no symlink escape); request bodies are limited to ``MAX_BODY_BYTES``; a malformed body or
  query gets HTTP 400 with a message, never a traceback.
- Workflows saved in the editor's sidebar persist under ``<output>/../user/default/workflows``.
"""
from __future__ import annotations

import asyncio
import io
import json
import os
import platform
import struct
import sys
import threading
import time
import traceback
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

from ..engine.fileio import atomic_write, write_json_atomic

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


class Interrupted(Exception):
    """The editor's stop button (POST /interrupt), raised inside the running node."""


class BadRequest(Exception):
    pass


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


EDITOR_MISSING = ("lowvram-lora serve needs the editor, which is not installed ({missing}): "
                  "pip install 'lowvram-lora[editor]' (comfyui-frontend-package and aiohttp)")


def require_editor() -> None:
    """A one-line SystemExit naming the install command when aiohttp or the frontend package is missing."""
    import importlib

    missing = []
    for name in ("aiohttp", "comfyui_frontend_package"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise SystemExit(EDITOR_MISSING.format(missing=", ".join(missing)))


def frontend_static_dir() -> Path:
    try:
        import comfyui_frontend_package
    except ImportError:
        raise SystemExit(EDITOR_MISSING.format(missing="comfyui_frontend_package")) from None
    from importlib.resources import files

    return Path(str(files(comfyui_frontend_package) / "static"))


def frontend_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("comfyui-frontend-package")
    except PackageNotFoundError:
        return None


def frontend_notice(installed: str | None) -> str | None:
    """A line for the console when the installed frontend lies outside what serve was checked with, else None."""
    try:
        from packaging.version import InvalidVersion, Version  # there with transformers (its dependency)
    except ImportError:
        return None
    try:
        v = Version(installed or "")
    except InvalidVersion:
        return None
    if v < Version(MIN_FRONTEND_VERSION):
        return (f"comfyui-frontend-package {installed} is older than {MIN_FRONTEND_VERSION}, the oldest serve works "
                f"with: pip install 'comfyui-frontend-package>={MIN_FRONTEND_VERSION}'")
    if v > Version(NEWEST_CHECKED_FRONTEND):
        return (f"comfyui-frontend-package {installed} is newer than {NEWEST_CHECKED_FRONTEND}, the newest checked "
                f"with serve; if the editor misbehaves, pip install 'comfyui-frontend-package=={NEWEST_CHECKED_FRONTEND}'")
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


class PromptHost:
    """The server side of one ``lowvram-lora serve``: queue, history, websocket clients."""

    def __init__(self, mappings, display, output_dir: Path, user_dir: Path):
        self.mappings, self.display = mappings, display
        self.output_dir, self.user_dir = output_dir, user_dir
        self.sockets: dict[str, Any] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pending: list[dict] = []
        self.running: dict | None = None
        self.history: dict[str, dict] = {}
        self.number = 0
        self.wake = threading.Event()
        self.interrupt_flag = threading.Event()
        self.lock = threading.Lock()
        self.client_id: str | None = None
        self.node_states: dict[str, dict] = {}  # the running prompt's nodes (progress_state)

    # -- messages (any thread) ------------------------------------------------------------
    def send(self, kind: str, data: Any, sid: str | None = None) -> None:
        if self.loop is None or self.loop.is_closed():
            return
        coro = self._send(kind, data, sid)
        try:
            self.loop.call_soon_threadsafe(asyncio.ensure_future, coro)
        except RuntimeError:  # the server is shutting down: nobody to tell
            coro.close()

    async def _send(self, kind, data, sid=None) -> None:
        targets = [self.sockets[sid]] if sid in self.sockets else list(self.sockets.values())
        for ws in targets:
            try:
                if isinstance(data, (bytes, bytearray)):
                    await ws.send_bytes(data)
                else:
                    await ws.send_json({"type": kind, "data": data})
            except Exception:  # a closed socket: its handler cleans up
                pass

    def queue_info(self) -> dict:
        return {"exec_info": {"queue_remaining": len(self.pending) + (1 if self.running else 0)}}

    def send_status(self) -> None:
        self.send("status", {"status": self.queue_info()})

    # -- the nodes' progress hook (nodes/progress.py HostCallback) ----------------------------
    def progress(self, node_id, value: int, total: int) -> None:
        pid = self.running["prompt_id"] if self.running else None
        self.send("progress", {"value": value, "max": total, "prompt_id": pid, "node": node_id}, self.client_id)
        self.node_state(node_id, "running", value, total)

    def node_state(self, node_id, state: str, value: float | None = None, total: float | None = None) -> None:
        """``progress_state`` (comfy_execution/progress.py): every started node's value, max and state. The
        editor takes the running node (where previews go) from it."""
        if self.running is None or node_id is None:
            return
        pid = self.running["prompt_id"]
        entry = self.node_states.setdefault(str(node_id), {"value": 0, "max": 1})
        entry.update(state=state, node_id=str(node_id), prompt_id=pid, display_node_id=str(node_id),
                     parent_node_id=None, real_node_id=str(node_id))
        if value is not None:
            entry["value"], entry["max"] = value, total
        elif state == "finished":
            entry["value"] = entry["max"]
        self.send("progress_state", {"prompt_id": pid, "nodes": {k: dict(v) for k, v in self.node_states.items()}},
                  self.client_id)

    def text(self, node_id, text: str) -> None:
        # Binary event 3 (PROGRESS_TEXT, ComfyUI protocol.py): u32 type, u32 len + node id, text.
        nid = str(node_id or "").encode()
        self.send("progress_text", struct.pack(">I", 3) + struct.pack(">I", len(nid)) + nid + text.encode())

    def event(self, name: str, data: dict) -> None:
        self.send(name, data)

    def preview(self, node_id, image) -> None:
        # Binary event 4 (PREVIEW_IMAGE_WITH_METADATA, server.py send_image_with_metadata): u32 type, u32 length +
        # JSON metadata naming the node, the PNG bytes. ComfyUI sends this form to clients that advertise
        # supports_preview_metadata (the frontend does, and so do we in feature_flags).
        buf = io.BytesIO()
        image = image.copy()
        image.thumbnail((1024, 1024))
        image.save(buf, format="PNG", compress_level=1)
        pid = self.running["prompt_id"] if self.running else None
        meta = json.dumps({"node_id": str(node_id), "prompt_id": pid, "display_node_id": str(node_id),
                           "parent_node_id": None, "real_node_id": str(node_id), "image_type": "image/png"}).encode()
        self.send("preview", struct.pack(">I", 4) + struct.pack(">I", len(meta)) + meta + buf.getvalue(),
                  self.client_id)

    def interrupt_check(self) -> None:
        if self.interrupt_flag.is_set():
            raise Interrupted("interrupted by the user")

    # -- the queue -----------------------------------------------------------------------------
    def enqueue(self, prompt: dict, client_id: str | None, extra: dict) -> dict:
        from .workflow import validate_graph

        validate_graph(prompt, self.mappings)
        with self.lock:
            self.number += 1
            # As ComfyUI's POST /prompt: the client id and the time queued (ms) go into extra_data; /api/jobs
            # reports create_time, which the newer frontends require.
            extra = {**extra, **({"client_id": client_id} if client_id is not None else {}),
                     "create_time": int(time.time() * 1000)}
            item = {"prompt_id": str(uuid.uuid4()), "number": self.number, "prompt": prompt, "client_id": client_id,
                    "extra": extra, "outputs": [k for k, v in prompt.items()
                                                if getattr(self.mappings[v["class_type"]], "OUTPUT_NODE", False)]}
            self.pending.append(item)
        self.wake.set()
        self.send_status()
        return item

    # -- jobs (host/jobs.py) -------------------------------------------------------------------
    @staticmethod
    def entry(item: dict) -> tuple:
        """A queue item in ComfyUI's form: (number, prompt_id, prompt, extra_data, outputs_to_execute)."""
        return item["number"], item["prompt_id"], item["prompt"], item["extra"], item["outputs"]

    def snapshot(self) -> tuple[list, list, dict]:
        """(running, pending, history) in ComfyUI's forms, taken at one moment."""
        with self.lock:
            running = [self.entry(self.running)] if self.running else []
            return running, [self.entry(i) for i in self.pending], dict(self.history)

    def dequeue(self, prompt_id: str) -> bool:
        with self.lock:
            kept = [i for i in self.pending if i["prompt_id"] != prompt_id]
            removed, self.pending = len(kept) != len(self.pending), kept
        if removed:
            self.send_status()
        return removed

    def interrupt_if_running(self, prompt_id: str) -> bool:
        """Stop the running prompt only if it is this one (never one that started since the caller looked)."""
        with self.lock:
            if self.running is None or self.running["prompt_id"] != prompt_id:
                return False
            self.interrupt_flag.set()
            return True

    def worker(self) -> None:
        from ..nodes.progress import set_host

        set_host(self)
        while True:
            self.wake.wait()
            with self.lock:
                if not self.pending:
                    self.wake.clear()
                    continue
                self.running = self.pending.pop(0)
            self.interrupt_flag.clear()
            self.send_status()
            self._execute(self.running)
            with self.lock:
                self.running = None
            self.send_status()

    def _execute(self, item: dict) -> None:
        from .executor import NodeExecutionError, execute_graph

        pid, sid = item["prompt_id"], item["client_id"]
        self.client_id = sid
        self.node_states = {}
        messages: list = []
        outputs: dict[str, dict] = {}

        def note(kind, data):
            data = {**data, "timestamp": int(time.time() * 1000)}
            messages.append([kind, data])
            self.send(kind, data, sid)

        def on_node(event: str, node_id: str, ui):
            if event == "executing":
                self.node_state(node_id, "running", 0, 1)
                self.send("executing", {"node": node_id, "display_node": node_id, "prompt_id": pid}, sid)
                return
            self.node_state(node_id, "finished")
            if ui is not None:
                outputs[node_id] = ui
                self.send("executed", {"node": node_id, "display_node": node_id, "output": ui, "prompt_id": pid}, sid)

        note("execution_start", {"prompt_id": pid})
        note("execution_cached", {"nodes": [], "prompt_id": pid})
        status = "success"
        try:
            execute_graph(item["prompt"], self.mappings, progress=False, on_node=on_node)
            note("execution_success", {"prompt_id": pid})
        except NodeExecutionError as exc:
            node = item["prompt"].get(exc.node_id, {})
            base = {"prompt_id": pid, "node_id": exc.node_id, "node_type": node.get("class_type"),
                    "executed": list(outputs)}
            if isinstance(exc.original, (Interrupted, KeyboardInterrupt)):
                status = "error"
                note("execution_interrupted", base)
            else:
                status = "error"
                note("execution_error", {**base, "exception_message": str(exc.original),
                                         "exception_type": type(exc.original).__name__,
                                         "traceback": traceback.format_exception(exc.original),
                                         "current_inputs": {}, "current_outputs": {}})
                print(f"[lowvram-lora serve] {exc}", file=sys.stderr, flush=True)
        except Exception as exc:  # a graph the executor refused
            status = "error"
            # node_id/node_type "" rather than null: the newer frontends' job schema wants strings there.
            note("execution_error", {"prompt_id": pid, "node_id": "", "node_type": "", "executed": [],
                                     "exception_message": str(exc), "exception_type": type(exc).__name__,
                                     "traceback": traceback.format_exception(exc),
                                     "current_inputs": {}, "current_outputs": {}})
        # History first, then "executing null", as ComfyUI's prompt worker does (main.py): a client that asks
        # for the history as soon as it hears the prompt ended must find it.
        self.history[pid] = {
            "prompt": [item["number"], pid, item["prompt"], item["extra"], item["outputs"]],
            "outputs": outputs,
            "status": {"status_str": status, "completed": status == "success", "messages": messages},
            "meta": {k: {"node_id": k, "display_node": k} for k in outputs},
        }
        self.send("executing", {"node": None, "prompt_id": pid}, sid)


def build_app(host: PromptHost, static: Path):
    import aiohttp
    from aiohttp import web

    from . import jobs
    from .object_info import object_info

    routes = web.RouteTableDef()

    async def body(request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
            raise BadRequest(f"the request body is not valid JSON ({exc})") from None

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

    def object_body(data, route: str, shape: str) -> dict:
        if not isinstance(data, dict):
            raise BadRequest(f"{route} takes a JSON object ({shape}), not {type(data).__name__}")
        return data

    def id_list(data: dict, route: str) -> list[str]:
        ids = data.get("delete", [])
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise BadRequest(f"{route}: \"delete\" must be a list of prompt ids (strings), not {ids!r}"[:300])
        return ids

    def both(method, path):
        def deco(fn):
            routes.route(method, path)(fn)
            routes.route(method, "/api" + path)(fn)
            return fn
        return deco

    @routes.get("/")
    async def index(request):
        resp = web.FileResponse(static / "index.html")
        resp.headers["Cache-Control"] = "no-cache"
        return resp

    @routes.get("/user.css")
    async def root_user_css(request):
        # index.html links ./user.css (a leftover of ComfyUI's old web folder; ComfyUI answers 404) besides
        # api/userdata/user.css, which carries the user's own stylesheet.
        return web.Response(text="", content_type="text/css")

    @both("GET", "/ws")
    async def websocket(request):
        # Messages from the editor are small (feature flags); a larger one closes the socket (1009).
        ws = web.WebSocketResponse(max_msg_size=WS_MAX_MESSAGE_BYTES)
        await ws.prepare(request)
        sid = request.rel_url.query.get("clientId") or uuid.uuid4().hex
        host.sockets[sid] = ws
        try:
            await ws.send_json({"type": "status", "data": {"status": host.queue_info(), "sid": sid}})
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.TEXT:  # binary frames, errors: nothing we use
                    continue
                try:
                    data = json.loads(msg.data)
                except ValueError:  # not JSON: ignored, as ComfyUI does
                    continue
                if isinstance(data, dict) and data.get("type") == "feature_flags":  # comfy_api/feature_flags.py
                    await ws.send_json({"type": "feature_flags", "data": FEATURE_FLAGS})
        except (ConnectionError, asyncio.CancelledError):  # the client went away mid-send
            pass
        finally:
            host.sockets.pop(sid, None)
        return ws

    @both("GET", "/users")
    async def users(request):
        return web.json_response({"storage": "server", "migrated": True})

    settings_file = host.user_dir / "comfy.settings.json"

    def read_settings() -> dict:
        try:
            return json.loads(settings_file.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    @both("GET", "/settings")
    async def get_settings(request):
        return web.json_response({**SETTING_DEFAULTS, **read_settings()})  # defaults are never written

    @both("GET", "/settings/{id}")
    async def get_setting(request):
        return web.json_response({**SETTING_DEFAULTS, **read_settings()}.get(request.match_info["id"]))

    @both("POST", "/settings")
    async def post_settings(request):
        new = await body(request)
        if not isinstance(new, dict):
            raise BadRequest("settings must be a JSON object")
        write_json_atomic(settings_file, {**read_settings(), **new}, "the editor settings")
        return web.Response(status=200)

    @both("POST", "/settings/{id}")
    async def post_setting(request):
        write_json_atomic(settings_file, {**read_settings(), request.match_info["id"]: await body(request)},
                          "the editor settings")
        return web.Response(status=200)

    @both("GET", "/userdata")
    async def list_userdata(request):
        folder = inside(host.user_dir, request.query.get("dir", ""))
        if not folder.is_dir():
            return web.json_response({"error": "no such folder"}, status=404)
        recurse = request.query.get("recurse", "").lower() == "true"
        full = request.query.get("full_info", "").lower() == "true"
        found = sorted(p for p in (folder.rglob("*") if recurse else folder.iterdir()) if p.is_file())
        out = []
        for p in found:
            rel = p.relative_to(folder).as_posix()
            out.append({"path": rel, "size": p.stat().st_size, "modified": p.stat().st_mtime} if full else rel)
        return web.json_response(out)

    @both("GET", "/userdata/{file}")
    async def get_userdata(request):
        path = inside(host.user_dir, request.match_info["file"])
        if not path.is_file():
            default = EDITOR_USERDATA_DEFAULTS.get(request.match_info["file"])
            if default is not None:
                return web.Response(text=default[1], content_type=default[0])
            return web.json_response({"error": "not found"}, status=404)
        return web.FileResponse(path)

    @both("POST", "/userdata/{file}")
    async def post_userdata(request):
        path = inside(host.user_dir, request.match_info["file"])
        if path.exists() and request.query.get("overwrite", "true").lower() == "false":
            return web.json_response({"error": "file exists"}, status=409)
        data = await request.read()
        with atomic_write(path, "a saved workflow") as tmp:
            Path(tmp).write_bytes(data)
        rel = path.relative_to(host.user_dir.resolve()).as_posix()
        if request.query.get("full_info", "").lower() == "true":
            return web.json_response({"path": rel, "size": path.stat().st_size, "modified": path.stat().st_mtime})
        return web.json_response(rel)

    @both("DELETE", "/userdata/{file}")
    async def delete_userdata(request):
        path = inside(host.user_dir, request.match_info["file"])
        if not path.is_file():
            return web.json_response({"error": "not found"}, status=404)
        path.unlink()
        return web.Response(status=204)

    @both("POST", "/userdata/{file}/move/{dest}")
    async def move_userdata(request):
        src = inside(host.user_dir, request.match_info["file"])
        dest = inside(host.user_dir, request.match_info["dest"])
        if not src.is_file():
            return web.json_response({"error": "not found"}, status=404)
        if dest.exists() and request.query.get("overwrite", "true").lower() == "false":
            return web.json_response({"error": "file exists"}, status=409)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dest)
        return web.json_response(dest.relative_to(host.user_dir.resolve()).as_posix())

    @both("GET", "/extensions")
    async def extensions(request):
        return web.json_response([f"/extensions/{PACK}/{p.name}" for p in sorted(WEB_DIR.glob("*.js"))]
                                 + [f"/extensions/{PACK}-serve/{p.name}" for p in sorted(SERVE_WEB_DIR.glob("*.js"))])

    @both("GET", "/object_info")
    async def get_object_info(request):
        return web.json_response(object_info(host.mappings, host.display))

    @both("GET", "/object_info/{node_class}")
    async def get_one_node(request):
        info = object_info(host.mappings, host.display)
        name = request.match_info["node_class"]
        return web.json_response({name: info[name]} if name in info else {})

    @both("GET", "/workflow_templates")
    async def templates(request):
        return web.json_response({PACK: sorted(p.stem for p in WORKFLOWS_DIR.glob("*.json"))})

    @both("GET", "/system_stats")
    async def system_stats(request):
        import torch

        from ..engine.version import VERSION

        devices = []
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                free, total = torch.cuda.mem_get_info(i)
                devices.append({"name": torch.cuda.get_device_name(i), "type": "cuda", "index": i, "vram_total": total,
                                "vram_free": free, "torch_vram_total": 0, "torch_vram_free": 0})
        else:
            devices.append({"name": "cpu", "type": "cpu", "index": None, "vram_total": 0, "vram_free": 0,
                            "torch_vram_total": 0, "torch_vram_free": 0})
        return web.json_response({"system": {
            "os": os.name, "python_version": sys.version, "embedded_python": False,
            "comfyui_version": f"lowvram-lora {VERSION} (serve)", "pytorch_version": torch.__version__,
            "argv": sys.argv, "ram_total": 0, "ram_free": 0, "required_frontend_version": MIN_FRONTEND_VERSION,
            "installed_templates_version": None, "required_templates_version": None, "comfy_package_versions": []},
            "devices": devices})

    for path, value in (("/embeddings", []), ("/models", []), ("/experiment/models", []), ("/i18n", {}),
                        ("/features", FEATURE_FLAGS)):
        async def fixed(request, value=value):
            return web.json_response(value)
        both("GET", path)(fixed)

    @routes.get("/templates/{name}")
    async def core_templates(request):
        # ComfyUI serves its core templates here (comfyui_workflow_templates); we have none, and the editor's
        # template store fails as a whole on a 404, so our pack's templates would not open either.
        if request.match_info["name"].startswith("index") and request.match_info["name"].endswith(".json"):
            return web.json_response([])
        return web.json_response({"error": "not found"}, status=404)

    @both("GET", "/models/{folder}")
    async def models_in(request):
        return web.json_response([])

    @both("GET", "/prompt")
    async def get_prompt(request):
        return web.json_response(host.queue_info())

    @both("POST", "/prompt")
    async def post_prompt(request):
        from .workflow import WorkflowError

        data = await body(request)
        if not isinstance(data, dict) or not isinstance(data.get("prompt"), dict):
            raise BadRequest("POST /prompt takes {\"prompt\": {node id: {class_type, inputs}}, \"client_id\": ...}")
        if not isinstance(data.get("client_id"), (str, type(None))):
            raise BadRequest("POST /prompt: client_id must be a string (the websocket's clientId)")
        if not isinstance(data.get("extra_data") or {}, dict):
            raise BadRequest("POST /prompt: extra_data must be a JSON object")
        try:
            item = host.enqueue(data["prompt"], data.get("client_id"), data.get("extra_data") or {})
        except WorkflowError as exc:
            return web.json_response({"error": {"type": "prompt_outputs_failed_validation", "message": str(exc),
                                                "details": str(exc), "extra_info": {}}, "node_errors": {}},
                                     status=400)
        return web.json_response({"prompt_id": item["prompt_id"], "number": item["number"], "node_errors": {}})

    def queue_entry(item):
        return list(host.entry(item))

    @both("GET", "/queue")
    async def get_queue(request):
        with host.lock:
            running = [queue_entry(host.running)] if host.running else []
            pending = [queue_entry(i) for i in host.pending]
        return web.json_response({"queue_running": running, "queue_pending": pending})

    @both("POST", "/queue")
    async def post_queue(request):
        data = object_body(await body(request), "POST /queue", '{"clear": true} or {"delete": [prompt ids]}')
        ids = id_list(data, "POST /queue")
        with host.lock:
            if data.get("clear"):
                host.pending.clear()
            for pid in ids:
                host.pending = [i for i in host.pending if i["prompt_id"] != pid]
        host.send_status()
        return web.Response(status=200)

    @both("GET", "/history")
    async def get_history(request):
        items = list(host.history.items())
        if request.query.get("max_items"):
            try:
                limit = int(request.query["max_items"])
            except ValueError:
                limit = -1
            if limit < 0:
                raise BadRequest(f"max_items={request.query['max_items']!r} must be a whole number >= 0")
            items = items[-limit:] if limit else []
        return web.json_response(dict(items))

    @both("GET", "/history/{prompt_id}")
    async def get_history_one(request):
        pid = request.match_info["prompt_id"]
        return web.json_response({pid: host.history[pid]} if pid in host.history else {})

    @both("POST", "/history")
    async def post_history(request):
        data = object_body(await body(request), "POST /history", '{"clear": true} or {"delete": [prompt ids]}')
        ids = id_list(data, "POST /history")
        if data.get("clear"):
            host.history.clear()
        for pid in ids:
            host.history.pop(pid, None)
        return web.Response(status=200)

    @both("POST", "/interrupt")
    async def interrupt(request):
        # Frontends >= 1.5x send {"prompt_id": ...}: stop that prompt only if it is the running one (ComfyUI 0.33).
        try:
            data = await request.json() if request.can_read_body else {}
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            data = {}
        prompt_id = data.get("prompt_id") if isinstance(data, dict) else None
        if prompt_id:
            host.interrupt_if_running(str(prompt_id))
        else:
            host.interrupt_flag.set()
        return web.Response(status=200)

    # -- ComfyUI 0.33's jobs API (host/jobs.py): the newer frontends' queue and history ------------------
    @routes.get("/api/jobs")
    async def list_jobs(request):
        try:
            args = jobs.parse_list_query(request.rel_url.query)
        except jobs.JobsQueryError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(jobs.list_reply(*host.snapshot(), **args))

    @routes.get("/api/jobs/{job_id}")
    async def get_job(request):
        job = jobs.find_job(request.match_info["job_id"], *host.snapshot())
        if job is None:
            return web.json_response({"error": "Job not found"}, status=404)
        return web.json_response(job)

    @routes.post("/api/jobs/{job_id}/cancel")
    async def cancel_job(request):
        return web.json_response({"cancelled": jobs.cancel(request.match_info["job_id"], host.interrupt_if_running,
                                                           host.dequeue)})

    @routes.post("/api/jobs/cancel")
    async def cancel_jobs(request):
        try:
            data = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            return web.json_response({"error": "Request body must be valid JSON"}, status=400)
        ids = data.get("job_ids") if isinstance(data, dict) else None
        if not isinstance(ids, list):
            return web.json_response({"error": "job_ids must be a list"}, status=400)
        invalid = [i if isinstance(i, str) else repr(i) for i in ids if not jobs.is_job_id(i)]
        if invalid:
            return web.json_response({"error": "job_ids contains invalid id(s)", "invalid_ids": invalid}, status=400)
        cancelled = [jobs.cancel(i, host.interrupt_if_running, host.dequeue) for i in ids]
        return web.json_response({"cancelled": any(cancelled)})

    @both("GET", "/global_subgraphs")
    async def global_subgraphs(request):
        return web.json_response({})  # ComfyUI lists custom nodes' and its blueprints' subgraphs; we have none

    @both("GET", "/global_subgraphs/{id}")
    async def global_subgraph(request):
        return web.json_response(None)  # ComfyUI's answer for an id it does not know

    @both("POST", "/free")
    async def free(request):
        return web.Response(status=200)

    @both("GET", "/view")
    async def view(request):
        from ..nodes.paths import input_dir, temp_dir

        kind = request.query.get("type", "output")
        roots = {"output": host.output_dir, "temp": temp_dir(), "input": input_dir()}
        if kind not in roots:
            raise BadRequest(f"type={kind!r} is not one of output, temp, input")
        name = request.query.get("filename", "")
        sub = request.query.get("subfolder", "")
        path = inside(roots[kind], f"{sub}/{name}" if sub else name)
        if not path.is_file():
            return web.json_response({"error": "not found"}, status=404)
        return web.FileResponse(path)

    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[same_origin_only, errors])
    app.add_routes(routes)
    app.router.add_static(f"/extensions/{PACK}", WEB_DIR)
    app.router.add_static(f"/extensions/{PACK}-serve", SERVE_WEB_DIR)
    # The template files and their thumbnails, as ComfyUI serves a pack's example workflows (server.py).
    app.router.add_static(f"/api/workflow_templates/{PACK}", WORKFLOWS_DIR)
    app.router.add_static("/", static)
    return app


def add_serve_parser(subparsers):
    p = subparsers.add_parser("serve", help="the ComfyUI editor for our nodes, without ComfyUI "
                                            "(pip install 'lowvram-lora[editor]')")
    p.add_argument("--port", type=int, default=8188)
    p.add_argument("--listen", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--models-dir", default="./models")
    p.add_argument("--output-dir", default="./output")
    p.add_argument("--user-dir", default="", help="where settings and saved workflows live (default: "
                                                  "<output-dir>/../user/default)")
    return p


def check_listen_address(listen: str, port: int) -> None:
    """A one-line SystemExit for a --port or --listen that cannot be bound (before anything starts)."""
    import socket

    if not 1 <= port <= 65535:
        raise SystemExit(f"--port {port} is not a TCP port: give one between 1 and 65535 (8188 is ComfyUI's)")
    try:
        socket.getaddrinfo(listen, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, ValueError) as exc:
        raise SystemExit(f"--listen {listen!r} is not an address of this machine ({exc}); give an IP address "
                         f"or host name, e.g. --listen 127.0.0.1 (this machine only) or --listen 0.0.0.0 "
                         f"(every network)") from None


def explain_bind_error(exc: OSError, listen: str, port: int) -> str:
    """A one-line message for a failed bind: the port in use, an address not on this machine, no permission."""
    import errno

    if exc.errno == errno.EADDRINUSE:
        return (f"port {port} on {listen} is already in use (ComfyUI, or another lowvram-lora serve?); stop that "
                f"server or pick another port: lowvram-lora serve --port {port + 1 if port < 65535 else 8189}")
    if exc.errno == errno.EADDRNOTAVAIL:
        return (f"--listen {listen} is not an address of this machine; use 127.0.0.1 (this machine only), "
                f"0.0.0.0 (every network) or one of this machine's own addresses")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (f"no permission to listen on {listen}:{port} (ports below 1024 need administrator rights); "
                f"pick a port above 1024, e.g. --port 8188")
    return f"cannot listen on {listen}:{port}: {exc.strerror or exc}; pick another --port or --listen address"


def serve_command(args, mappings, display) -> int:
    require_editor()
    check_listen_address(args.listen, args.port)
    from aiohttp import web

    from ..nodes.paths import configure_standalone_dirs

    static = frontend_static_dir()
    models = Path(args.models_dir).expanduser().resolve()
    output = Path(args.output_dir).expanduser().resolve()
    configure_standalone_dirs(str(models), str(output))
    user = Path(args.user_dir).expanduser().resolve() if args.user_dir else output.parent / "user" / "default"
    (user / "workflows").mkdir(parents=True, exist_ok=True)
    (user / "subgraphs").mkdir(exist_ok=True)  # frontends >= 1.5x list it on load; missing, the console shows a 404
    output.mkdir(parents=True, exist_ok=True)
    host = PromptHost(mappings, display, output, user)
    app = build_app(host, static)

    async def start(app_):
        host.loop = asyncio.get_running_loop()
        threading.Thread(target=host.worker, name="lowvram-prompt-worker", daemon=True).start()

    app.on_startup.append(start)
    installed = frontend_version()
    print(f"lowvram-lora serve: http://{args.listen}:{args.port} (editor {installed or '?'} from {static}; "
          f"models {models}, outputs {output}, user data {user})", flush=True)
    notice = frontend_notice(installed)
    if notice:
        print(f"lowvram-lora serve: {notice}", flush=True)
    try:
        web.run_app(app, host=args.listen, port=args.port, print=None)
    except OSError as exc:  # the bind: port in use, an address that is not ours, a privileged port
        raise SystemExit(explain_bind_error(exc, args.listen, args.port)) from None
    return 0


__all__ = ["add_serve_parser", "serve_command", "build_app", "PromptHost", "inside", "foreign_origin",
           "platform"]
