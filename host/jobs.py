"""``/api/jobs`` for ``lowvram-lora serve``: the queue and history as one list of jobs.

Frontends from about 1.5x on (1.58.1 checked) fill their queue and history panels only from
``GET /api/jobs?status=in_progress,pending&limit=..&offset=..`` and ``GET /api/jobs/{id}``, and cancel with
``POST /api/jobs/{id}/cancel`` or ``POST /api/jobs/cancel``; without these routes the queue reads "0 active"
while a prompt trains. The shapes and rules here are ComfyUI 0.33's (``comfy_execution/jobs.py`` and the
routes in ``server.py``), written again for our queue: tests/test_host_jobs.py runs ComfyUI's own functions on
the same queue and history and compares the JSON.

Inputs are ComfyUI's forms: a queue item is ``(number, prompt_id, prompt, extra_data, outputs_to_execute)``,
a history entry ``{"prompt": (that tuple), "outputs", "status": {"status_str", "messages"}}``.
"""
from __future__ import annotations

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


def list_jobs(running: list, pending: list, history: dict, statuses: list[str] | None = None,
              workflow_id: str | None = None, sort_by: str = "created_at", sort_order: str = "desc",
              limit: int | None = None, offset: int = 0) -> tuple[list[dict], int]:
    """(the page of jobs, how many match): running, pending and finished jobs, filtered, sorted, paged."""
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
    if sort_by == "execution_duration":
        def key(j):
            s, e = j.get("execution_start_time", 0), j.get("execution_end_time", 0)
            return e - s if s and e else 0
    else:
        def key(j):
            return j.get("create_time", 0)
    jobs = sorted(jobs, key=key, reverse=sort_order == "desc")
    total = len(jobs)
    jobs = jobs[offset:] if offset > 0 else jobs
    return (jobs[:limit] if limit is not None else jobs), total


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
    return {"statuses": statuses, "workflow_id": query.get("workflow_id"), "sort_by": sort_by,
            "sort_order": sort_order, "limit": limit, "offset": offset}


def page(jobs: list[dict], total: int, limit: int | None, offset: int) -> dict:
    return {"jobs": jobs, "pagination": {"offset": offset, "limit": limit, "total": total,
                                         "has_more": offset + len(jobs) < total}}


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
