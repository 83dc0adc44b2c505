"""What `TowerTrainer.fit` tells the user: the progress it shows (a bar on a terminal, one line per epoch
otherwise, nothing when asked), the summary it returns, prints and logs (the line `ncclavg train` ends
with), and the sentence for a fit with nothing left to train.

Note [Progress of fit]
fit() reports like Keras's `verbose` or Lightning's progress bar, in the process that prints (rank 0
under torchrun, see Note [Towers of several processes] in distributed.py):
- progress=None (the default): a tqdm bar per epoch on stderr when stderr is a terminal, one line per
  epoch on stdout otherwise (a log file, a notebook cell's captured output, a pipe), so a
  non-interactive run never fills a file with carriage returns;
- "bar" (or True): the bar wherever stderr goes; "lines": the epoch lines; False: nothing printed.
The bar needs tqdm (the `train` extra); without it the epoch lines are shown instead. A bar stays on
screen after its epoch with the epoch's figures (test accuracy included), so a finished run reads as
the epoch lines would. Whatever is shown, fit() ends by printing the summary line (not with
progress=False), logging it at INFO on the `ncclavg.train` logger, and returning it as
`history.summary`.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any, Sequence

from .callbacks import Callback, EpochPrinter, ProgressCallback

log = logging.getLogger("ncclavg.train")


@dataclasses.dataclass(frozen=True)
class FitSummary:
    """The figures of one fit() (or of one `ncclavg train`): `line()` is the summary line both print.

    test_accuracy: on the eval loader after the last step (None without one, or for a task without class
    targets); epochs: epochs completed in total (a resumed trainer counts the saved ones); samples_per_s:
    training samples per second of step time (evaluation excluded); wall_s: the fit's wall time, its
    evaluations included (not the imports, data loading or model building before it); processes, towers
    (of every process), devices (this process's)."""
    test_accuracy: float | None
    epochs: int
    samples_per_s: float
    wall_s: float
    processes: int
    towers: int
    devices: tuple[str, ...]
    steps: int = 0   # optimizer steps this fit took
    # this host's straggler report over the fit's collectives (transport/stragglers.py); None without one
    stragglers: Any = None

    def line(self) -> str:
        acc = "nan" if self.test_accuracy is None else f"{self.test_accuracy:.3f}"
        return (f"summary: test_accuracy={acc} epochs={self.epochs} samples_per_s={self.samples_per_s:.1f} "
                f"wall_s={self.wall_s:.1f} processes={self.processes} towers={self.towers} "
                f"devices={','.join(self.devices)}")

    def __str__(self) -> str:
        return self.line()


class FitHistory(list):
    """What fit() returns: the epoch records (a list, as before), with the run's `summary` (FitSummary; None
    when the fit had nothing left to train)."""

    def __init__(self, records: Sequence[dict], summary: FitSummary | None = None):
        super().__init__(records)
        self.summary = summary


def progress_mode(progress: Any, prints: bool, stream: Any = None) -> str | None:
    """"bar", "lines" or None (nothing shown) for fit(progress=...) in a process that prints or not.
    See Note [Progress of fit]."""
    if not (progress is None or isinstance(progress, bool) or progress in ("bar", "lines")):
        raise ValueError(f"progress: must be None (a bar on a terminal, epoch lines otherwise), True or 'bar', "
                         f"'lines' or False, got {progress!r}")
    if not prints or progress is False:
        return None
    if progress == "lines":
        return "lines"
    stream = stream if stream is not None else sys.stderr
    if progress is None and not _isatty(stream):
        return "lines"
    return "bar" if _have_tqdm() else "lines"


def reporters(mode: str | None) -> list[Callback]:
    """The callbacks that show `mode`'s progress; they run before the user's own."""
    if mode == "bar":
        return [ProgressCallback(enabled=True)]
    if mode == "lines":
        return [EpochPrinter(sys.stdout)]
    return []


def show_summary(summary: FitSummary, mode: str | None) -> None:
    """The summary line; before it, a warning when the straggler report named a rank that held the others
    back (Note [The straggler report])."""
    rep = summary.stragglers
    if rep is not None and rep.named:
        if mode is not None:
            print(f"warning: {rep.summary()}", file=sys.stdout, flush=True)
        log.warning("%s", rep.summary())
    if mode is not None:
        print(summary.line(), file=sys.stdout, flush=True)
    log.info("%s", summary.line())


def nothing_left(trainer: Any, epochs: int, max_steps: int | None, epoch: int | None = None) -> str | None:
    """Why a fit of `epochs` epochs in total (and `max_steps` steps) has nothing to train, in facts both
    fit() and `ncclavg train` word for their callers; None when there is something to train. `epoch`:
    the epoch the fit would start in (fit's loop follows a resumable loader's), default the trainer's."""
    epoch = trainer.epoch if epoch is None else epoch
    if max_steps is not None and trainer.step >= max_steps:
        return f"step {trainer.step} reached, max_steps is {max_steps}"
    if epoch >= epochs:
        return f"epoch {epoch} reached (step {trainer.step}), epochs is {epochs}"
    return None


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):   # no isatty, or a closed stream
        return False


def _have_tqdm() -> bool:
    try:
        import tqdm  # noqa: F401  (the `train` extra; optional)
    except ImportError:
        return False
    return True
