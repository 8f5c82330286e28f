"""``/api/jobs`` for ``lowvram-lora serve``: the queue and history as one list of jobs.

Frontends from about 1.5x on (1.58.1 checked) fill their queue and history panels only from
``GET /api/jobs?status=in_progress,pending&limit=..&offset=..`` and ``GET /api/jobs/{id}``, and cancel with
``POST /api/jobs/{id}/cancel`` or ``POST /api/jobs/cancel``; without these routes the queue reads "0 active"
while a prompt trains. The shapes and rules here are ComfyUI 0.33's (``comfy_execution/jobs.py`` and the
routes in ``server.py``), written again for our queue: tests/test_host_jobs.py runs ComfyUI's own functions on
the same queue and history and compares the JSON.

Keyset paging (``after`` / ``pagination.next_cursor``): ComfyUI 0.33's ``/api/jobs`` has no cursor (offset and
limit only). The shape here is the one the frontend's generated API types document for ``GET /api/jobs``
(1.58.1, ``packages/ingest-types/src/zod.gen.ts``: ``zListJobsQuery.after``, ``zPaginationInfo.next_cursor``) and
its cursor walkers follow (``assetService.ts``, ``assetsStore.ts``): ``next_cursor`` is an opaque string given
while more jobs follow; a request with ``after`` resumes just past that job and ignores ``offset``. 1.58.1's own
queue and history panels still page by offset; both work, and an offset reply carries a cursor too, so a client
can switch to cursors after its first page (as assetsStore does).

Inputs are ComfyUI's forms: a queue item is ``(number, prompt_id, prompt, extra_data, outputs_to_execute)``,
a history entry ``{"prompt": (that tuple), "outputs", "status": {"status_str", "messages"}}``.
"""
from __future__ import annotations

import base64
import binascii
import json
import uuid
from typing import Any, Callable, Iterable

PENDING, IN_PROGRESS, COMPLETED, FAILED, CANCELLED = "pending", "in_progress", "completed", "failed", "cancelled"
STATUSES = (PENDING, IN_PROGRESS, COMPLETED, FAILED, CANCELLED)
_HISTORY_STATUSES = {COMPLETED, FAILED, CANCELLED}

#: What the frontend can show (its queueStore.ts): these media keys, video/audio formats, 3D and text files.
_PREVIEWABLE = frozenset({"images", "video", "audio", "3d", "text"})
_EXT_3D = (".obj", ".fbx", ".gltf", ".glb", ".usdz")
_EXT_TEXT = (".txt", ".md", ".json")
_TEXT_PREVIEW_MAX = 1024


class JobsQueryError(ValueError):
    """A bad query or body: answered with HTTP 400 and this message, as ComfyUI does."""


def _pruned(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def _meta(extra: dict) -> tuple[Any, Any]:
    """(create_time, workflow_id) from a prompt's extra_data (serve stamps create_time when it queues)."""
    return extra.get("create_time"), (extra.get("extra_pnginfo") or {}).get("workflow", {}).get("id")


def _file_item(item: Any) -> dict | None:
    """A list entry as a file dict: dicts as they are, a 3D file name as a dict, anything else None."""
    if isinstance(item, dict):
        return item
    if isinstance(item, str) and item.lower().endswith(_EXT_3D):
        return {"filename": item, "type": "output", "subfolder": "", "mediaType": "3d"}
    return None


def _previewable(media: str, item: dict) -> bool:
    fmt = item.get("format", "") or ""
    name = item.get("filename", "").lower()
    return (media in _PREVIEWABLE or fmt.startswith(("video/", "audio/")) or name.endswith(_EXT_3D)
            or name.endswith(_EXT_TEXT))


def _media_lists(outputs: dict) -> Iterable[tuple[str, str, list]]:
    for node_id, node_out in outputs.items():
        if isinstance(node_out, dict):
            for media, items in node_out.items():
                if media != "animated" and isinstance(items, list):  # "animated" is a flag, not outputs
                    yield node_id, media, items


def outputs_summary(outputs: dict) -> tuple[int, dict | None]:
    """(how many output files, the one to preview): a saved visual output first, then any visual one, then a
    saved text file, then raw text (which is shown but not counted)."""
    count, saved, visual, text_file, text = 0, None, None, None, None
    for node_id, media, items in _media_lists(outputs):
        for raw in items:
            item = _file_item(raw)
            if item is None:
                if media == "text" and text is None and saved is None:
                    value = (raw[0] if raw else "") if isinstance(raw, tuple) else str(raw)
                    text = {"content": value[:_TEXT_PREVIEW_MAX], **({"truncated": True}
                                                                     if len(value) > _TEXT_PREVIEW_MAX else {}),
                            "nodeId": node_id, "mediaType": media}
                continue
            count += 1
            if saved is not None or not _previewable(media, item):
                continue
            enriched = {**item, "nodeId": node_id, **({} if "mediaType" in item else {"mediaType": media})}
            if media == "text" or item.get("filename", "").lower().endswith(_EXT_TEXT):
                text_file = text_file or enriched
            elif item.get("type") == "output":
                saved = enriched
            else:
                visual = visual or enriched
    return count, saved or visual or text_file or text


def previewable_count(outputs: dict) -> int:
    return sum(1 for _, media, items in _media_lists(outputs) for raw in items
               if (item := _file_item(raw)) is not None and _previewable(media, item))


def _normalized_outputs(outputs: dict) -> dict:
    """Outputs as ``GET /api/jobs/{id}`` gives them: 3D file names as file dicts, None entries dropped."""
    out = {}
    for node_id, node_out in outputs.items():
        if not isinstance(node_out, dict):
            out[node_id] = node_out
            continue
        out[node_id] = {media: items if media == "animated" or not isinstance(items, list)
                        else [_file_item(i) or i for i in items if i is not None]
                        for media, items in node_out.items()}
    return out


def queue_job(item: tuple, status: str) -> dict:
    number, prompt_id, _, extra, _ = item[:5]
    create_time, workflow_id = _meta(extra)
    return _pruned({"id": prompt_id, "status": status, "priority": number, "create_time": create_time,
                    "outputs_count": 0, "previewable_outputs_count": 0, "workflow_id": workflow_id})


def history_job(prompt_id: str, entry: dict, full: bool = False) -> dict:
    number, _, prompt, extra, _ = entry["prompt"][:5]
    create_time, workflow_id = _meta(extra)
    status_info = entry.get("status") or {}
    start = end = error = None
    interrupted = False
    for message in status_info.get("messages", []):
        if isinstance(message, (list, tuple)) and len(message) >= 2 and isinstance(message[1], dict):
            name, data = message[0], message[1]
            if name == "execution_start":
                start = data.get("timestamp")
            elif name in ("execution_success", "execution_error", "execution_interrupted"):
                end = data.get("timestamp")
                error = data if name == "execution_error" else error
                interrupted = interrupted or name == "execution_interrupted"
    status = ((CANCELLED if interrupted else FAILED) if status_info.get("status_str") == "error" else COMPLETED)
    outputs = entry.get("outputs", {})
    count, preview = outputs_summary(outputs)
    job = _pruned({"id": prompt_id, "status": status, "priority": number, "create_time": create_time,
                   "execution_start_time": start, "execution_end_time": end, "execution_error": error,
                   "outputs_count": count, "previewable_outputs_count": previewable_count(outputs),
                   "preview_output": preview, "workflow_id": workflow_id})
    if full:
        job.update(outputs=_normalized_outputs(outputs), execution_status=status_info,
                   workflow={"prompt": prompt, "extra_data": extra})
    return job


def _sort_key(sort_by: str) -> Callable[[dict], Any]:
    if sort_by == "execution_duration":
        def key(j):
            s, e = j.get("execution_start_time", 0), j.get("execution_end_time", 0)
            return e - s if s and e else 0
        return key
    return lambda j: j.get("create_time", 0)


def encode_cursor(job: dict, sort_by: str = "created_at") -> str:
    """The opaque ``next_cursor`` that resumes just past ``job``: its id and sort key, as base64url JSON."""
    raw = json.dumps([job["id"], _sort_key(sort_by)(job)], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[str, Any]:
    """(job id, sort key) of a cursor from encode_cursor; JobsQueryError for anything else."""
    try:
        value = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        value = None
    if (not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], str)
            or not isinstance(value[1], (int, float)) or isinstance(value[1], bool)):
        raise JobsQueryError("after must be a pagination.next_cursor from an earlier GET /api/jobs reply")
    return value[0], value[1]


def _resume_at(jobs: list[dict], after: str, sort_by: str, descending: bool) -> int:
    """Where a page asked for with ``after`` starts in ``jobs`` (filtered and sorted as that cursor's page was).

    Just past the cursor's job when it is still listed, so jobs queued since (which sort first in the default
    newest-first order) shift nothing. If it left the list (a pending job that started, a status filter it
    no longer matches, history pruned), at the first job whose sort key lies strictly past the cursor's:
    none is repeated; jobs that share the vanished job's exact key (same millisecond) may be skipped."""
    job_id, cursor_key = decode_cursor(after)
    for i, job in enumerate(jobs):
        if job["id"] == job_id:
            return i + 1
    key = _sort_key(sort_by)
    for i, job in enumerate(jobs):
        if (key(job) < cursor_key) if descending else (key(job) > cursor_key):
            return i
    return len(jobs)


def _select(running: list, pending: list, history: dict, statuses: list[str] | None = None,
            workflow_id: str | None = None, sort_by: str = "created_at", sort_order: str = "desc",
            limit: int | None = None, offset: int = 0, after: str | None = None) -> tuple[list[dict], int, int]:
    """(every matching job in order, where the page starts, where it ends)."""
    wanted = set(STATUSES if statuses is None else statuses)  # status="," asks for none, as in ComfyUI
    jobs = []
    if IN_PROGRESS in wanted:
        jobs += [queue_job(i, IN_PROGRESS) for i in running]
    if PENDING in wanted:
        jobs += [queue_job(i, PENDING) for i in pending]
    if wanted & _HISTORY_STATUSES:
        jobs += [j for pid, e in history.items() if (j := history_job(pid, e))["status"] in wanted]
    if workflow_id:
        jobs = [j for j in jobs if j.get("workflow_id") == workflow_id]
    jobs = sorted(jobs, key=_sort_key(sort_by), reverse=sort_order == "desc")  # stable: ties keep queue order
    start = _resume_at(jobs, after, sort_by, sort_order == "desc") if after else max(0, offset)
    end = len(jobs) if limit is None else min(len(jobs), start + limit)
    return jobs, min(start, len(jobs)), end


def list_jobs(running: list, pending: list, history: dict, **query) -> tuple[list[dict], int]:
    """(the page of jobs, how many match): running, pending and finished jobs, filtered, sorted, paged, as
    ComfyUI's ``get_all_jobs``; ``query`` is parse_list_query's dict."""
    jobs, start, end = _select(running, pending, history, **query)
    return jobs[start:end], len(jobs)


def list_reply(running: list, pending: list, history: dict, **query) -> dict:
    """The body of ``GET /api/jobs``: ComfyUI's ``{"jobs", "pagination"}``, plus ``pagination.next_cursor``
    while more jobs follow. With ``after``, ``pagination.offset`` says where the page starts."""
    jobs, start, end = _select(running, pending, history, **query)
    pagination = {"offset": start if query.get("after") else query.get("offset", 0), "limit": query.get("limit"),
                  "total": len(jobs), "has_more": end < len(jobs)}
    if end < len(jobs) and end > start:
        pagination["next_cursor"] = encode_cursor(jobs[end - 1], query.get("sort_by", "created_at"))
    return {"jobs": jobs[start:end], "pagination": pagination}


def find_job(prompt_id: str, running: list, pending: list, history: dict) -> dict | None:
    if prompt_id in history:
        return history_job(prompt_id, history[prompt_id], full=True)
    for items, status in ((running, IN_PROGRESS), (pending, PENDING)):
        for item in items:
            if item[1] == prompt_id:
                return queue_job(item, status)
    return None


def parse_list_query(query) -> dict:
    """``GET /api/jobs``'s query as list_jobs arguments; JobsQueryError with ComfyUI's messages."""
    statuses = None
    if query.get("status"):
        statuses = [s.strip().lower() for s in query["status"].split(",") if s.strip()]
        bad = [s for s in statuses if s not in STATUSES]
        if bad:
            raise JobsQueryError(f"Invalid status value(s): {', '.join(bad)}. Valid values: {', '.join(STATUSES)}")
    sort_by = query.get("sort_by", "created_at").lower()
    if sort_by not in ("created_at", "execution_duration"):
        raise JobsQueryError("sort_by must be 'created_at' or 'execution_duration'")
    sort_order = query.get("sort_order", "desc").lower()
    if sort_order not in ("asc", "desc"):
        raise JobsQueryError("sort_order must be 'asc' or 'desc'")
    limit = None
    if "limit" in query:
        try:
            limit = int(query["limit"])
        except (TypeError, ValueError):
            raise JobsQueryError("limit must be an integer") from None
        if limit <= 0:
            raise JobsQueryError("limit must be a positive integer")
    offset = 0
    if "offset" in query:
        try:
            offset = max(0, int(query["offset"]))
        except (TypeError, ValueError):
            raise JobsQueryError("offset must be an integer") from None
    after = query.get("after") or None
    if after is not None:
        decode_cursor(after)  # a malformed cursor is a 400 before anything is listed
    return {"statuses": statuses, "workflow_id": query.get("workflow_id"), "sort_by": sort_by,
            "sort_order": sort_order, "limit": limit, "offset": offset, "after": after}


def is_job_id(value: Any) -> bool:
    """A prompt id as ComfyUI accepts one in a cancel batch: a UUID in canonical lowercase hyphenated form."""
    try:
        return isinstance(value, str) and str(uuid.UUID(value)) == value
    except ValueError:
        return False


def cancel(prompt_id: str, interrupt_if_running: Callable[[str], bool], dequeue: Callable[[str], bool]) -> bool:
    """Cancel one job whatever its state: dequeue it if pending, else interrupt it if it is the running one
    (both callables act atomically and say whether they did); a finished or unknown id is a no-op."""
    return dequeue(prompt_id) or interrupt_if_running(prompt_id)
