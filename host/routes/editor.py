"""Route group: the editor's page, its websocket, the extensions and templates it loads, and ``/view`` (files a
node wrote, for the editor to show)."""
from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import aiohttp
from aiohttp import web

from ..serve_api import (FEATURE_FLAGS, PACK, SERVE_WEB_DIR, WEB_DIR, WORKFLOWS_DIR, WS_MAX_MESSAGE_BYTES, BadRequest,
                         Routes, inside)


class EditorRoutes:
    """``static``: the frontend's files; ``host``: the prompt host whose messages the websocket carries
    (``connect`` / ``disconnect``, ``queue_info``); ``output_dir``: what ``/view?type=output`` serves."""

    def __init__(self, static: Path, host, output_dir: Path):
        self.static, self.host, self.output_dir = static, host, output_dir

    def register(self, routes: Routes) -> None:
        routes.only("GET", "/")(self.index)
        routes.only("GET", "/user.css")(self.root_user_css)
        routes.both("GET", "/ws")(self.websocket)
        routes.both("GET", "/extensions")(self.extensions)
        routes.both("GET", "/workflow_templates")(self.templates)
        routes.only("GET", "/templates/{name}")(self.core_templates)
        routes.both("GET", "/view")(self.view)

    def add_static(self, app) -> None:
        """The folders served as they are; the frontend's own last (it answers every other path)."""
        app.router.add_static(f"/extensions/{PACK}", WEB_DIR)
        app.router.add_static(f"/extensions/{PACK}-serve", SERVE_WEB_DIR)
        # The template files and their thumbnails, as ComfyUI serves a pack's example workflows (server.py).
        app.router.add_static(f"/api/workflow_templates/{PACK}", WORKFLOWS_DIR)
        app.router.add_static("/", self.static)

    async def index(self, request):
        resp = web.FileResponse(self.static / "index.html")
        resp.headers["Cache-Control"] = "no-cache"
        return resp

    async def root_user_css(self, request):
        # index.html links ./user.css (a leftover of ComfyUI's old web folder; ComfyUI answers 404) besides
        # api/userdata/user.css, which carries the user's own stylesheet.
        return web.Response(text="", content_type="text/css")

    async def websocket(self, request):
        # Messages from the editor are small (feature flags); a larger one closes the socket (1009).
        ws = web.WebSocketResponse(max_msg_size=WS_MAX_MESSAGE_BYTES)
        await ws.prepare(request)
        sid = request.rel_url.query.get("clientId") or uuid.uuid4().hex
        self.host.connect(sid, ws)
        try:
            await ws.send_json({"type": "status", "data": {"status": self.host.queue_info(), "sid": sid}})
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
            self.host.disconnect(sid)
        return ws

    async def extensions(self, request):
        return web.json_response([f"/extensions/{PACK}/{p.name}" for p in sorted(WEB_DIR.glob("*.js"))]
                                 + [f"/extensions/{PACK}-serve/{p.name}" for p in sorted(SERVE_WEB_DIR.glob("*.js"))])

    async def templates(self, request):
        return web.json_response({PACK: sorted(p.stem for p in WORKFLOWS_DIR.glob("*.json"))})

    async def core_templates(self, request):
        # ComfyUI serves its core templates here (comfyui_workflow_templates); we have none, and the editor's
        # template store fails as a whole on a 404, so our pack's templates would not open either.
        if request.match_info["name"].startswith("index") and request.match_info["name"].endswith(".json"):
            return web.json_response([])
        return web.json_response({"error": "not found"}, status=404)

    async def view(self, request):
        from ...nodes.paths import input_dir, temp_dir

        kind = request.query.get("type", "output")
        roots = {"output": self.output_dir, "temp": temp_dir(), "input": input_dir()}
        if kind not in roots:
            raise BadRequest(f"type={kind!r} is not one of output, temp, input")
        name = request.query.get("filename", "")
        sub = request.query.get("subfolder", "")
        path = inside(roots[kind], f"{sub}/{name}" if sub else name)
        if not path.is_file():
            return web.json_response({"error": "not found"}, status=404)
        return web.FileResponse(path)
