"""What fit() shows and returns (Note [Progress of fit]): epoch lines off a terminal, a bar on one, nothing
with progress=False, the summary line `ncclavg train` ends with (printed, logged, returned), a fit with
nothing left to train; and torch's threads for CPU towers set by the trainer itself (Note [Threads of
CPU towers])."""
from __future__ import annotations

import io
import logging
import re

import pytest
import torch

from ncclavg.train import fit_report, towers
from ncclavg.train.data import TensorLoader, load_digits
from ncclavg.train.models import build_model
from ncclavg.train.trainer import TowerTrainer

# The CLI's summary line, as tests/train/test_train_cli.py reads it.
SUMMARY = re.compile(r"^summary: test_accuracy=(?P<acc>\d\.\d{3}) epochs=(?P<epochs>\d+) "
                     r"samples_per_s=(?P<sps>\d+\.\d) wall_s=(?P<wall>\d+\.\d) processes=1 "
                     r"towers=(?P<towers>\d+) devices=(?P<devices>\S+)$")


@pytest.fixture(scope="module")
def data():
    d = load_digits()
    return (TensorLoader(d.x_train[:200], d.y_train[:200], batch_size=50, seed=0),
            TensorLoader(d.x_test[:100], d.y_test[:100], batch_size=100, shuffle=False))


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """Trainers set torch's threads for the process: give the next test the count it had."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _fit(data, **kw):
    train, test = data
    train.load_state_dict({"seed": 0, "epoch": 0, "batch": 0})
    with TowerTrainer(build_model("mlp", seed=0), devices=["cpu", "cpu"], lr=3e-3) as tr:
        history = tr.fit(train, epochs=2, eval_loader=test, **kw)
    return tr, history


def test_off_a_terminal_epoch_lines_then_the_summary_line(data, capsys):
    tr, history = _fit(data)
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    assert [ln.split()[:2] for ln in lines[:2]] == [["epoch", "1/2"], ["epoch", "2/2"]]
    m = SUMMARY.match(lines[-1])
    assert m and m["epochs"] == "2" and m["towers"] == "2" and m["devices"] == "cpu,cpu", out
    assert len(lines) == 3 and err == ""
    s = history.summary
    assert s is tr.last_summary and s.line() == lines[-1] and s.steps == 8
    assert s.test_accuracy == history[-1]["val_accuracy"]   # the last epoch's evaluation, not another
    assert isinstance(history, list) and len(history) == 2 and history[-1]["epoch"] == 2


def test_progress_false_prints_nothing_and_logs_the_summary(data, capsys, caplog):
    with caplog.at_level(logging.INFO, logger="ncclavg.train"):
        _, history = _fit(data, progress=False)
    assert capsys.readouterr() == ("", "")
    logged = [r.getMessage() for r in caplog.records if r.name == "ncclavg.train"]
    assert logged == [history.summary.line()]


def test_a_bar_on_stderr_keeps_each_epochs_figures(data, capsys):
    pytest.importorskip("tqdm")
    _fit(data, progress="bar")
    out, err = capsys.readouterr()
    assert SUMMARY.match(out.strip()) and "epoch 2/2" in err and "test_acc=" in err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_mode_follows_the_terminal_and_tqdm(monkeypatch):
    assert fit_report.progress_mode(None, True, _Terminal()) == "bar"
    assert fit_report.progress_mode(None, True, io.StringIO()) == "lines"
    assert fit_report.progress_mode(True, True, io.StringIO()) == "bar"
    assert fit_report.progress_mode("lines", True, _Terminal()) == "lines"
    assert fit_report.progress_mode(None, False, _Terminal()) is None   # not the printing rank
    assert fit_report.progress_mode(False, True, _Terminal()) is None
    monkeypatch.setattr(fit_report, "_have_tqdm", lambda: False)     # no tqdm: lines instead of a bar
    assert fit_report.progress_mode(None, True, _Terminal()) == "lines"
    with pytest.raises(ValueError, match=r"progress: .* got 'verbose'"):
        fit_report.progress_mode("verbose", True)
    with pytest.raises(ValueError, match="progress: "):
        fit_report.progress_mode(1, True)


def test_nothing_left_to_train_says_so_and_takes_no_step(data, capsys):
    train, test = data
    train.load_state_dict({"seed": 0, "epoch": 0, "batch": 0})
    with TowerTrainer(build_model("mlp", seed=0), devices=["cpu", "cpu"], lr=3e-3) as tr:
        tr.fit(train, epochs=1, progress=False)
        step = tr.step
        history = tr.fit(train, epochs=1, eval_loader=test)
        assert tr.step == step and history.summary is None and len(history) == 1
        out = capsys.readouterr().out
        assert out.startswith("nothing to train: epoch 1 reached (step 4), epochs is 1") and "summary:" not in out
        tr.fit(train, epochs=2, max_steps=4)
        assert "nothing to train: step 4 reached, max_steps is 4" in capsys.readouterr().out


def test_the_thread_rule(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(towers, "usable_cores", lambda: 8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert towers.tower_threads([cpu] * 2)[0] == 4
    assert towers.tower_threads([cpu] * 3)[0] == 2
    assert towers.tower_threads([cpu] * 16)[0] == 1            # never below one
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")                 # torchrun's processes share the host
    assert towers.tower_threads([cpu] * 2) == (2, "8 cores / (2 CPU towers x 2 processes on this host)")
    assert towers.tower_threads([gpu] * 2)[0] is None          # GPU towers: torch's setting kept
    assert towers.tower_threads([gpu], threads=3) == (3, "as asked")
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="threads: must be a positive integer"):
            towers.tower_threads([cpu], threads=bad)


def test_the_trainer_applies_the_rule_and_logs_it_once(monkeypatch, caplog):
    monkeypatch.setattr(towers, "usable_cores", lambda: 6)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(towers, "_logged_threads", None)
    with caplog.at_level(logging.INFO, logger="ncclavg.train.towers"):
        for _ in range(2):
            with TowerTrainer(build_model("mlp", seed=0), devices=["cpu"] * 3) as tr:
                assert torch.get_num_threads() == 2 and tr.describe()["threads"] == 2
        with TowerTrainer(build_model("mlp", seed=0), devices=["cpu"] * 3, threads=1) as tr:
            assert torch.get_num_threads() == 1
    logged = [r.getMessage() for r in caplog.records if r.name == "ncclavg.train.towers"]
    assert len(logged) == 2 and "torch intra-op threads: 2 (6 cores / (3 CPU towers)" in logged[0]
    assert "torch intra-op threads: 1 (as asked" in logged[1]
    with pytest.raises(ValueError, match="threads: "):
        TowerTrainer(build_model("mlp", seed=0), devices=["cpu"], threads=0)
