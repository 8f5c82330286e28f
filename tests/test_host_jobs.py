"""``/api/jobs`` in ``lowvram-lora serve`` (host/jobs.py + host/serve.py), issue 28.

- host/jobs.py against ComfyUI 0.33's own ``comfy_execution/jobs.py`` (where LOWVRAM_COMFYUI_DIR points at a
  ComfyUI that has it): the same queue and history give the same JSON, for our nodes' outputs and for the
  odd outputs ComfyUI's rules single out (3D names, text, tuples, None, formats, the ``animated`` flag).
- The ``after`` cursor (``pagination.next_cursor``), which ComfyUI 0.33 lacks: a walk lists every job once,
  stays right when jobs are queued between pages, and resumes when the cursor's job left the list.
- The routes through the app: the fields frontend 1.58.1's schema requires (its ``fetchJobsRaw``), paging,
  ComfyUI's 400 and 404 answers, cancelling a pending and the running job, ``/global_subgraphs``, and
  ``/system_stats``' required_frontend_version (the extras' lower bound).
CPU only; no prompt is executed (the queue is filled directly).
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import types
import uuid
from pathlib import Path

import pytest

from lowvram_lora.host import jobs

# ----------------------------------------------------------------- a queue and history in ComfyUI's forms

P = [str(uuid.UUID(int=i + 1)) for i in range(8)]
PROMPT = {"1": {"class_type": "LowVRAMSaveLoRA", "inputs": {}}}


def _extra(t, workflow_id=None, **more):
    extra = {"create_time": t, "client_id": "c1", **more}
    if workflow_id:
        extra["extra_pnginfo"] = {"workflow": {"id": workflow_id}}
    return extra


def _history(pid, number, t, status, messages, outputs, workflow_id=None):
    return {"prompt": (number, pid, PROMPT, _extra(t, workflow_id), ["1"]), "outputs": outputs,
            "status": {"status_str": status, "completed": status == "success", "messages": messages},
            "meta": {}}


TRAIN_UI = {"images": [{"filename": "lowvram_loss_ab.png", "subfolder": "", "type": "temp"}],
            "final_loss": [0.41], "steps": [30]}
SAVE_UI = {"text": ["/out/loras/demo_tiny_lora_00001_.safetensors"], "loss_curve": ["/out/loras/x_loss.png"],
           "files": [{"filename": "demo_tiny_lora_00001_.safetensors", "subfolder": "loras", "type": "output"}]}
ODD = {"a": {"3d": ["mesh.glb", None, "notes"], "animated": [True]},
       "b": {"text": [("tuple text", 1), "x" * 2000]},
       "c": {"video": [{"filename": "v.mp4", "type": "output", "format": "video/h264-mp4"}],
             "files": [{"filename": "report.md", "type": "output"}, {"filename": "clip.bin", "format": "audio/wav"}]},
       "d": "not a dict"}
RUNNING = [(5, P[0], PROMPT, _extra(5000, "wf-a"), ["1"])]
PENDING = [(6, P[1], PROMPT, _extra(6000), ["1"]), (7, P[2], PROMPT, {"client_id": "c1"}, ["1"])]
HISTORY = {
    P[3]: _history(P[3], 1, 1000, "success", [["execution_start", {"prompt_id": P[3], "timestamp": 1100}],
                                               ["execution_success", {"prompt_id": P[3], "timestamp": 9100}]],
                   {"4": TRAIN_UI, "5": SAVE_UI}, "wf-a"),
    P[4]: _history(P[4], 2, 2000, "error", [["execution_start", {"timestamp": 2100}],
                                             ["execution_interrupted", {"node_id": "4", "timestamp": 2500}]], {}),
    P[5]: _history(P[5], 3, 3000, "error", [["execution_start", {"timestamp": 3100}],
                                             ["execution_error", {"node_id": "2", "node_type": "LowVRAMCacheTextEmbeds",
                                                                  "exception_message": "no dataset",
                                                                  "exception_type": "DatasetError",
                                                                  "traceback": [], "timestamp": 3200}]], {"4": TRAIN_UI}),
    P[6]: _history(P[6], 4, 4000, "success", [["execution_start", {"timestamp": 4100}],
                                               ["execution_success", {"timestamp": 4900}]], ODD),
}

QUERIES = [
    {}, {"status": "in_progress,pending"}, {"status": "completed,failed,cancelled", "limit": "2"},
    {"status": "completed", "offset": "1"}, {"limit": "3", "offset": "2"}, {"sort_order": "asc"},
    {"sort_by": "execution_duration"}, {"sort_by": "execution_duration", "sort_order": "asc"},
    {"workflow_id": "wf-a"}, {"status": ","}, {"offset": "-4"},
]


# ----------------------------------------------------------------- against ComfyUI's own implementation


@pytest.fixture(scope="module")
def comfy_jobs():
    """ComfyUI's comfy_execution/jobs.py, loaded alone: its one import (comfy_api.internal.prune_dict) is
    given the same three lines, so nothing else of ComfyUI (or torch) is imported."""
    root = os.environ.get("LOWVRAM_COMFYUI_DIR")
    path = Path(root or "/nonexistent") / "comfy_execution" / "jobs.py"
    if not path.is_file():
        pytest.skip("set LOWVRAM_COMFYUI_DIR to a ComfyUI >= 0.33 (comfy_execution/jobs.py) to compare against it")
    stub_pkg, stub = types.ModuleType("comfy_api"), types.ModuleType("comfy_api.internal")
    stub.prune_dict = lambda d: {k: v for k, v in d.items() if v is not None}
    stub_pkg.internal = stub
    saved = {k: sys.modules.get(k) for k in ("comfy_api", "comfy_api.internal")}
    sys.modules.update({"comfy_api": stub_pkg, "comfy_api.internal": stub})
    try:
        spec = importlib.util.spec_from_file_location("comfyui_jobs_reference", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return module


def _theirs(ref, query):
    """ComfyUI's GET /api/jobs handler, on its functions (server.py: the query rules, then get_all_jobs)."""
    args = jobs.parse_list_query(query)  # the query rules are compared separately below
    found, total = ref.get_all_jobs(RUNNING, PENDING, HISTORY, status_filter=args["statuses"],
                                    workflow_id=args["workflow_id"], sort_by=args["sort_by"],
                                    sort_order=args["sort_order"], limit=args["limit"], offset=args["offset"])
    return found, total


@pytest.mark.parametrize("query", QUERIES, ids=[str(q) for q in QUERIES])
def test_job_lists_equal_comfyuis(comfy_jobs, query):
    args = jobs.parse_list_query(query)
    assert jobs.list_jobs(RUNNING, PENDING, HISTORY, **args) == _theirs(comfy_jobs, query)


@pytest.mark.parametrize("pid", P)
def test_one_job_equals_comfyuis(comfy_jobs, pid):
    assert jobs.find_job(pid, RUNNING, PENDING, HISTORY) == comfy_jobs.get_job(pid, RUNNING, PENDING, HISTORY)


def test_output_summaries_equal_comfyuis(comfy_jobs):
    for outputs in ({"4": TRAIN_UI}, {"5": SAVE_UI}, ODD, {"4": TRAIN_UI, "5": SAVE_UI, **ODD}, {}):
        assert jobs.outputs_summary(outputs) == comfy_jobs.get_outputs_summary(outputs)
        assert jobs.previewable_count(outputs) == comfy_jobs.count_previewable_outputs(outputs)
    assert jobs.STATUSES == tuple(comfy_jobs.JobStatus.ALL)


def test_job_ids_are_checked_as_comfyui_checks_them(comfy_jobs):
    def theirs(value):
        try:
            comfy_jobs.validate_job_id(value)
            return True
        except (ValueError, AttributeError):
            return False

    for value in (P[0], P[0].upper(), P[0].replace("-", ""), "x", 3, None, {"a": 1}, ["x"], ""):
        assert jobs.is_job_id(value) == theirs(value), value


def test_the_summary_rules_on_their_own():
    """Without ComfyUI at hand: what the comparisons above pin, on the cases that matter to our nodes."""
    count, preview = jobs.outputs_summary({"4": TRAIN_UI, "5": SAVE_UI})
    assert count == 2  # the loss image and the saved .safetensors; floats and plain strings are not files
    assert preview == {**TRAIN_UI["images"][0], "nodeId": "4", "mediaType": "images"}  # temp image: the fallback
    assert jobs.previewable_count({"4": TRAIN_UI, "5": SAVE_UI}) == 1
    job = jobs.history_job(P[4], HISTORY[P[4]])
    assert job["status"] == "cancelled" and job["execution_end_time"] == 2500
    assert jobs.history_job(P[5], HISTORY[P[5]])["execution_error"]["node_type"] == "LowVRAMCacheTextEmbeds"


# ----------------------------------------------------------------- the ``after`` cursor (not in ComfyUI 0.33)


def _walk(running, pending, history, limit, **query):
    """Every page of a cursor walk (the frontend's assetsStore loop: ``after`` = the last ``next_cursor``
    until there is none), as lists of ids."""
    pages, after = [], None
    for _ in range(20):
        reply = jobs.list_reply(running, pending, history, **{**jobs.parse_list_query(
            {"limit": str(limit), **query, **({"after": after} if after else {})})})
        pages.append([j["id"] for j in reply["jobs"]])
        after = reply["pagination"].get("next_cursor")
        assert (after is not None) == reply["pagination"]["has_more"]
        if after is None:
            return pages
    raise AssertionError("the cursor walk did not end")


@pytest.mark.parametrize("query", [{}, {"sort_order": "asc"}, {"sort_by": "execution_duration"},
                                   {"status": "completed,failed,cancelled"}, {"status": "in_progress,pending"}])
@pytest.mark.parametrize("limit", [1, 2, 3, 50])
def test_a_cursor_walk_lists_every_job_once_in_order(query, limit):
    everything = [j["id"] for j in jobs.list_jobs(RUNNING, PENDING, HISTORY, **jobs.parse_list_query(query))[0]]
    pages = _walk(RUNNING, PENDING, HISTORY, limit, **query)
    assert [i for p in pages for i in p] == everything
    assert all(len(p) == limit for p in pages[:-1])


def test_a_cursor_walk_is_stable_when_jobs_are_queued_between_pages():
    """The point of a keyset cursor: a job queued between two pages (newest, so first) shifts an offset walk,
    which then shows a job twice; the cursor walk goes on just past the last job it showed."""
    query = jobs.parse_list_query({"limit": "2"})
    first = jobs.list_reply(RUNNING, PENDING, HISTORY, **query)
    newer = PENDING + [(8, P[7], PROMPT, _extra(7000), ["1"])]
    by_offset = jobs.list_reply(RUNNING, newer, HISTORY, **{**query, "offset": 2})
    by_cursor = jobs.list_reply(RUNNING, newer, HISTORY, **{**query, "after": first["pagination"]["next_cursor"]})
    shown = [j["id"] for j in first["jobs"]]
    assert shown == [P[1], P[0]]
    assert by_offset["jobs"][0]["id"] in shown  # the offset walk repeats P[0]
    assert [j["id"] for j in by_cursor["jobs"]] == [P[6], P[5]]
    assert by_cursor["pagination"]["offset"] == 3  # where the page starts now (P[7], P[1], P[0] come first)


def test_a_cursor_whose_job_left_the_list_resumes_past_its_time():
    """The running job of page one finished before page two was asked for (status filter: queue only): the
    walk goes on with the jobs created before it, repeating none."""
    query = jobs.parse_list_query({"status": "in_progress,pending", "limit": "2"})
    pending = PENDING[:1] + [(4, P[7], PROMPT, _extra(4500), ["1"])]
    first = jobs.list_reply(RUNNING, pending, HISTORY, **query)
    assert [j["id"] for j in first["jobs"]] == [P[1], P[0]]
    later = jobs.list_reply([], pending, HISTORY, **{**query, "after": first["pagination"]["next_cursor"]})
    assert [j["id"] for j in later["jobs"]] == [P[7]] and "next_cursor" not in later["pagination"]


def test_the_cursor_is_ignored_by_comfyuis_fields_and_bad_cursors_are_400s():
    reply = jobs.list_reply(RUNNING, PENDING, HISTORY, **jobs.parse_list_query({"limit": "2", "offset": "0"}))
    assert {k: v for k, v in reply["pagination"].items() if k != "next_cursor"} == {
        "offset": 0, "limit": 2, "total": 7, "has_more": True}
    cursor = reply["pagination"]["next_cursor"]
    ignoring_offset = jobs.list_reply(RUNNING, PENDING, HISTORY,
                                      **jobs.parse_list_query({"limit": "2", "offset": "5", "after": cursor}))
    assert [j["id"] for j in ignoring_offset["jobs"]] == [P[6], P[5]]
    for bad in ("x", "bm9wZQ", cursor[:-3], "WzEsMl0"):  # not base64 JSON, "nope", cut short, [1, 2]
        with pytest.raises(jobs.JobsQueryError, match="after must be a pagination.next_cursor"):
            jobs.parse_list_query({"after": bad})


# ----------------------------------------------------------------- the routes


aiohttp = pytest.importorskip("aiohttp", reason="aiohttp is not installed (pip install 'lowvram-lora[editor]')")


@pytest.fixture
def app_client(tmp_path):
    from aiohttp.test_utils import TestClient, TestServer

    from lowvram_lora.host.serve import PromptHost, build_app
    from lowvram_lora.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

    host = PromptHost(NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, tmp_path / "output", tmp_path / "user")
    static = tmp_path / "static"
    static.mkdir()
    (static / "index.html").write_text("<html></html>")

    def item(entry):
        number, pid, prompt, extra, outputs = entry
        return {"number": number, "prompt_id": pid, "prompt": prompt, "extra": extra, "outputs": outputs,
                "client_id": "c1"}

    host.queue.running = item(RUNNING[0])  # no worker thread: the queue stays as set here
    host.queue.pending = [item(e) for e in PENDING]
    host.queue.history = {k: {**v, "prompt": list(v["prompt"])} for k, v in HISTORY.items()}

    def run(test):
        async def main():
            host.loop = asyncio.get_running_loop()
            async with TestClient(TestServer(build_app(host, static))) as client:
                return await test(client)
        return asyncio.run(main())

    return host, run


def _frontend_job_schema_ok(job: dict) -> None:
    """The fields frontend 1.58.1's zod schema for a job requires (api-*.js: id, status, create_time, the two
    counts), with their types; a job failing it makes the whole list fail to parse (queue shows nothing)."""
    assert isinstance(job["id"], str) and job["status"] in jobs.STATUSES
    assert isinstance(job["create_time"], int)
    assert "outputs_count" in job and "previewable_outputs_count" in job
    error = job.get("execution_error")
    if error is not None:
        for key in ("node_id", "node_type", "exception_message", "exception_type"):
            assert isinstance(error[key], str), key
        assert isinstance(error["traceback"], list)


def test_the_queue_panel_request_lists_the_running_job(app_client):
    host, run = app_client

    async def test(c):
        # exactly what 1.58.1's fetchQueue asks
        r = await c.get("/api/jobs?status=in_progress,pending&limit=200&offset=0")
        assert r.status == 200
        body = await r.json()
        assert body["pagination"] == {"offset": 0, "limit": 200, "total": 3, "has_more": False}
        assert {j["id"]: j["status"] for j in body["jobs"]} == {P[0]: "in_progress", P[1]: "pending",
                                                                P[2]: "pending"}
        for job in body["jobs"]:
            if job["id"] != P[2]:  # P[2] was queued without create_time (not by serve): ComfyUI omits it too
                _frontend_job_schema_ok(job)
        history = await (await c.get("/api/jobs?status=completed,failed,cancelled&limit=2&offset=0")).json()
        cursor = history["pagination"].pop("next_cursor")
        assert history["pagination"] == {"offset": 0, "limit": 2, "total": 4, "has_more": True}
        assert [j["id"] for j in history["jobs"]] == [P[6], P[5]]  # newest first
        for job in history["jobs"]:
            _frontend_job_schema_ok(job)
        rest = await (await c.get("/api/jobs", params={"status": "completed,failed,cancelled", "limit": "2",
                                                       "after": cursor})).json()
        assert [j["id"] for j in rest["jobs"]] == [P[4], P[3]]
        assert rest["pagination"] == {"offset": 2, "limit": 2, "total": 4, "has_more": False}
        one = await (await c.get(f"/api/jobs/{P[3]}")).json()
        assert one["status"] == "completed" and one["outputs"]["5"]["files"][0]["subfolder"] == "loras"
        assert one["workflow"]["prompt"] == PROMPT
        assert (await c.get(f"/api/jobs/{uuid.uuid4()}")).status == 404

    run(test)


def test_bad_queries_get_comfyuis_400s(app_client):
    host, run = app_client

    async def test(c):
        for query, message in (("status=done", "Invalid status value(s): done"), ("limit=0", "positive integer"),
                               ("limit=x", "limit must be an integer"), ("offset=y", "offset must be an integer"),
                               ("sort_by=name", "sort_by must be"), ("sort_order=up", "sort_order must be"),
                               ("after=x", "after must be a pagination.next_cursor")):
            r = await c.get(f"/api/jobs?{query}")
            assert r.status == 400 and message in (await r.json())["error"], query
        r = await c.post("/api/jobs/cancel", data=b"{nope")
        assert r.status == 400
        r = await c.post("/api/jobs/cancel", json={"job_ids": "x"})
        assert r.status == 400 and (await r.json())["error"] == "job_ids must be a list"
        r = await c.post("/api/jobs/cancel", json={"job_ids": [P[1], "bad", 7]})
        assert r.status == 400 and (await r.json())["invalid_ids"] == ["bad", "7"]
        assert len(host.queue.pending) == 2  # a batch with a malformed id cancels nothing

    run(test)


def test_cancel_dequeues_a_pending_job_and_interrupts_only_the_running_one(app_client):
    host, run = app_client

    async def test(c):
        assert await (await c.post(f"/api/jobs/{P[1]}/cancel")).json() == {"cancelled": True}
        assert [i["prompt_id"] for i in host.queue.pending] == [P[2]] and not host.queue.interrupt_flag.is_set()
        # finished or unknown: a no-op, 200
        assert await (await c.post(f"/api/jobs/{P[3]}/cancel")).json() == {"cancelled": False}
        assert await (await c.post("/api/jobs/cancel", json={"job_ids": [P[7]]})).json() == {"cancelled": False}
        # /interrupt naming a prompt that is not running does nothing (frontends >= 1.5x send prompt_id)
        assert (await c.post("/api/interrupt", json={"prompt_id": P[2]})).status == 200
        assert not host.queue.interrupt_flag.is_set()
        assert await (await c.post("/api/jobs/cancel", json={"job_ids": [P[0], P[2]]})).json() == {"cancelled": True}
        assert host.queue.interrupt_flag.is_set() and host.queue.pending == []

    run(test)


def test_subgraphs_and_the_required_frontend_version(app_client):
    from packaging.requirements import Requirement

    from lowvram_lora.host.serve import MIN_FRONTEND_VERSION

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    editor = next(Requirement(d) for d in pyproject["project"]["optional-dependencies"]["editor"]
                  if d.startswith("comfyui-frontend-package"))
    assert [(c.operator, c.version) for c in editor.specifier] == [(">=", MIN_FRONTEND_VERSION)]
    host, run = app_client

    async def test(c):
        assert await (await c.get("/api/global_subgraphs")).json() == {}
        assert await (await c.get("/global_subgraphs")).json() == {}
        assert await (await c.get("/api/global_subgraphs/x")).json() is None
        system = (await (await c.get("/api/system_stats")).json())["system"]
        assert system["required_frontend_version"] == MIN_FRONTEND_VERSION

    run(test)


def test_what_the_editor_loads_on_every_start_is_answered_without_404s(app_client):
    """Frontend 1.58.1 loads ./user.css, api/userdata/user.css and comfy.templates.json on every page load, and asks
    api.comfy.org about ComfyUI releases unless Comfy.Notification.ShowVersionUpdates is off: with none of the
    files made, each was a console error (tests/comfyui/editor_queue.py saw them). A user's own files and
    settings still win, and the defaults are never written."""
    host, run = app_client

    async def test(c):
        for url, kind, text in (("/user.css", "text/css", ""), ("/api/userdata/user.css", "text/css", ""),
                                ("/api/userdata/comfy.templates.json", "application/json", "[]")):
            r = await c.get(url)
            assert r.status == 200 and r.content_type == kind and await r.text() == text, url
        assert (await c.get("/api/userdata/other.json")).status == 404
        assert (await c.get("/api/settings/Comfy.Notification.ShowVersionUpdates")).status == 200
        assert await (await c.get("/api/settings/Comfy.Notification.ShowVersionUpdates")).json() is False
        assert (await c.post("/api/settings", json={"Comfy.Locale": "en"})).status == 200
        assert json.loads((host.user_dir / "comfy.settings.json").read_text()) == {"Comfy.Locale": "en"}
        (host.user_dir / "user.css").write_text("body { color: red }")
        assert await (await c.get("/api/userdata/user.css")).text() == "body { color: red }"
        assert (await c.post("/api/settings/Comfy.Notification.ShowVersionUpdates", json=True)).status == 200
        assert (await (await c.get("/api/settings")).json())["Comfy.Notification.ShowVersionUpdates"] is True

    run(test)


def test_the_startup_line_says_when_the_frontend_is_outside_the_checked_range():
    from lowvram_lora.host.serve import MIN_FRONTEND_VERSION, NEWEST_CHECKED_FRONTEND, frontend_notice

    for inside_range in (MIN_FRONTEND_VERSION, "1.49.6", NEWEST_CHECKED_FRONTEND, None, "not a version"):
        assert frontend_notice(inside_range) is None, inside_range
    assert "newer than 1.58.1" in frontend_notice("1.60.0") and "==1.58.1" in frontend_notice("1.60.0")
    assert "older than 1.27.10" in frontend_notice("1.26.0")


def test_a_queued_prompt_carries_create_time_and_client_id(tmp_path):
    """serve stamps extra_data as ComfyUI's POST /prompt does (the newer frontends require create_time)."""
    from lowvram_lora.host.serve import PromptHost
    from lowvram_lora.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

    host = PromptHost(NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, tmp_path / "o", tmp_path / "u")
    from lowvram_lora.host.templates import WORKFLOWS_DIR

    demo = json.loads((WORKFLOWS_DIR / "api" / "demo_tiny_lora.json").read_text())
    graph = {"3": demo["3"]}  # Offload Config alone: a valid graph of one node, never run here
    assert graph["3"]["class_type"] == "LowVRAMOffloadConfig"
    item = host.enqueue(graph, "client-9", {"extra_pnginfo": {"workflow": {"id": "wf"}}})
    assert item["extra"]["client_id"] == "client-9" and isinstance(item["extra"]["create_time"], int)
    job = jobs.find_job(item["prompt_id"], *host.queue.snapshot())
    assert job["status"] == "pending" and job["workflow_id"] == "wf"
    _frontend_job_schema_ok(job)
