"""Step timing, JSON-lines metrics, the progress bar and the loss/accuracy plot."""
from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

PHASES = ("compute", "reduce", "offload", "optimizer", "broadcast")


class StepTimes:
    """Wall time per phase of one step, in seconds.

    compute: forward+backward of all towers (they run concurrently: the wall time of the slowest);
    reduce: gradient averaging; offload: device<->host copies of the CPU-master path; optimizer: the
    update (for master="cpu" on CPU towers this is the fused average+update, reduce is then 0);
    broadcast: copying new weights back into the towers. Pipelined phases overlap on GPUs, so there
    the phases are the time the host waited for each, and they need not sum to the step time.
    """

    def __init__(self) -> None:
        self.times = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times the phase `name`; while torch's profiler runs it is also the range `ncclavg:train:<name>`."""
        from ..transport import profiling   # here: this module is read by torch-free commands too

        t0 = time.perf_counter()
        try:
            with profiling.phase(f"train:{name}"):
                yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.times[name] = self.times.get(name, 0.0) + float(seconds)

    def as_dict(self, prefix: str = "t_") -> dict:
        return {prefix + k: round(v, 7) for k, v in self.times.items()}


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null rather than producing an unreadable line."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        try:
            return _clean(value.item())
        except (TypeError, ValueError):
            return str(value)
    return value


class JsonlWriter:
    """Appends one JSON object per line. The file is created on the first record, so a run that fails
    validation writes nothing."""

    def __init__(self, path: str | os.PathLike, append: bool = False):
        self.path = os.fspath(path)
        self._append = append
        self._f = None

    def write(self, record: dict) -> None:
        if self._f is None:
            parent = os.path.dirname(os.path.abspath(self.path))
            os.makedirs(parent, exist_ok=True)
            self._f = open(self.path, "a" if self._append else "w", encoding="utf-8")
        self._f.write(json.dumps(_clean(record), sort_keys=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class ProgressBar:
    """tqdm over the steps of one epoch showing loss, accuracy and samples/s; a no-op without tqdm or
    when disabled."""

    def __init__(self, enabled: bool = True, stream: Any = None):
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self._bar = None

    def start_epoch(self, epoch: int, epochs: int | None, total_steps: int | None, initial: int = 0) -> None:
        self.close()
        if not self.enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:  # optional dependency
            self.enabled = False
            return
        desc = f"epoch {epoch + 1}" + (f"/{epochs}" if epochs else "")
        self._bar = tqdm(total=total_steps, initial=initial, desc=desc, unit="step", file=self.stream,
                         leave=True, dynamic_ncols=True)

    def update(self, loss: float | None, acc: float | None, samples_per_s: float | None) -> None:
        if self._bar is None:
            return
        post = {}
        if loss is not None:
            post["loss"] = f"{loss:.4f}"
        if acc is not None:
            post["acc"] = f"{acc:.3f}"
        if samples_per_s is not None:
            post["samples/s"] = f"{samples_per_s:.0f}"
        self._bar.set_postfix(post, refresh=False)
        self._bar.update(1)

    def finish(self, record: dict) -> None:
        """Leaves the epoch's bar on screen with the epoch's figures: its means, the test accuracy."""
        if self._bar is None:
            return
        post = {}
        for key, label, fmt in (("loss", "loss", ".4f"), ("accuracy", "acc", ".3f"),
                                ("val_accuracy", "test_acc", ".3f"), ("samples_per_s", "samples/s", ".0f")):
            if record.get(key) is not None:
                post[label] = format(record[key], fmt)
        self._bar.set_postfix(post, refresh=True)
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def plot_history(history: Sequence[dict], path: str | os.PathLike, title: str | None = None) -> str:
    """PNG with loss (left) and accuracy (right) per epoch from the epoch records of `fit`. Needs
    matplotlib (the `plot` extra); uses the non-interactive Agg backend."""
    fig = history_figure(history, title)
    import matplotlib.pyplot as plt

    try:
        fig.tight_layout()
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


def history_figure(history: Sequence[dict], title: str | None = None) -> Any:
    """The matplotlib figure plot_history saves (the caller closes it). Epochs are whole: the epoch axes
    tick at integers only (matplotlib's default locator puts ticks at 2.5, 7.5 for ten epochs, and at
    0.96, 0.98, ... for one)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install 'ncclavg[plot]'") from e
    if not history:
        raise ValueError("history: no epoch records to plot")
    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    try:
        for ax, keys, ylabel in ((ax_loss, (("loss", "train loss"), ("val_loss", "test loss")), "loss"),
                                 (ax_acc, (("accuracy", "train accuracy"), ("val_accuracy", "test accuracy")),
                                  "accuracy")):
            for key, label in keys:
                ys = [h.get(key) for h in history]
                if any(y is not None for y in ys):
                    ax.plot(epochs, [math.nan if y is None else y for y in ys], marker="o", label=label)
            ax.set_xlabel("epoch")
            ax.set_ylabel(ylabel)
            if max(epochs) - min(epochs) < 3:   # too short a span for the locator: tick every epoch
                ax.set_xticks(range(min(epochs), max(epochs) + 1))
                ax.set_xlim(min(epochs) - 0.5, max(epochs) + 0.5)
            else:
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend()
            ax.grid(alpha=0.3)
        if title:
            fig.suptitle(title)
    except BaseException:
        plt.close(fig)
        raise
    return fig
