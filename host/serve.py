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

Where the parts are: ``PromptHost`` (here) holds the websocket clients, the nodes' progress hooks and the worker
thread; ``prompt_queue.PromptQueue`` the queue and history, behind its own lock; ``routes/`` the route groups
(editor, userdata, queue, info), which ``build_app`` registers; ``serve_api`` the limits and request checks they
share.
"""
from __future__ import annotations

import asyncio
import io
import json
import platform
import struct
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from .prompt_queue import PromptQueue
from .serve_api import (EDITOR_USERDATA_DEFAULTS, FEATURE_FLAGS, MAX_BODY_BYTES, MIN_FRONTEND_VERSION,
                        NEWEST_CHECKED_FRONTEND, PACK, SAFE_METHODS, SERVE_WEB_DIR, SETTING_DEFAULTS, WEB_DIR,
                        WORKFLOWS_DIR, WS_MAX_MESSAGE_BYTES, BadRequest, Routes, foreign_origin, inside, middlewares)


class Interrupted(Exception):
    """The editor's stop button (POST /interrupt), raised inside the running node."""


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


class PromptHost:
    """The server side of one ``lowvram-lora serve``: the websocket clients and the messages they are sent, the
    nodes' progress hooks, and the worker that runs the queue's prompts one at a time (the queue itself:
    ``PromptQueue``, which owns its lock)."""

    def __init__(self, mappings, display, output_dir: Path, user_dir: Path):
        self.mappings, self.display = mappings, display
        self.output_dir, self.user_dir = output_dir, user_dir
        self.queue = PromptQueue()
        self.sockets: dict[str, Any] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.client_id: str | None = None
        self.node_states: dict[str, dict] = {}  # the running prompt's nodes (progress_state)

    # -- websocket clients (the event loop) ---------------------------------------------------
    def connect(self, sid: str, ws) -> None:
        self.sockets[sid] = ws

    def disconnect(self, sid: str) -> None:
        self.sockets.pop(sid, None)

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
        return {"exec_info": {"queue_remaining": self.queue.remaining()}}

    def send_status(self) -> None:
        self.send("status", {"status": self.queue_info()})

    # -- the nodes' progress hook (nodes/progress.py HostCallback) ----------------------------
    def progress(self, node_id, value: int, total: int) -> None:
        pid = self.queue.running_id()
        self.send("progress", {"value": value, "max": total, "prompt_id": pid, "node": node_id}, self.client_id)
        self.node_state(node_id, "running", value, total)

    def node_state(self, node_id, state: str, value: float | None = None, total: float | None = None) -> None:
        """``progress_state`` (comfy_execution/progress.py): every started node's value, max and state. The
        editor takes the running node (where previews go) from it."""
        pid = self.queue.running_id()
        if pid is None or node_id is None:
            return
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
        pid = self.queue.running_id()
        meta = json.dumps({"node_id": str(node_id), "prompt_id": pid, "display_node_id": str(node_id),
                           "parent_node_id": None, "real_node_id": str(node_id), "image_type": "image/png"}).encode()
        self.send("preview", struct.pack(">I", 4) + struct.pack(">I", len(meta)) + meta + buf.getvalue(),
                  self.client_id)

    def interrupt_check(self) -> None:
        if self.queue.interrupted():
            raise Interrupted("interrupted by the user")

    # -- the queue -----------------------------------------------------------------------------
    def enqueue(self, prompt: dict, client_id: str | None, extra: dict) -> dict:
        """Validate a graph against our nodes and queue it; every client hears the queue grew."""
        from .workflow import validate_graph

        validate_graph(prompt, self.mappings)
        outputs = [k for k, v in prompt.items() if getattr(self.mappings[v["class_type"]], "OUTPUT_NODE", False)]
        item = self.queue.add(prompt, client_id, extra, outputs)
        self.send_status()
        return item

    def dequeue(self, prompt_id: str) -> bool:
        removed = self.queue.dequeue(prompt_id)
        if removed:
            self.send_status()
        return removed

    def worker(self) -> None:
        from ..nodes.progress import set_host

        set_host(self)
        while True:
            item = self.queue.take()
            self.send_status()
            self._execute(item)
            self.queue.finish()
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
        self.queue.record(pid, {
            "prompt": [item["number"], pid, item["prompt"], item["extra"], item["outputs"]],
            "outputs": outputs,
            "status": {"status_str": status, "completed": status == "success", "messages": messages},
            "meta": {k: {"node_id": k, "display_node": k} for k in outputs},
        })
        self.send("executing", {"node": None, "prompt_id": pid}, sid)


def build_app(host: PromptHost, static: Path):
    """The aiohttp app: every route group registered on one table, the safety middlewares, the static folders."""
    from aiohttp import web

    from .routes.editor import EditorRoutes
    from .routes.info import InfoRoutes
    from .routes.queue import QueueRoutes
    from .routes.userdata import UserDataRoutes

    routes = Routes()
    editor = EditorRoutes(static, host, host.output_dir)
    for group in (editor, UserDataRoutes(host.user_dir), InfoRoutes(host.mappings, host.display),
                  QueueRoutes(host, host.queue)):
        group.register(routes)
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares())
    app.add_routes(routes.table)
    editor.add_static(app)
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


__all__ = ["add_serve_parser", "serve_command", "build_app", "PromptHost", "PromptQueue", "inside", "foreign_origin",
           "platform", "BadRequest", "SAFE_METHODS", "EDITOR_USERDATA_DEFAULTS", "FEATURE_FLAGS", "MAX_BODY_BYTES",
           "MIN_FRONTEND_VERSION", "NEWEST_CHECKED_FRONTEND", "PACK", "SERVE_WEB_DIR", "SETTING_DEFAULTS", "WEB_DIR",
           "WORKFLOWS_DIR", "WS_MAX_MESSAGE_BYTES"]
