"""Progress and interruption for nodes: ComfyUI's bar and stop button, or tqdm + Ctrl-C.

ComfyUI is imported only when a node runs inside it. ``comfy run --wait`` treats
120 s without a websocket event as a failure, so every step and every cached
item reports progress, and step text (loss, lr, s/step, VRAM) is sent at least
every few seconds.
"""
from __future__ import annotations

import contextlib
import contextvars
import time

from ..engine.callbacks import ConsoleCallback, StepInfo, TrainingCallback


def _comfy():
    try:
        import comfy.model_management as mm  # type: ignore[import-not-found]
        import comfy.utils as cu  # type: ignore[import-not-found]
    except ImportError:
        return None
    return cu, mm


def _v3_progress():
    """ComfyUI's V3 progress call, ``ComfyAPISync().execution.set_progress(value, max, node_id, preview_image)``
    (comfy_api.latest, ComfyUI >= 0.3.4x); None in a ComfyUI without it."""
    try:
        from comfy_api.latest import ComfyAPISync  # type: ignore[import-not-found]
    except ImportError:
        return None
    return ComfyAPISync().execution.set_progress


#: Longest side of the sample grid shown as the node's preview (ComfyUI's own previews default to 512).
PREVIEW_SIZE = 1024


class ComfyCallback(TrainingCallback):
    """Drives ComfyUI's progress bar (with the sample grid as its preview), step text and interrupt button:
    through V3's ``set_progress`` where ComfyUI has it, else ``comfy.utils.ProgressBar``."""

    #: set_progress sends every call (ProgressBar throttles itself): at most this often, plus first and last.
    progress_interval_s = 0.1

    text_interval_s = 2.0
    #: The websocket text reaches the editor only; ``comfy run --wait`` users watch the server
    #: console, so a progress line is also printed there, this often (and at the first and last step).
    console_interval_s = 15.0

    def __init__(self, comfy_utils, model_management, node_id: str | None = None):
        self._utils, self._mm, self.node_id = comfy_utils, model_management, node_id
        self._bars: dict[str, object] = {}
        self._last_text = 0.0
        self._last_console: dict[str, float] = {}
        self._set_progress = _v3_progress() if node_id is not None else None
        self._last_progress = (float("-inf"), None)  # (time, (value, total)) of the last update sent
        self._train_step = (0, 1)  # (step, total) of the last step: samples at step 0 come before any step

    def _console(self, stage: str, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_console.get(stage, float("-inf")) >= self.console_interval_s:
            self._last_console[stage] = now
            print(f"[lowvram-lora] {text}", flush=True)

    def _bar(self, stage: str, total: int):
        bar = self._bars.get(stage)
        if bar is None:
            bar = self._bars[stage] = self._utils.ProgressBar(total)
        return bar

    def _send_text(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_text < self.text_interval_s:
            return
        self._last_text = now
        try:  # newer ComfyUI: text under the node; older ones lack it (the console lines still come)
            from server import PromptServer  # type: ignore[import-not-found]

            PromptServer.instance.send_progress_text(node_text(text), self.node_id)
        except Exception:
            pass

    def _progress(self, stage: str, done: int, total: int, preview=None) -> None:
        """The node's progress bar at done/total, with ``preview`` (a PIL image) as the node's image."""
        if self._set_progress is None:
            self._bar(stage, total).update_absolute(done, total, ("PNG", preview, PREVIEW_SIZE) if preview else None)
            return
        now = time.monotonic()
        last_time, last = self._last_progress
        if preview is None and (done, total) == last:
            return
        same_bar = last is not None and last[1] == total  # a new total (stage) is always shown
        if preview is None and same_bar and now - last_time < self.progress_interval_s and 0 < done < total:
            return
        self._last_progress = (now, (done, total))
        if preview is not None:
            preview = preview.convert("RGB")
            preview.thumbnail((PREVIEW_SIZE, PREVIEW_SIZE))
        self._set_progress(done, total, node_id=self.node_id, preview_image=preview,
                           ignore_size_limit=preview is not None)

    def on_progress(self, stage: str, done: int, total: int) -> None:
        self._progress(stage, done, total)
        self._send_text(f"{stage}: {done}/{total}", force=done >= total)
        self._console(stage, f"{stage}: {done}/{total}", force=done >= total)

    def on_step(self, info: StepInfo) -> None:
        self._train_step = (info.step, info.total_steps)
        self._progress("train", info.step, info.total_steps)
        text = format_step(info)
        self._send_text(format_step(info, lines=True), force=info.step in (1, info.total_steps))
        self._console("train", text, force=info.step in (1, info.total_steps))
        self._send_event(PROGRESS_EVENT, {
            "node": self.node_id, "step": info.step, "total": info.total_steps, "loss": info.loss, "lr": info.lr,
            "seconds_per_step": info.seconds_per_step,
            "eta_seconds": info.seconds_per_step * (info.total_steps - info.step),
            "peak_vram_gb": info.peak_vram_gb, "pinned_host_gb": info.pinned_host_gb,
            "host_ram_gb": info.host_ram_gb, "predicted_host_gb": info.predicted_host_gb,
            "sample_seconds": info.sample_seconds, "validation_loss": info.validation_loss})

    def on_sample(self, step: int, grid, path: str | None) -> None:
        """The grid becomes the node's preview image while training runs (the progress bar's preview, as
        ComfyUI's samplers show latents)."""
        done, total = self._train_step
        self._progress("train", done, total, preview=grid)
        self._console("samples", f"samples at step {step}: {path}", force=True)

    def on_resume(self, step: int, total: int, loss_history, lr_history) -> None:
        self._send_event(RESUME_EVENT, resume_event(self.node_id, step, total, loss_history, lr_history))

    def _send_event(self, event: str, data: dict) -> None:
        """A custom websocket event: web/lowvram_lora.js draws the live loss chart from these."""
        try:
            from server import PromptServer  # type: ignore[import-not-found]

            PromptServer.instance.send_sync(event, data)
        except Exception:
            pass

    def log(self, message: str) -> None:
        print(f"[lowvram-lora] {message}", flush=True)
        self._send_text(message, force=True)

    def should_stop(self) -> bool:
        # Raises ComfyUI's InterruptProcessingException when the user pressed stop; the
        # engine's finally-blocks free the GPU on the way out.
        self._mm.throw_exception_if_processing_interrupted()
        return False


#: The websocket event carrying each step's numbers to the node's live chart.
PROGRESS_EVENT = "lowvram_lora.progress"
#: Training resumed from a saved state: the losses and learning rates before it, so the chart goes on.
RESUME_EVENT = "lowvram_lora.resumed"
#: Characters per line of the text under a node at its usual width (~330 px): the frontends wrap longer lines
#: anywhere, mid-word ("6 i/mages"), so lines are broken between words here.
NODE_TEXT_WIDTH = 44


def node_text(message: str, width: int = NODE_TEXT_WIDTH) -> str:
    """A log line as the text under a node: absolute paths shortened to their last two parts (the console
    line keeps them whole), then wrapped between words and after '; ' to ``width`` characters."""
    import re
    import textwrap

    short = re.sub(r"'?(/[^\s':]+)+/([^/\s':]+/[^/\s':]+)'?", r"…/\2", message)
    lines = []
    parts = []
    for part in re.split(r"(?<=;)\s+|(?<=:)\s+(?=…/)|\n", short):
        head, sep, rest = part.partition(": ")
        parts += [head + ":", rest] if sep and len(part) > width else [part]  # "what: numbers", on two lines
    for part in parts:
        lines += textwrap.wrap(part, width, break_long_words=False, break_on_hyphens=False) or [""]
    return "\n".join(lines)


def resume_event(node_id, step: int, total: int, loss_history, lr_history) -> dict:
    return {"node": node_id, "step": step, "total": total, "loss": [float(v) for v in loss_history],
            "lr": [float(v) for v in lr_history]}


def format_step(info: StepInfo, lines: bool = False) -> str:
    """One step's numbers; ``lines``: on two lines, for the text under a node."""
    vram = f", VRAM {info.peak_vram_gb:.1f} GB" if info.peak_vram_gb else ""
    ram = (f", RAM {info.host_ram_gb:.1f} GB" + (f" (plan {info.predicted_host_gb:.1f})" if info.predicted_host_gb else "")
           + (f", {info.pinned_host_gb:.1f} pinned" if info.pinned_host_gb else "")) if info.host_ram_gb else ""
    return (f"step {info.step}/{info.total_steps}: loss {info.loss:.4f}" + ("\n" if lines else ", ")
            + f"lr {info.lr:.2e}, {info.seconds_per_step:.2f} s/step{vram}{ram}")


class HostCallback(TrainingCallback):
    """Inside ``lowvram-lora serve`` (host/serve.py): the same websocket messages ComfyUI's server sends
    (progress, progress text, preview image, our chart events), through the host object the server set
    with ``set_host``; the editor's stop button raises here. Console lines as in ComfyUI."""

    def __init__(self, host, node_id: str | None):
        self.host, self.node_id = host, node_id
        self._console = ComfyCallback._console.__get__(self)
        self._last_console: dict[str, float] = {}
        self._total = 0

    console_interval_s = ComfyCallback.console_interval_s

    def on_progress(self, stage: str, done: int, total: int) -> None:
        self.host.interrupt_check()
        self.host.progress(self.node_id, done, total)
        self.host.text(self.node_id, node_text(f"{stage}: {done}/{total}"))

    def on_step(self, info: StepInfo) -> None:
        self._total = info.total_steps
        self.host.progress(self.node_id, info.step, info.total_steps)
        text = format_step(info)
        self.host.text(self.node_id, node_text(format_step(info, lines=True)))
        self._console("train", text, force=info.step in (1, info.total_steps))
        self.host.event(PROGRESS_EVENT, {
            "node": self.node_id, "step": info.step, "total": info.total_steps, "loss": info.loss, "lr": info.lr,
            "seconds_per_step": info.seconds_per_step,
            "eta_seconds": info.seconds_per_step * (info.total_steps - info.step),
            "peak_vram_gb": info.peak_vram_gb, "pinned_host_gb": info.pinned_host_gb,
            "host_ram_gb": info.host_ram_gb, "predicted_host_gb": info.predicted_host_gb,
            "sample_seconds": info.sample_seconds, "validation_loss": info.validation_loss})

    def on_sample(self, step: int, grid, path: str | None) -> None:
        self.host.preview(self.node_id, grid)
        self._console("samples", f"samples at step {step}: {path}", force=True)

    def on_resume(self, step: int, total: int, loss_history, lr_history) -> None:
        self.host.event(RESUME_EVENT, resume_event(self.node_id, step, total, loss_history, lr_history))

    def log(self, message: str) -> None:
        print(f"[lowvram-lora] {message}", flush=True)
        self.host.text(self.node_id, node_text(message))

    def should_stop(self) -> bool:
        self.host.interrupt_check()  # raises the server's interrupt, as ComfyUI's stop button does
        return False


_host = None
#: Whether console callbacks draw tqdm bars: the headless runner's ``--no-progress`` turns them off for the
#: nodes it runs (``console_bars``).
_CONSOLE_BARS: contextvars.ContextVar[bool] = contextvars.ContextVar("lowvram_console_bars", default=True)


#: Libraries that draw their own tqdm bars while a node runs (transformers' "Loading weights" when a text
#: encoder loads), each with its switch.
_LIBRARY_BARS = ("transformers.utils.logging", "diffusers.utils.logging")


@contextlib.contextmanager
def console_bars(enabled: bool):
    """Within this block (this thread), nodes' console callbacks draw progress bars only if ``enabled``; when
    not, the libraries' own loading bars are off too (and put back as they were afterwards)."""
    import importlib

    token = _CONSOLE_BARS.set(bool(enabled))
    switched = []
    if not enabled:
        for name in _LIBRARY_BARS:
            try:
                lib = importlib.import_module(name)
            except ImportError:
                continue
            if lib.is_progress_bar_enabled():
                lib.disable_progress_bar()
                switched.append(lib)
    try:
        yield
    finally:
        for lib in switched:
            lib.enable_progress_bar()
        _CONSOLE_BARS.reset(token)


@contextlib.contextmanager
def node_library_bars():
    """Around a node's engine call: inside ComfyUI or ``serve`` the node shows its own progress, so the libraries'
    console bars (transformers' "Loading weights ... it/s" while a text encoder loads) are off: they only ran
    into the log's next line. Headless runs keep them unless ``--no-progress`` (``console_bars``)."""
    if _host is None and _comfy() is None:
        yield
        return
    with console_bars(False):
        yield


def set_host(host) -> None:
    """Called by ``lowvram-lora serve`` (host/serve.py) so nodes report to its websocket; None to stop."""
    global _host
    _host = host


def make_callback(node_id: str | None = None) -> TrainingCallback:
    """The right callback for where we run."""
    if _host is not None:
        return HostCallback(_host, node_id)
    comfy = _comfy()
    if comfy is None:
        return ConsoleCallback(bars=_CONSOLE_BARS.get())
    return ComfyCallback(comfy[0], comfy[1], node_id)


def free_comfy_vram() -> None:
    """Inside ComfyUI, unload the models it keeps on the GPU (a Flux generated a minute ago
    holds ~24 GB) before we cache or train: the offload plan sizes itself from free VRAM."""
    comfy = _comfy()
    if comfy is None:
        return
    mm = comfy[1]
    if hasattr(mm, "unload_all_models"):
        mm.unload_all_models()
    if hasattr(mm, "soft_empty_cache"):
        mm.soft_empty_cache()
