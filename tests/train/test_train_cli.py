"""`ncclavg train`: outputs, the summary line, resume, and clear errors that write nothing."""
import os
import re
import subprocess
import sys

import pytest

from _paths import ROOT
from ncclavg.cli import main
from ncclavg.train.metrics import read_jsonl

SUMMARY = re.compile(r"^summary: test_accuracy=(?P<acc>\d\.\d{3}) epochs=(?P<epochs>\d+) "
                     r"samples_per_s=(?P<sps>\d+\.\d) wall_s=(?P<wall>\d+\.\d) processes=(?P<processes>\d+) "
                     r"towers=(?P<towers>\d+) devices=(?P<devices>\S+)$")


def _summary(out: str) -> dict:
    last = out.strip().splitlines()[-1]
    m = SUMMARY.match(last)
    assert m, f"last line is not the summary line: {last!r}"
    return m.groupdict()


def test_short_run_writes_metrics_checkpoints_and_plot(tmp_path, capsys):
    metrics, ckdir, plot = tmp_path / "m.jsonl", tmp_path / "ck", tmp_path / "p.png"
    rc = main(["train", "--model", "mlp", "--epochs", "2", "--towers", "3", "--batch-size", "100",
               "--metrics", str(metrics), "--checkpoint-dir", str(ckdir), "--plot", str(plot), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    s = _summary(out)
    assert s["epochs"] == "2" and s["towers"] == "3" and s["devices"] == "cpu,cpu,cpu"
    assert float(s["acc"]) > 0.5 and float(s["sps"]) > 0
    assert f"metrics: {metrics}" in out and f"plot: {plot}" in out and f"checkpoints: {ckdir}" in out
    assert "epoch 2/2" in out
    events = [r["event"] for r in read_jsonl(metrics)]
    assert events[0] == "fit_start" and events.count("epoch") == 2 and events[-1] == "fit_end"
    assert sorted(os.listdir(ckdir)) == ["ckpt-000000015.ckpt", "ckpt-000000030.ckpt"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Resume from the directory to 3 epochs: continues at step 30, appends to the metrics file.
    rc = main(["train", "--model", "mlp", "--epochs", "3", "--towers", "2", "--batch-size", "100",
               "--metrics", str(metrics), "--checkpoint-dir", str(ckdir), "--resume", str(ckdir), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "resumed: " in out and "(step 30, epoch 2)" in out
    s = _summary(out)
    assert s["epochs"] == "3" and s["towers"] == "2"
    events = [r["event"] for r in read_jsonl(metrics)]
    assert events.count("epoch") == 3 and events.count("fit_start") == 2
    assert "ckpt-000000045.ckpt" in os.listdir(ckdir)


def test_resume_keeps_the_checkpoints_towers_and_says_when_they_change_or_nothing_is_left(tmp_path, capsys):
    ckdir = tmp_path / "ck"
    common = ["train", "--model", "mlp", "--batch-size", "100", "--no-progress", "--checkpoint-dir", str(ckdir)]
    assert main([*common, "--epochs", "1", "--towers", "3"]) == 0
    capsys.readouterr()
    # Nothing left: one line saying so, exit 0, no summary, no new checkpoint.
    before = sorted(os.listdir(ckdir))
    assert main([*common, "--epochs", "1", "--resume", str(ckdir)]) == 0
    out = capsys.readouterr().out
    assert ("nothing to train: the checkpoint is at epoch 1 (step 15) and the run asks for 1 epoch; pass "
            "--epochs 2 or more to train on") in out
    assert "summary:" not in out and "samples_per_s" not in out and sorted(os.listdir(ckdir)) == before
    # Without --towers the checkpoint's 3 CPU towers are kept, and nothing is said about towers.
    assert main([*common, "--epochs", "2", "--resume", str(ckdir)]) == 0
    out = capsys.readouterr().out
    assert _summary(out)["towers"] == "3" and "towers changed" not in out
    # Another number of towers is said in one line.
    assert main([*common, "--epochs", "3", "--resume", str(ckdir), "--towers", "2"]) == 0
    out = capsys.readouterr().out
    changed = [ln for ln in out.splitlines() if ln.startswith("towers changed")]
    assert changed == ["towers changed: the checkpoint was written by 3 towers (cpu,cpu,cpu), this run has "
                       "2 towers (cpu,cpu)"]
    assert _summary(out)["towers"] == "2"


def test_the_threads_rule_is_the_trainers(capsys, monkeypatch):
    """The CLI leaves torch's threads to TowerTrainer (Note [Threads of CPU towers]) and names them."""
    import torch

    from ncclavg.train import towers

    threads = torch.get_num_threads()
    monkeypatch.setattr(towers, "usable_cores", lambda: 6)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    try:
        for extra, want in (([], "threads=2"), (["--threads", "1"], "threads=1")):
            assert main(["train", "--model", "mlp", "--towers", "3", "--max-steps", "1", "--no-progress",
                         *extra]) == 0
            assert f"towers: 3 on cpu,cpu,cpu; {want};" in capsys.readouterr().out
    finally:
        torch.set_num_threads(threads)


def test_no_outputs_requested_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = main(["train", "--model", "mlp", "--epochs", "1", "--max-steps", "2", "--synthetic",
               "--synthetic-samples", "300", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "metrics: not written" in out and "checkpoints: not written" in out and "plot: not written" in out
    assert "data: synthetic" in out
    assert _summary(out)["epochs"] == "0"  # stopped by --max-steps inside the first epoch
    assert os.listdir(tmp_path) == []


def test_bf16_run(capsys):
    rc = main(["train", "--amp", "bf16", "--epochs", "1", "--batch-size", "128", "--no-progress",
               "--master", "device"])
    out = capsys.readouterr().out
    assert rc == 0 and "amp=bf16" in out and "master=device" in out
    assert float(_summary(out)["acc"]) > 0.5


@pytest.mark.parametrize("args,match", [
    (["--towers", "4", "--batch-size", "3"], r"--batch-size: 3 is smaller than the number of towers \(4\)"),
    (["--devices", ""], r"--devices: devices: the list is empty"),
    (["--devices", "cpu,tpu:1"], r"devices\[1\]: unknown device 'tpu:1'"),
    (["--devices", "cpu:1,cpu"], r"--devices: devices\[0\]: cpu:1 is not a device: CPU towers all run on the one "
                                 r"'cpu'"),
    (["--devices", "cpu,cpu", "--towers", "3"], "--towers: 3 does not match"),
    (["--towers", "0"], "--towers: must be >= 1"),
    (["--epochs", "0"], "--epochs: must be >= 1"),
    (["--lr", "-1"], "lr: must be > 0"),
    (["--test-fraction", "1.0"], "--test-fraction"),
    (["--synthetic-samples", "100"], "--synthetic-samples: only applies with --synthetic"),
])
def test_bad_flags_fail_clearly_and_write_nothing(tmp_path, capsys, args, match):
    out_dir = tmp_path / "out"
    rc = main(["train", "--no-progress", "--metrics", str(out_dir / "m.jsonl"), "--checkpoint-dir",
               str(out_dir / "ck"), "--plot", str(out_dir / "p.png"), *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert re.search(match, err), err
    assert not out_dir.exists()


def test_resume_from_another_model_fails_and_writes_nothing(tmp_path, capsys):
    ckdir = tmp_path / "ck"
    assert main(["train", "--model", "mlp", "--epochs", "1", "--max-steps", "1", "--checkpoint-dir", str(ckdir),
                 "--no-progress"]) == 0
    capsys.readouterr()
    before = sorted(os.listdir(ckdir))
    rc = main(["train", "--model", "cnn", "--resume", str(ckdir), "--metrics", str(tmp_path / "m.jsonl"),
               "--checkpoint-dir", str(ckdir), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "different model" in err and "ckpt-000000001.ckpt" in err
    assert sorted(os.listdir(ckdir)) == before and not (tmp_path / "m.jsonl").exists()
    rc = main(["train", "--resume", str(tmp_path / "nothing-here"), "--no-progress"])
    assert rc == 2 and "nothing-here" in capsys.readouterr().err


@pytest.mark.slow
def test_default_run_reaches_95_percent(tmp_path):
    """`ncclavg train` with no flags, as a user runs it: 2 CPU towers, CNN, digits."""
    env = dict(os.environ)
    root = str(ROOT)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "ncclavg", "train"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    s = _summary(proc.stdout)
    assert float(s["acc"]) >= 0.95, proc.stdout
    assert s["towers"] == "2" and s["devices"] == "cpu,cpu" and int(s["epochs"]) >= 1
    assert os.listdir(tmp_path) == []  # no output files unless asked for


def test_a_gpu_device_without_a_driver_says_so(capsys, monkeypatch):
    """No NVIDIA driver: said as such, with torch's CUDA build named as torch's (Note [Saying why there is
    no GPU] in ncclavg/info.py), not as the CUDA runtime's 'driver version is insufficient'."""
    import torch

    from ncclavg import info

    monkeypatch.setattr(info, "nvidia_driver_evidence", lambda: "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["train", "--devices", "cuda:0", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert ("--devices: devices[0]: cuda:0 needs a GPU, and torch sees none: no NVIDIA driver on this machine "
            "(no /proc/driver/nvidia, libcuda.so.1 does not load), so no GPU") in err
    assert "torch's CUDA build: " in err or torch.version.cuda, err
    assert "insufficient" not in err
