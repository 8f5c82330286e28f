"""Training logs: a CSV of every step, and TensorBoard event files, written while the run goes.

``RunLog`` wraps the run's callback (the engine reports to it as to any callback, and it passes everything on), so
the loop has no logging code. Columns: step, loss, validation_loss (empty on steps without validation), lr,
seconds_per_step, peak_vram_gb, host_ram_gb. TensorBoard uses torch's own ``SummaryWriter``; the ``tensorboard``
package it needs is optional: without it the run goes on, says so once, and writes the CSV alone.

Open them: the CSV in any spreadsheet; TensorBoard with ``tensorboard --logdir <folder>``.
"""
from __future__ import annotations

import csv
from pathlib import Path

from ..callbacks import StepInfo, TrainingCallback

COLUMNS = ("step", "loss", "validation_loss", "lr", "seconds_per_step", "peak_vram_gb", "host_ram_gb")
CSV_NAME = "training_log.csv"


def open_summary_writer(folder: Path, log):
    """torch's SummaryWriter on ``folder``, or None (said through ``log``) when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log("TensorBoard logs are off: the optional 'tensorboard' package is not installed (pip install tensorboard); "
            f"the CSV log is written to {folder / CSV_NAME}")
        return None
    return SummaryWriter(log_dir=str(folder))


class RunLog(TrainingCallback):
    """Writes every step to ``folder``/training_log.csv (and TensorBoard when asked and installed), then passes the
    call to ``inner``. Files are new in a folder of the run's own; ``close`` ends them."""

    def __init__(self, inner: TrainingCallback, folder: str | Path, tensorboard: bool = True):
        self.inner = inner
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.csv_path = self.folder / CSV_NAME
        new = not self.csv_path.exists()  # a resumed run goes on in the same file
        self._file = open(self.csv_path, "a", newline="", encoding="utf-8")
        self._csv = csv.writer(self._file)
        if new:
            self._csv.writerow(COLUMNS)
        self.writer = open_summary_writer(self.folder, inner.log) if tensorboard else None

    def on_step(self, info: StepInfo) -> None:
        val = info.validation_loss
        self._csv.writerow([info.step, f"{info.loss:.6g}", "" if val is None else f"{val:.6g}", f"{info.lr:.6g}",
                            f"{info.seconds_per_step:.4f}", f"{info.peak_vram_gb:.3f}", f"{info.host_ram_gb:.3f}"])
        self._file.flush()
        if self.writer is not None:
            w, s = self.writer, info.step
            w.add_scalar("loss/train", info.loss, s)
            if val is not None:
                w.add_scalar("loss/validation", val, s)
            w.add_scalar("lr", info.lr, s)
            w.add_scalar("time/seconds_per_step", info.seconds_per_step, s)
            w.add_scalar("memory/peak_vram_gb", info.peak_vram_gb, s)
            w.add_scalar("memory/host_ram_gb", info.host_ram_gb, s)
            w.flush()
        self.inner.on_step(info)

    def close(self) -> None:
        self._file.close()
        if self.writer is not None:
            self.writer.close()

    # Everything else goes to the wrapped callback as it is.
    def on_progress(self, stage, done, total):
        self.inner.on_progress(stage, done, total)

    def on_sample(self, step, grid, path):
        self.inner.on_sample(step, grid, path)

    def on_resume(self, step, total, loss_history, lr_history):
        self.inner.on_resume(step, total, loss_history, lr_history)

    def log(self, message):
        self.inner.log(message)

    def should_stop(self):
        return self.inner.should_stop()
