"""Callbacks for `TowerTrainer.fit`: metrics to JSON lines, a progress bar, periodic checkpoints and the
loss/accuracy plot. A callback may set `trainer.stop_training = True` to end `fit` after the current step.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Sequence

from .checkpoint import CheckpointManager
from .metrics import JsonlWriter, ProgressBar, plot_history


class Callback:
    """Override any of these; `record` is the dict that also goes to the metrics file. `fit` ends with
    exactly one of on_fit_end (it returned: the epochs ran out, max_steps, or stop_training) and
    on_fit_error (it is raising).

    Note [Callbacks when fit fails]
    When a step, a loader or a callback raises, the trainer's state is whatever the failure left: a step
    may have stopped between the gradient average and the master update, and a communicator that lost a
    peer can run no collective. So a failing fit calls on_fit_error, never on_fit_end: the checkpoint
    callback saves nothing then (saving is a collective, and a state of unknown consistency must not
    become the newest checkpoint that an elastic restart resumes from: the last periodic one stands),
    while the metrics file records the error and closes, and the bar closes. An exception that
    on_fit_error raises is added to the training error as a note; the training error propagates.
    """

    def on_fit_start(self, trainer: Any) -> None: ...

    def on_epoch_start(self, trainer: Any, epoch: int) -> None: ...

    def on_step_end(self, trainer: Any, record: dict) -> None: ...

    def on_epoch_end(self, trainer: Any, record: dict) -> None: ...

    def on_fit_end(self, trainer: Any, history: Sequence[dict]) -> None: ...

    def on_fit_error(self, trainer: Any, error: BaseException) -> None: ...


class MetricsLogger(Callback):
    """One JSON object per line: {"event": "step", ...} every `every` steps, {"event": "epoch", ...}
    after each epoch (with the evaluation, when fit has an eval loader), {"event": "fit_end", ...}, or
    {"event": "fit_error", "error": ...} when fit raises."""

    def __init__(self, path: str | os.PathLike, every: int = 1, append: bool = False):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every: must be a positive integer, got {every!r}")
        self.writer = JsonlWriter(path, append=append)
        self.path = self.writer.path
        self.every = every

    def on_fit_start(self, trainer: Any) -> None:
        self.writer.write({"event": "fit_start", "step": trainer.step, **trainer.describe()})

    def on_step_end(self, trainer: Any, record: dict) -> None:
        if record["step"] % self.every == 0:
            self.writer.write({"event": "step", **record})

    def on_epoch_end(self, trainer: Any, record: dict) -> None:
        self.writer.write({"event": "epoch", **record})

    def on_fit_end(self, trainer: Any, history: Sequence[dict]) -> None:
        self.writer.write({"event": "fit_end", "step": trainer.step, "epochs": len(history)})
        self.writer.close()

    def on_fit_error(self, trainer: Any, error: BaseException) -> None:
        try:
            self.writer.write({"event": "fit_error", "step": trainer.step, "epochs": len(trainer.history),
                               "error": f"{type(error).__name__}: {error}"})
        finally:
            self.writer.close()


class ProgressCallback(Callback):
    """A tqdm bar per epoch (ProgressBar); each stays on screen with its epoch's figures."""

    def __init__(self, enabled: bool = True, stream: Any = None):
        self.bar = ProgressBar(enabled=enabled, stream=stream)

    def on_epoch_start(self, trainer: Any, epoch: int) -> None:
        total, done = trainer.epoch_progress()
        self.bar.start_epoch(epoch, trainer.target_epochs, total, initial=done)

    def on_step_end(self, trainer: Any, record: dict) -> None:
        self.bar.update(record.get("loss"), record.get("accuracy"), record.get("samples_per_s"))

    def on_epoch_end(self, trainer: Any, record: dict) -> None:
        self.bar.finish(record)

    def on_fit_end(self, trainer: Any, history: Sequence[dict]) -> None:
        self.bar.close()

    def on_fit_error(self, trainer: Any, error: BaseException) -> None:
        self.bar.close()


class CheckpointCallback(Callback):
    """Saves `trainer.save(...)` into `directory` every `every_epochs` epochs and/or `every_steps`
    steps, keeping the newest `keep` complete files, and once more at the end of a fit that returns
    (not of one that raises: Note [Callbacks when fit fails])."""

    def __init__(self, directory: str | os.PathLike, every_epochs: int | None = 1,
                 every_steps: int | None = None, keep: int = 2, prefix: str = "ckpt"):
        for name, v in (("every_epochs", every_epochs), ("every_steps", every_steps)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}: must be a positive integer or None, got {v!r}")
        self.manager = CheckpointManager(directory, keep=keep, prefix=prefix)
        self.every_epochs, self.every_steps = every_epochs, every_steps
        self.last_path: str | None = None
        self._last_step: int | None = None

    def _save(self, trainer: Any) -> None:
        if self._last_step == trainer.step:
            return
        self.last_path = trainer.save(self.manager.path_for(trainer.step), _manager=self.manager)
        self._last_step = trainer.step

    def on_step_end(self, trainer: Any, record: dict) -> None:
        if self.every_steps and trainer.step % self.every_steps == 0:
            self._save(trainer)

    def on_epoch_end(self, trainer: Any, record: dict) -> None:
        if self.every_epochs and (record["epoch"]) % self.every_epochs == 0:
            self._save(trainer)

    def on_fit_end(self, trainer: Any, history: Sequence[dict]) -> None:
        self._save(trainer)


class PlotCallback(Callback):
    """Writes the PNG of loss and accuracy per epoch at the end of fit (and after each epoch when
    `every_epoch`, so an interrupted run still leaves a plot; a fit that raises also plots the epochs it
    completed: the file is local and the history is final)."""

    def __init__(self, path: str | os.PathLike, title: str | None = None, every_epoch: bool = False):
        self.path = os.fspath(path)
        self.title = title
        self.every_epoch = every_epoch

    def on_epoch_end(self, trainer: Any, record: dict) -> None:
        if self.every_epoch:
            plot_history(trainer.history, self.path, self.title)

    def on_fit_end(self, trainer: Any, history: Sequence[dict]) -> None:
        if history:
            plot_history(history, self.path, self.title)

    def on_fit_error(self, trainer: Any, error: BaseException) -> None:
        self.on_fit_end(trainer, trainer.history)


class EpochPrinter(Callback):
    """One line per epoch (loss, accuracy, test accuracy, samples/s) on `stream` (default stdout)."""

    def __init__(self, stream: Any = None):
        self.stream = stream

    def on_epoch_end(self, trainer: Any, record: dict) -> None:
        parts = [f"epoch {record['epoch']}/{trainer.target_epochs}"]
        if record.get("loss") is not None:
            parts.append(f"loss {record['loss']:.4f}")
        if record.get("accuracy") is not None:
            parts.append(f"acc {record['accuracy']:.3f}")
        if record.get("val_accuracy") is not None:
            parts.append(f"test_acc {record['val_accuracy']:.3f}")
        if record.get("samples_per_s"):
            parts.append(f"{record['samples_per_s']:.0f} samples/s")
        print("  ".join(parts), file=self.stream if self.stream is not None else sys.stdout, flush=True)


class OutputsReport(Callback):
    """`ncclavg train`'s lines saying where the metrics, checkpoints and plot went, once they are written
    (its last callback, so they come just before fit's summary line)."""

    def __init__(self, say: Any, metrics: Any, saver: Any, plot: Any, checkpoint_dir: str | None):
        self.say, self.metrics, self.saver, self.plot, self.checkpoint_dir = say, metrics, saver, plot, checkpoint_dir

    def on_fit_end(self, trainer: Any, history: Any) -> None:
        say = self.say
        say(f"metrics: {os.path.abspath(self.metrics.path)}" if self.metrics else
            "metrics: not written (pass --metrics FILE)")
        if self.saver:
            say(f"checkpoints: {os.path.abspath(self.checkpoint_dir)} (latest: {self.saver.last_path})")
        else:
            say("checkpoints: not written (pass --checkpoint-dir DIR)")
        if self.plot and trainer.history:
            say(f"plot: {os.path.abspath(self.plot.path)}")
        else:
            say("plot: not written (pass --plot [FILE])" if not self.plot else "plot: not written (no completed epoch)")
