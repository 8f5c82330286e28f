"""The prompt queue of one ``lowvram-lora serve``: the prompts waiting, the one running, the finished ones' history
and the running one's stop request.

One lock guards all of it, and only this object takes it: the HTTP handlers (on the event loop) and the worker
thread change the queue through these methods, so no caller sees a half-made change (a prompt counted neither
waiting nor running) or stops a prompt that started since it looked. The forms returned (``entry``,
``snapshot``) are ComfyUI's (server.py, execution.py ``PromptQueue``).
"""
from __future__ import annotations

import threading
import time
import uuid


class PromptQueue:
    def __init__(self):
        self._lock = threading.Lock()
        self._wake = threading.Event()  # set while a prompt may be waiting
        self.pending: list[dict] = []
        self.running: dict | None = None
        self.history: dict[str, dict] = {}
        self.number = 0
        self.interrupt_flag = threading.Event()  # the running prompt's stop request

    # -- adding and taking ----------------------------------------------------------------------
    def add(self, prompt: dict, client_id: str | None, extra: dict, outputs: list[str]) -> dict:
        """Queue a (validated) prompt; returns its item: prompt_id, number, prompt, client_id, extra, outputs."""
        with self._lock:
            self.number += 1
            # As ComfyUI's POST /prompt: the client id and the time queued (ms) go into extra_data; /api/jobs
            # reports create_time, which the newer frontends require.
            extra = {**extra, **({"client_id": client_id} if client_id is not None else {}),
                     "create_time": int(time.time() * 1000)}
            item = {"prompt_id": str(uuid.uuid4()), "number": self.number, "prompt": prompt, "client_id": client_id,
                    "extra": extra, "outputs": outputs}
            self.pending.append(item)
        self._wake.set()
        return item

    def take(self) -> dict:
        """Wait for a prompt, make it the running one (its stop request cleared) and return it."""
        while True:
            self._wake.wait()
            with self._lock:
                if not self.pending:
                    self._wake.clear()
                    continue
                self.running = self.pending.pop(0)
                self.interrupt_flag.clear()
                return self.running

    def record(self, prompt_id: str, entry: dict) -> None:
        """The finished prompt's history entry (before its clients hear it ended: they may ask at once)."""
        with self._lock:
            self.history[prompt_id] = entry

    def finish(self) -> None:
        """The running prompt has ended."""
        with self._lock:
            self.running = None

    # -- reading --------------------------------------------------------------------------------
    def remaining(self) -> int:
        """Prompts not finished: the waiting ones and the running one."""
        with self._lock:
            return len(self.pending) + (1 if self.running else 0)

    def running_id(self) -> str | None:
        with self._lock:
            return self.running["prompt_id"] if self.running else None

    @staticmethod
    def entry(item: dict) -> tuple:
        """A queue item in ComfyUI's form: (number, prompt_id, prompt, extra_data, outputs_to_execute)."""
        return item["number"], item["prompt_id"], item["prompt"], item["extra"], item["outputs"]

    def snapshot(self) -> tuple[list, list, dict]:
        """(running, pending, history) in ComfyUI's forms, taken at one moment."""
        with self._lock:
            running = [self.entry(self.running)] if self.running else []
            return running, [self.entry(i) for i in self.pending], dict(self.history)

    def history_items(self) -> list[tuple[str, dict]]:
        """The history, oldest first."""
        with self._lock:
            return list(self.history.items())

    def history_entry(self, prompt_id: str) -> dict | None:
        with self._lock:
            return self.history.get(prompt_id)

    # -- removing and stopping --------------------------------------------------------------------
    def dequeue(self, prompt_id: str) -> bool:
        """Take a waiting prompt off the queue; False if it is not waiting."""
        with self._lock:
            kept = [i for i in self.pending if i["prompt_id"] != prompt_id]
            removed, self.pending = len(kept) != len(self.pending), kept
        return removed

    def remove(self, prompt_ids: list[str], clear: bool = False) -> None:
        """Take these waiting prompts (every one with ``clear``) off the queue."""
        with self._lock:
            if clear:
                self.pending.clear()
            drop = set(prompt_ids)
            self.pending = [i for i in self.pending if i["prompt_id"] not in drop]

    def forget(self, prompt_ids: list[str], clear: bool = False) -> None:
        """Delete these history entries (all of them with ``clear``)."""
        with self._lock:
            if clear:
                self.history.clear()
            for pid in prompt_ids:
                self.history.pop(pid, None)

    def interrupt(self) -> None:
        """Stop whatever prompt runs, at its next step."""
        self.interrupt_flag.set()

    def interrupt_if_running(self, prompt_id: str) -> bool:
        """Stop the running prompt only if it is this one (never one that started since the caller looked)."""
        with self._lock:
            if self.running is None or self.running["prompt_id"] != prompt_id:
                return False
            self.interrupt_flag.set()
            return True

    def interrupted(self) -> bool:
        return self.interrupt_flag.is_set()
