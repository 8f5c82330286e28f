"""Route group: the editor's settings (``comfy.settings.json``) and the user's files (saved workflows, user.css),
every path kept inside the user folder (``inside``). ComfyUI's ``app/user_manager.py`` and ``app/app_settings.py``."""
from __future__ import annotations

import json
import os
from pathlib import Path

from aiohttp import web

from ...engine.fileio import atomic_write, write_json_atomic
from ..serve_api import EDITOR_USERDATA_DEFAULTS, SETTING_DEFAULTS, BadRequest, Routes, inside, read_json


class UserDataRoutes:
    def __init__(self, user_dir: Path):
        self.user_dir = user_dir
        self.settings_file = user_dir / "comfy.settings.json"

    def register(self, routes: Routes) -> None:
        routes.both("GET", "/users")(self.users)
        routes.both("GET", "/settings")(self.get_settings)
        routes.both("GET", "/settings/{id}")(self.get_setting)
        routes.both("POST", "/settings")(self.post_settings)
        routes.both("POST", "/settings/{id}")(self.post_setting)
        routes.both("GET", "/userdata")(self.list_userdata)
        routes.both("GET", "/userdata/{file}")(self.get_userdata)
        routes.both("POST", "/userdata/{file}")(self.post_userdata)
        routes.both("DELETE", "/userdata/{file}")(self.delete_userdata)
        routes.both("POST", "/userdata/{file}/move/{dest}")(self.move_userdata)

    def read_settings(self) -> dict:
        try:
            return json.loads(self.settings_file.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    async def users(self, request):
        return web.json_response({"storage": "server", "migrated": True})

    async def get_settings(self, request):
        return web.json_response({**SETTING_DEFAULTS, **self.read_settings()})  # defaults are never written

    async def get_setting(self, request):
        return web.json_response({**SETTING_DEFAULTS, **self.read_settings()}.get(request.match_info["id"]))

    async def post_settings(self, request):
        new = await read_json(request)
        if not isinstance(new, dict):
            raise BadRequest("settings must be a JSON object")
        write_json_atomic(self.settings_file, {**self.read_settings(), **new}, "the editor settings")
        return web.Response(status=200)

    async def post_setting(self, request):
        value = await read_json(request)
        write_json_atomic(self.settings_file, {**self.read_settings(), request.match_info["id"]: value},
                          "the editor settings")
        return web.Response(status=200)

    async def list_userdata(self, request):
        folder = inside(self.user_dir, request.query.get("dir", ""))
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

    async def get_userdata(self, request):
        path = inside(self.user_dir, request.match_info["file"])
        if not path.is_file():
            default = EDITOR_USERDATA_DEFAULTS.get(request.match_info["file"])
            if default is not None:
                return web.Response(text=default[1], content_type=default[0])
            return web.json_response({"error": "not found"}, status=404)
        return web.FileResponse(path)

    async def post_userdata(self, request):
        path = inside(self.user_dir, request.match_info["file"])
        if path.exists() and request.query.get("overwrite", "true").lower() == "false":
            return web.json_response({"error": "file exists"}, status=409)
        data = await request.read()
        with atomic_write(path, "a saved workflow") as tmp:
            Path(tmp).write_bytes(data)
        rel = path.relative_to(self.user_dir.resolve()).as_posix()
        if request.query.get("full_info", "").lower() == "true":
            return web.json_response({"path": rel, "size": path.stat().st_size, "modified": path.stat().st_mtime})
        return web.json_response(rel)

    async def delete_userdata(self, request):
        path = inside(self.user_dir, request.match_info["file"])
        if not path.is_file():
            return web.json_response({"error": "not found"}, status=404)
        path.unlink()
        return web.Response(status=204)

    async def move_userdata(self, request):
        src = inside(self.user_dir, request.match_info["file"])
        dest = inside(self.user_dir, request.match_info["dest"])
        if not src.is_file():
            return web.json_response({"error": "not found"}, status=404)
        if dest.exists() and request.query.get("overwrite", "true").lower() == "false":
            return web.json_response({"error": "file exists"}, status=409)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dest)
        return web.json_response(dest.relative_to(self.user_dir.resolve()).as_posix())
