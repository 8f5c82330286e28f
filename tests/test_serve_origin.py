"""`lowvram-lora serve` against a hostile or careless client: another site's page cannot change anything
(403 on every state-changing route and the websocket), malformed bodies and queries get a 400 with a message,
websocket garbage is ignored without a traceback, and the command's own failures (no aiohttp, a port in use,
a bad --listen) are one line naming the fix."""
from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="aiohttp is not installed (pip install 'lowvram-lora[editor]')")
pytest.importorskip("comfyui_frontend_package", reason="the editor is not installed (pip install 'lowvram-lora[editor]')")

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

from lowvram_lora.host.serve import PromptHost, SAFE_METHODS, build_app, foreign_origin, frontend_static_dir  # noqa: E402
from lowvram_lora.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def app_run(tmp_path):
    """(host, run(coro_fn(client, origin))): our app on a test server; ``origin`` is its own origin."""
    host = PromptHost(NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, tmp_path / "output", tmp_path / "user")
    (tmp_path / "user" / "workflows").mkdir(parents=True)
    (tmp_path / "output").mkdir()

    def run(test):
        async def main():
            host.loop = asyncio.get_running_loop()
            app = build_app(host, frontend_static_dir())
            async with TestClient(TestServer(app)) as client:
                return await test(client, app, f"http://{client.host}:{client.port}")
        return asyncio.run(main())

    return host, run


def _state_changing_routes(app) -> list[tuple[str, str]]:
    """Every (method, path) the app serves that is not a read: the ones a foreign page must not reach."""
    out = []
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("formatter") or info.get("path")
        if route.method in SAFE_METHODS or route.method == "*" or not path:
            continue
        out.append((route.method, re.sub(r"\{[^}]+\}", "x.json", path)))
    return sorted(set(out))


FOREIGN = [
    {"Origin": "http://evil.example"},
    {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"},
    {"Origin": "null"},
    {"Sec-Fetch-Site": "cross-site"},  # a browser that sends no Origin but marks the request
]


def test_every_state_changing_route_refuses_a_foreign_origin(app_run):
    host, run = app_run
    (host.user_dir / "x.json").write_text("{}")

    async def test(c, app, own):
        routes = _state_changing_routes(app)
        methods = {m for m, _ in routes}
        assert {"POST", "DELETE"} <= methods and len(routes) >= 20, routes  # /api and bare forms
        for path in ("/prompt", "/queue", "/history", "/interrupt", "/settings", "/userdata/x.json"):
            assert ("POST", path) in routes and ("POST", "/api" + path) in routes
        for method, path in routes:
            for headers in FOREIGN:
                # text/plain: what a page can send without a CORS preflight
                r = await c.request(method, path, data=b'{"clear": true, "prompt": {}}',
                                    headers={**headers, "Content-Type": "text/plain"})
                assert r.status == 403, (method, path, headers, r.status)
                assert "refused" in (await r.json())["error"]
        # another local server's page (another port) is another site too
        other_port = own.rsplit(":", 1)[0] + ":1"
        assert (await c.post("/api/interrupt", headers={"Origin": other_port})).status == 403
        assert (await c.post("/api/interrupt", headers={"Origin": "http://localhost.evil.example:"
                                                                  + own.rsplit(":", 1)[1]})).status == 403
        # the websocket: a foreign page may not open it (it would read every message)
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await c.ws_connect("/ws?clientId=spy", headers={"Origin": "http://evil.example"})
        assert refused.value.status == 403

    run(test)
    # nothing happened: no file written, moved or deleted, no setting, nothing stopped
    assert sorted(p.name for p in host.user_dir.iterdir()) == ["workflows", "x.json"]
    assert not host.queue.interrupt_flag.is_set() and not host.queue.pending


def test_the_editor_page_and_clients_without_origin_still_work(app_run):
    host, run = app_run

    async def test(c, app, own):
        page = {"Origin": own, "Sec-Fetch-Site": "same-origin"}  # what the browser sends from the editor
        assert (await c.post("/api/settings", json={"Comfy.Locale": "en"}, headers=page)).status == 200
        r = await c.post("/api/userdata/workflows%2Fmine.json", data=b"{}", headers=page)
        assert r.status == 200
        ws = await c.ws_connect("/ws?clientId=editor", headers=page)
        assert (await ws.receive_json())["type"] == "status"
        await ws.close()
        # a page's reads are the browser's business (CORS); a navigation from another site still opens the editor
        assert (await c.get("/", headers={"Sec-Fetch-Site": "cross-site"})).status == 200
        # comfy-cli and scripts send no Origin
        assert (await c.post("/api/queue", json={"clear": True})).status == 200
        # a bad body from the editor page is a 400, not a 403: the check let it through
        assert (await c.post("/api/prompt", data=b"{not json", headers=page)).status == 400

    run(test)
    assert json.loads((host.user_dir / "comfy.settings.json").read_text()) == {"Comfy.Locale": "en"}


@pytest.mark.parametrize("method, headers, why", [
    ("POST", {"Host": "127.0.0.1:8188", "Origin": "http://127.0.0.1:8188"}, None),
    ("POST", {"Host": "localhost:8188", "Origin": "http://localhost:8188"}, None),
    ("POST", {"Host": "localhost", "Origin": "http://localhost:80"}, None),  # default port either way
    ("POST", {"Host": "[::1]:8188", "Origin": "http://[::1]:8188"}, None),
    ("POST", {"Host": "192.168.1.5:8188", "Origin": "http://192.168.1.5:8188"}, None),  # --listen 0.0.0.0
    ("POST", {"Host": "127.0.0.1:8188"}, None),
    ("POST", {"Host": "127.0.0.1:8188", "Origin": "http://evil.example"}, "Origin"),
    ("POST", {"Host": "127.0.0.1:8188", "Origin": "http://127.0.0.1:9999"}, "Origin"),
    ("POST", {"Host": "127.0.0.1:8188", "Origin": "http://localhost:8188"}, "Origin"),
    ("POST", {"Host": "192.168.1.5:8188", "Origin": "http://evil.example"}, "Origin"),  # not only on loopback
    ("POST", {"Host": "127.0.0.1:8188", "Origin": "garbage"}, "Origin"),
    ("POST", {"Host": "127.0.0.1:8188", "Origin": "null"}, "null"),
    ("DELETE", {"Host": "127.0.0.1:8188", "Sec-Fetch-Site": "cross-site"}, "cross-site"),
    ("GET", {"Host": "127.0.0.1:8188", "Sec-Fetch-Site": "cross-site"}, None),  # a link to the editor
    ("GET", {"Host": "127.0.0.1:8188", "Origin": "null"}, None),
    ("GET", {"Host": "127.0.0.1:8188", "Origin": "http://evil.example"}, "Origin"),  # as ComfyUI
])
def test_foreign_origin_rules(method, headers, why):
    reason = foreign_origin(method, headers)
    assert (reason is None) == (why is None), reason
    if why:
        assert why in reason


# -- malformed input: 400 with a message, never a 500 or a traceback ---------------------------------------------

def test_malformed_bodies_and_queries_get_400(app_run, capfd):
    host, run = app_run

    async def test(c, app, own):
        cases = [
            ("POST", "/api/queue", [1, 2]), ("POST", "/api/queue", {"delete": 5}),
            ("POST", "/api/queue", {"delete": [5]}), ("POST", "/api/queue", "clear"),
            ("POST", "/api/history", [1]), ("POST", "/api/history", {"delete": "abc"}),
            ("POST", "/api/history", None), ("POST", "/api/settings", [1]),
            ("POST", "/api/prompt", {"prompt": {}, "client_id": ["x"]}),
            ("POST", "/api/prompt", {"prompt": {}, "extra_data": [1]}),
            ("POST", "/api/prompt", {"prompt": {"1": 5}}),
            ("POST", "/api/prompt", {"prompt": {"1": {"class_type": ["x"], "inputs": {}}}}),
        ]
        for method, path, body in cases:
            r = await c.request(method, path, json=body)
            assert r.status == 400, (path, body, r.status, await r.text())
            assert (await r.json())["error"], (path, body)
        for query in ("abc", "-1", "1e3", ""):
            r = await c.get(f"/api/history?max_items={query}")
            assert r.status == (200 if query == "" else 400), query
        host.queue.history.update({"a": {}, "b": {}, "c": {}})
        assert list(await (await c.get("/api/history?max_items=2")).json()) == ["b", "c"]
        assert list(await (await c.get("/api/history?max_items=0")).json()) == []
        assert (await c.post("/api/queue", json={"delete": ["nope"], "clear": True})).status == 200

    run(test)
    err = capfd.readouterr().err
    assert "Traceback" not in err


def test_websocket_garbage_is_ignored_without_a_traceback(app_run, capfd):
    host, run = app_run

    async def test(c, app, own):
        ws = await c.ws_connect("/ws?clientId=fuzz")
        assert (await ws.receive_json())["type"] == "status"
        for junk in ("not json", "[1, 2]", "5", "null", '"feature_flags"', '{"type": ["x"]}', "{"):
            await ws.send_str(junk)
        await ws.send_bytes(b"\x00\xff")
        await ws.send_json({"type": "feature_flags", "data": {}})  # the socket still answers
        assert (await asyncio.wait_for(ws.receive_json(), 10))["type"] == "feature_flags"
        try:  # too large: the server closes this socket (1009), maybe before the client has sent it all
            await ws.send_str("x" * (5 << 20))
            msg = await asyncio.wait_for(ws.receive(), 10)
            assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING,
                                aiohttp.WSMsgType.ERROR)
        except ConnectionError:
            pass
        await ws.close()
        ws2 = await c.ws_connect("/ws?clientId=after")  # the server is fine
        assert (await ws2.receive_json())["type"] == "status"
        await ws2.close()
        await asyncio.sleep(0.2)

    run(test)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Error handling request" not in err
    assert not host.sockets


# -- the command's own failures: one line naming the fix ---------------------------------------------------------

def _serve(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "lowvram_lora", "serve", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def _one_line_error(done) -> str:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_port_in_use_and_bad_listen_address_are_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = _one_line_error(_serve("--port", str(port), "--output-dir", str(tmp_path / "out")))
    assert f"port {port}" in line and "already in use" in line and "--port" in line
    line = _one_line_error(_serve("--listen", "300.1.2.3", "--output-dir", str(tmp_path / "out")))
    assert "300.1.2.3" in line and "--listen 127.0.0.1" in line
    line = _one_line_error(_serve("--port", "70000", "--output-dir", str(tmp_path / "out")))
    assert "between 1 and 65535" in line


def test_serve_without_aiohttp_names_the_install_command(tmp_path):
    # A sitecustomize that hides aiohttp, as a machine without the [editor] extra has none.
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'aiohttp' or name.startswith('aiohttp.'):\n"
        "            raise ModuleNotFoundError(\"No module named 'aiohttp'\", name=name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Hide())\n")
    env = {"PYTHONPATH": os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")])}
    line = _one_line_error(_serve("--output-dir", str(tmp_path / "out"), env=env))
    assert "pip install 'lowvram-lora[editor]'" in line and "aiohttp" in line
