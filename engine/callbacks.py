"""How the engine reports progress and is asked to stop.

The engine never knows who is watching: ComfyUI's progress bar, the headless
runner's tqdm bar, or a test. It calls one small object.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class StepInfo:
    """What one optimizer step reports."""

    step: int  # 1-based optimizer step
    total_steps: int
    loss: float  # mean loss over the step's micro-batches
    lr: float
    grad_norm: float  # before clipping
    seconds_per_step: float
    peak_vram_gb: float  # torch.cuda.max_memory_allocated since training started; 0 on CPU
    pinned_host_gb: float = 0.0  # host RAM pinned for streamed blocks and activations
    sample_seconds: float = 0.0  # time spent sampling so far (not in seconds_per_step)
    breakdown: dict | None = None  # seconds per part of this step (engine/train/step_timing.py)
    # This process's host RAM now (engine/offload/hostmem.py: anonymous + shared resident pages, pinned buffers
    # included; a slab's mapped file pages are not) and the RAM plan's predicted peak (0: no plan).
    host_ram_gb: float = 0.0
    predicted_host_gb: float = 0.0
    validation_loss: float | None = None  # the held-out split's loss, on the steps validation ran (train/validation.py)


class TrainingCallback:
    """Override what you need; the defaults do nothing and never stop."""

    def on_progress(self, stage: str, done: int, total: int) -> None:
        """Long non-training work (caching, loading): ``done`` of ``total`` units of ``stage``."""

    def on_step(self, info: StepInfo) -> None:
        """After every optimizer step."""

    def on_sample(self, step: int, grid, path: str | None) -> None:
        """Sample images were made at ``step``: ``grid`` (a PIL image, prompts x checkpoints so far),
        saved at ``path``."""

    def on_resume(self, step: int, total: int, loss_history: list[float], lr_history: list[float]) -> None:
        """Training goes on from the saved state of ``step``: the losses and learning rates of steps 1..step,
        so a chart continues instead of starting empty."""

    def log(self, message: str) -> None:
        """A human-readable line (plans, cache hits, warnings)."""

    def should_stop(self) -> bool:
        """Polled between micro-steps and after every step but the last. True ends training
        cleanly: a partial step is dropped, finished steps are kept. May raise (ComfyUI's
        interrupt does); the engine frees the GPU on the way out."""
        return False


class StopRequest:
    """A stop asked for from outside the training code: the headless runner's Ctrl-C handler
    sets it (a signal handler can do little else safely); ``ConsoleCallback`` sees it at the
    next poll, and the engine then saves its state and unwinds."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def request(self) -> None:
        self._event.set()

    def reset(self) -> None:
        self._event.clear()

    @property
    def requested(self) -> bool:
        return self._event.is_set()


#: Set by ``lowvram-lora run`` on Ctrl-C; reset at the start of every run.
CTRL_C = StopRequest()


class ConsoleCallback(TrainingCallback):
    """tqdm bars and printed lines, for the CLI and the headless runner. ``bars=False`` (``--no-progress``):
    no bars at all; log lines and the final summary line are still printed."""

    def __init__(self, bars: bool = True) -> None:
        self._bars: dict[str, object] = {}
        self.stop_requested = False
        self.show_bars = bars

    def _bar(self, stage: str, total: int):
        from tqdm.auto import tqdm

        bar = self._bars.get(stage)
        if bar is None:
            bar = self._bars[stage] = tqdm(total=total, desc=stage, dynamic_ncols=True, disable=not self.show_bars)
        return bar

    def on_progress(self, stage: str, done: int, total: int) -> None:
        if CTRL_C.requested:  # caching: every entry is written atomically, stopping here loses nothing
            raise KeyboardInterrupt(f"stopped with Ctrl-C during {stage}")
        bar = self._bar(stage, total)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()
            self._bars.pop(stage, None)

    def on_step(self, info: StepInfo) -> None:
        bar = self._bar("train", info.total_steps)
        bar.set_postfix(
            loss=f"{info.loss:.4f}", lr=f"{info.lr:.2e}", s_it=f"{info.seconds_per_step:.2f}",
            **({"vram": f"{info.peak_vram_gb:.1f}G"} if info.peak_vram_gb else {}),
            **({"ram": f"{info.host_ram_gb:.1f}G"} if info.host_ram_gb else {}), refresh=False,
        )
        bar.update(info.step - bar.n)
        if info.step >= info.total_steps:
            bar.close()
            self._bars.pop("train", None)
            from tqdm.auto import tqdm

            tqdm.write(f"trained {info.step} steps: final loss {info.loss:.4f}, {info.seconds_per_step:.2f} s/step"
                       + (f", peak VRAM {info.peak_vram_gb:.2f} GB" if info.peak_vram_gb else "")  # 0 on a CPU run
                       + (f", host RAM {info.host_ram_gb:.1f} GB" if info.host_ram_gb else "")
                       + (f" (predicted {info.predicted_host_gb:.1f})" if info.host_ram_gb and info.predicted_host_gb
                          else "")
                       + (f", pinned host RAM {info.pinned_host_gb:.1f} GB" if info.pinned_host_gb else "")
                       + (f", sampling {info.sample_seconds:.1f} s" if info.sample_seconds else ""))

    def on_sample(self, step: int, grid, path: str | None) -> None:
        if path:
            from tqdm.auto import tqdm

            tqdm.write(f"samples at step {step}: {path}")

    def log(self, message: str) -> None:
        from tqdm.auto import tqdm

        tqdm.write(message)

    def should_stop(self) -> bool:
        """Ctrl-C raises KeyboardInterrupt here, between steps: the engine writes its resumable
        state first, then the runner exits with 130."""
        if CTRL_C.requested:
            raise KeyboardInterrupt("stopped with Ctrl-C")
        return self.stop_requested
