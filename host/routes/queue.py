"""Route group: prompts in and out. ``POST /prompt`` queues a graph, ``/queue`` and ``/history`` show and edit the
queue, ``/interrupt`` stops the running prompt, and ComfyUI 0.33's ``/api/jobs`` (host/jobs.py) gives the newer
frontends the same queue and history. Every read and change goes through the host's queue (``PromptQueue``)."""
from __future__ import annotations

import json

from aiohttp import web

from .. import jobs
from ..serve_api import BadRequest, Routes, id_list, object_body, read_json


class QueueRoutes:
    """``host``: the prompt host (``enqueue`` validates and queues a graph, ``dequeue`` takes one off; both tell the
    clients the queue changed); ``queue``: its ``PromptQueue``."""

    def __init__(self, host, queue):
        self.host, self.queue = host, queue

    def register(self, routes: Routes) -> None:
        routes.both("GET", "/prompt")(self.get_prompt)
        routes.both("POST", "/prompt")(self.post_prompt)
        routes.both("GET", "/queue")(self.get_queue)
        routes.both("POST", "/queue")(self.post_queue)
        routes.both("GET", "/history")(self.get_history)
        routes.both("GET", "/history/{prompt_id}")(self.get_history_one)
        routes.both("POST", "/history")(self.post_history)
        routes.both("POST", "/interrupt")(self.interrupt)
        # ComfyUI 0.33's jobs API (host/jobs.py): the newer frontends' queue and history, under /api only.
        routes.only("GET", "/api/jobs")(self.list_jobs)
        routes.only("GET", "/api/jobs/{job_id}")(self.get_job)
        routes.only("POST", "/api/jobs/{job_id}/cancel")(self.cancel_job)
        routes.only("POST", "/api/jobs/cancel")(self.cancel_jobs)

    async def get_prompt(self, request):
        return web.json_response(self.host.queue_info())

    async def post_prompt(self, request):
        from ..workflow import WorkflowError

        data = await read_json(request)
        if not isinstance(data, dict) or not isinstance(data.get("prompt"), dict):
            raise BadRequest("POST /prompt takes {\"prompt\": {node id: {class_type, inputs}}, \"client_id\": ...}")
        if not isinstance(data.get("client_id"), (str, type(None))):
            raise BadRequest("POST /prompt: client_id must be a string (the websocket's clientId)")
        if not isinstance(data.get("extra_data") or {}, dict):
            raise BadRequest("POST /prompt: extra_data must be a JSON object")
        try:
            item = self.host.enqueue(data["prompt"], data.get("client_id"), data.get("extra_data") or {})
        except WorkflowError as exc:
            return web.json_response({"error": {"type": "prompt_outputs_failed_validation", "message": str(exc),
                                                "details": str(exc), "extra_info": {}}, "node_errors": {}},
                                     status=400)
        return web.json_response({"prompt_id": item["prompt_id"], "number": item["number"], "node_errors": {}})

    async def get_queue(self, request):
        running, pending, _ = self.queue.snapshot()
        return web.json_response({"queue_running": [list(e) for e in running],
                                  "queue_pending": [list(e) for e in pending]})

    async def post_queue(self, request):
        data = object_body(await read_json(request), "POST /queue", '{"clear": true} or {"delete": [prompt ids]}')
        self.queue.remove(id_list(data, "POST /queue"), clear=bool(data.get("clear")))
        self.host.send_status()
        return web.Response(status=200)

    async def get_history(self, request):
        items = self.queue.history_items()
        if request.query.get("max_items"):
            try:
                limit = int(request.query["max_items"])
            except ValueError:
                limit = -1
            if limit < 0:
                raise BadRequest(f"max_items={request.query['max_items']!r} must be a whole number >= 0")
            items = items[-limit:] if limit else []
        return web.json_response(dict(items))

    async def get_history_one(self, request):
        pid = request.match_info["prompt_id"]
        entry = self.queue.history_entry(pid)
        return web.json_response({pid: entry} if entry is not None else {})

    async def post_history(self, request):
        data = object_body(await read_json(request), "POST /history", '{"clear": true} or {"delete": [prompt ids]}')
        self.queue.forget(id_list(data, "POST /history"), clear=bool(data.get("clear")))
        return web.Response(status=200)

    async def interrupt(self, request):
        # Frontends >= 1.5x send {"prompt_id": ...}: stop that prompt only if it is the running one (ComfyUI 0.33).
        try:
            data = await request.json() if request.can_read_body else {}
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            data = {}
        prompt_id = data.get("prompt_id") if isinstance(data, dict) else None
        if prompt_id:
            self.queue.interrupt_if_running(str(prompt_id))
        else:
            self.queue.interrupt()
        return web.Response(status=200)

    async def list_jobs(self, request):
        try:
            args = jobs.parse_list_query(request.rel_url.query)
        except jobs.JobsQueryError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(jobs.list_reply(*self.queue.snapshot(), **args))

    async def get_job(self, request):
        job = jobs.find_job(request.match_info["job_id"], *self.queue.snapshot())
        if job is None:
            return web.json_response({"error": "Job not found"}, status=404)
        return web.json_response(job)

    async def cancel_job(self, request):
        return web.json_response({"cancelled": jobs.cancel(request.match_info["job_id"],
                                                           self.queue.interrupt_if_running, self.host.dequeue)})

    async def cancel_jobs(self, request):
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
        cancelled = [jobs.cancel(i, self.queue.interrupt_if_running, self.host.dequeue) for i in ids]
        return web.json_response({"cancelled": any(cancelled)})
