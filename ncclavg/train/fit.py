"""TowerTrainer.fit: epochs of train_step over a loader, the callbacks around them, and one record per
epoch (means over the epoch's steps, the evaluation when there is an eval loader).

`FitLoop` is a mixin of TowerTrainer (trainer.py) and works on its attributes: `step`, `epoch`,
`history`, `stop_training`, the loader being fitted, the running sums of the current epoch. It holds
no state of its own.
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Sequence

from .callbacks import Callback
from .fit_report import FitHistory, FitSummary, log, nothing_left, progress_mode, reporters, show_summary
from .metrics import PHASES


class FitLoop:
    """The epoch loop of TowerTrainer: fit(), and what it reports (epoch records, `last_fit`,
    `last_summary`)."""

    last_summary: FitSummary | None = None   # the summary of the last fit that trained
    # where the fit's and the epoch's straggler windows start (a report's `logged`; None: the whole log)
    _fit_mark: int | None = None
    _straggler_mark: int | None = None

    @staticmethod
    def _new_epoch_acc() -> dict:
        return {"loss_sum": 0.0, "samples": 0, "correct": 0, "train_s": 0.0, **{"t_" + k: 0.0 for k in PHASES}}

    def epoch_progress(self) -> tuple[int | None, int]:
        """(batches per epoch, batches done in the current epoch) of the loader being fitted."""
        total = len(self._loader) if hasattr(self._loader, "__len__") else None
        return total, int(getattr(self._loader, "batch", 0) or 0)

    def fit(self, loader: Iterable, epochs: int = 1, eval_loader: Iterable | None = None,
            callbacks: Sequence[Callback] = (), max_steps: int | None = None,
            progress: bool | str | None = None) -> FitHistory:
        """Train until `epochs` epochs are complete in total (a resumed trainer continues where its
        checkpoint stopped) or `max_steps` optimizer steps were taken in total. Returns the history of
        epoch records (a list) whose `summary` (FitSummary) holds the line `ncclavg train` ends with; that
        line is printed (unless progress=False) and logged. `progress`: None shows a bar on a terminal and
        one line per epoch otherwise, "bar" (True) or "lines" choose, False prints nothing (Note [Progress
        of fit] in fit_report.py). A trainer with nothing left to train says so and returns at once.
        A loader with state_dict/load_state_dict/epoch (TensorLoader) is resumable mid-epoch; any other
        iterable of (inputs..., target) batches is iterated once per epoch."""
        nominal = self._check_fit_args(loader, epochs, max_steps, callbacks)
        mode = progress_mode(progress, self.is_main)
        resumable = all(hasattr(loader, a) for a in ("state_dict", "load_state_dict", "epoch"))
        # the epoch the loop below starts from: a resumable loader's (as restored from a checkpoint) or ours
        start = (dict(self._data_state or {}).get("epoch", loader.epoch) if resumable else self.epoch)
        done = nothing_left(self, epochs, max_steps, int(start))
        if done is not None:   # every process decides alike: the same checkpoint, the same arguments
            self._say(f"nothing to train: {done}; fit() returns without a step", mode)
            return FitHistory(self.history)
        callbacks = reporters(mode) + list(callbacks)
        if resumable and self._data_state is not None:
            loader.load_state_dict(self._data_state)
        self._data_state = None
        steps_per_epoch = len(loader) if hasattr(loader, "__len__") else None
        self.plan_schedule(steps_per_epoch, epochs, max_steps)
        self._loader, self.target_epochs, self.stop_training = loader, epochs, False
        t_fit, step0 = time.perf_counter(), self.step
        mark = self.straggler_report(calls=1)   # the fit's and its first epoch's windows start here
        self._fit_mark = self._straggler_mark = None if mark is None else mark.logged
        for cb in callbacks:
            cb.on_fit_start(self)
        totals = [0, 0.0]   # samples and training seconds of this fit, kept up to date for a failure's record
        try:
            self._run_epochs(loader, epochs, max_steps, nominal, resumable, eval_loader, callbacks, totals)
        except BaseException as error:   # See Note [Callbacks when fit fails] in callbacks.py
            self._note_fit(totals[0], totals[1], t_fit)
            for cb in callbacks:
                try:
                    cb.on_fit_error(self, error)
                except Exception as cb_error:   # the training error is the one to see; this one rides along
                    error.add_note(f"while handling it, {type(cb).__name__}.on_fit_error raised "
                                   f"{type(cb_error).__name__}: {cb_error}")
            raise
        self._note_fit(totals[0], totals[1], t_fit)
        for cb in callbacks:
            cb.on_fit_end(self, self.history)
        summary = self._summary(eval_loader, t_fit, step0)
        if self.is_main:
            show_summary(summary, mode)
        return FitHistory(self.history, summary)

    def _check_fit_args(self, loader: Iterable, epochs: int, max_steps: int | None,
                        callbacks: Sequence[Callback]) -> Any:
        """fit()'s arguments checked, naming the bad one; returns the loader's nominal batch size (or None)."""
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs: must be a positive integer, got {epochs!r}")
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"max_steps: must be a positive integer or None, got {max_steps!r}")
        nominal = getattr(loader, "batch_size", None)
        if isinstance(nominal, int) and nominal < self.total_towers:
            raise ValueError(f"batch_size: the loader's batch size {nominal} is smaller than the number of "
                             f"towers ({self.total_towers}); every tower needs at least one sample")
        for i, cb in enumerate(callbacks):
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks[{i}]: expected an ncclavg.train.callbacks.Callback, got {type(cb).__name__}")
        return nominal

    def _run_epochs(self, loader: Iterable, epochs: int, max_steps: int | None, nominal: Any, resumable: bool,
                    eval_loader: Iterable | None, callbacks: list, totals: list) -> None:
        """The epochs until `epochs` are complete, `max_steps` steps were taken or a callback stopped the
        training; each epoch's record appended to the history (with its evaluation on `eval_loader`)."""
        while not self.stop_training:
            epoch = loader.epoch if resumable else self.epoch
            if epoch >= epochs or (max_steps is not None and self.step >= max_steps):
                return
            for cb in callbacks:
                cb.on_epoch_start(self, epoch)
            for batch, allow_idle in self._epoch_batches(loader, nominal):
                record = self.train_step(batch, _allow_idle_towers=allow_idle)
                totals[0] += record["samples"]
                totals[1] += record["step_s"]
                for cb in callbacks:
                    cb.on_step_end(self, record)
                if self.stop_training or (max_steps is not None and self.step >= max_steps):
                    return   # inside an epoch: no epoch record
            self.epoch = epoch + 1
            record = self._epoch_record(eval_loader)
            self.history.append(record)
            for cb in callbacks:
                cb.on_epoch_end(self, record)

    def _summary(self, eval_loader: Iterable | None, t_fit: float, step0: int) -> FitSummary:
        """The fit's summary (the line `ncclavg train` ends with), kept as `last_summary`."""
        rep = self.straggler_report(since=self._fit_mark)
        summary = FitSummary(test_accuracy=self._final_accuracy(eval_loader), epochs=self.epoch,
                             samples_per_s=self.last_fit["samples_per_s"], wall_s=time.perf_counter() - t_fit,
                             processes=self.processes, towers=self.total_towers,
                             devices=tuple(str(d) for d in self.devices), steps=self.step - step0,
                             stragglers=rep)
        self.last_summary = summary
        return summary

    def _say(self, text: str, mode: str | None) -> None:
        """A sentence of fit's own: printed where progress is shown, logged at INFO by the printing process."""
        if not self.is_main:
            return
        if mode is not None:
            print(text, flush=True)
        log.info("%s", text)

    def _final_accuracy(self, eval_loader: Iterable | None) -> float | None:
        """Test accuracy after the last step: the last epoch's evaluation when no step came after it, else
        one more evaluation (a fit stopped by max_steps inside an epoch). Every process decides alike."""
        if eval_loader is None:
            return None
        last = self.history[-1] if self.history else None
        if last is not None and last.get("step") == self.step and "val_accuracy" in last:
            return last["val_accuracy"]
        return self.evaluate(eval_loader)["accuracy"]

    def _note_fit(self, samples: int, train_s: float, t_fit: float) -> None:
        self.last_fit = {"samples": samples, "train_s": train_s,
                         "samples_per_s": samples / train_s if train_s > 0 else 0.0,
                         "wall_s": time.perf_counter() - t_fit}

    def _epoch_batches(self, loader: Iterable, nominal: Any) -> Iterable[tuple[Any, bool]]:
        """(batch, may it leave towers idle). Only the trailing remainder of an epoch may be smaller than
        the number of towers: with a loader that states its batch size (checked >= towers in fit) that
        is any short batch; for other iterables, a last batch that follows a full one (one-batch
        lookahead), so that a loader yielding too small batches fails before its first step."""
        if isinstance(nominal, int):
            for batch in loader:
                yield batch, True
            return
        it = iter(loader)
        sentinel = object()
        current, seen = next(it, sentinel), 0
        while current is not sentinel:
            upcoming = next(it, sentinel)
            yield current, upcoming is sentinel and seen > 0
            current, seen = upcoming, seen + 1

    def _epoch_stragglers(self) -> dict:
        """{"stragglers": the straggler report over the epoch's collectives} (Note [The straggler report]),
        or {} where no channel logs arrivals; the next epoch's window starts where this one ends."""
        rep = self.straggler_report(since=self._straggler_mark)
        if rep is None:
            return {}
        self._straggler_mark = rep.logged
        return {"stragglers": rep.as_dict()}

    def _epoch_record(self, eval_loader: Iterable | None) -> dict:
        acc, self._epoch_acc = self._epoch_acc, self._new_epoch_acc()
        n = acc["samples"]
        record = {"epoch": self.epoch, "step": self.step, "loss": acc["loss_sum"] / n if n else None,
                  **self._epoch_stragglers(),
                  "accuracy": acc["correct"] / n if n and acc["correct"] is not None else None,
                  "samples": n, "train_s": acc["train_s"],
                  "samples_per_s": n / acc["train_s"] if acc["train_s"] > 0 else None,
                  "lr": self.current_lr(), **{"t_" + k: acc["t_" + k] for k in PHASES}}
        if eval_loader is not None:
            ev = self.evaluate(eval_loader)
            record.update(val_loss=ev["loss"], val_accuracy=ev["accuracy"])
        return record
