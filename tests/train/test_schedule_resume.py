"""A resumed run given another length: the named lr schedule is planned again over the new total from the
step reached (Note [Schedules over a resumed run]), or kept when asked, and the run says which."""
import pytest
import torch

from ncclavg.cli import main
from ncclavg.train.callbacks import Callback
from ncclavg.train.data import TensorLoader, load_digits
from ncclavg.train.metrics import read_jsonl
from ncclavg.train.models import build_model
from ncclavg.train.schedules import CosineWarmup, ExponentialDecay
from ncclavg.train.trainer import TowerTrainer

BATCHES = 8  # per epoch: 250 samples in batches of 32


@pytest.fixture(scope="module")
def data():
    s = load_digits()
    return s.x_train[:250], s.y_train[:250]


def _loader(data):
    return TensorLoader(*data, batch_size=32, seed=3)


class Steps(Callback):
    def __init__(self):
        self.lrs, self.losses = [], []

    def on_step_end(self, trainer, record):
        self.lrs.append(record["lr"])
        self.losses.append(record["loss"])


def _weights(trainer):
    return torch.cat([p.reshape(-1) for p in trainer.master_params()])


def _first_run(tmp_path, data, **cfg):
    tr = TowerTrainer(build_model("mlp", seed=0), devices=["cpu", "cpu"], seed=1, **cfg)
    tr.fit(_loader(data), epochs=3)
    path = tr.save(str(tmp_path / "run.ckpt"))
    tr.close()
    return path


def test_cosine_resumed_with_more_epochs_is_replanned_and_keeps_learning(tmp_path, data):
    path = _first_run(tmp_path, data, lr=3e-3, lr_schedule="cosine")
    tr = TowerTrainer.load(path, build_model("mlp"))
    assert tr.schedule == CosineWarmup(3e-3, total_steps=3 * BATCHES, warmup_steps=3 * BATCHES // 20)
    assert tr.schedule(tr.step) == 0.0              # the saved plan has ended: lr 0 from here on
    before, steps = _weights(tr).clone(), Steps()
    tr.fit(_loader(data), epochs=5, callbacks=[steps])
    # planned again over 5 epochs; the warm-up already taken is kept
    assert tr.schedule == CosineWarmup(3e-3, total_steps=5 * BATCHES, warmup_steps=3 * BATCHES // 20)
    assert "re-planned for 5 epochs (40 steps) (was 3 epochs (24 steps))" in tr.schedule_note
    assert len(steps.lrs) == 2 * BATCHES and all(lr > 0 for lr in steps.lrs[:-1])
    assert steps.lrs == sorted(steps.lrs, reverse=True)       # still decaying, towards 0 at step 40
    assert not torch.equal(_weights(tr), before)
    assert len({round(x, 6) for x in steps.losses}) > 1
    tr.close()


def test_same_length_changes_nothing(tmp_path, data):
    path = _first_run(tmp_path, data, lr=3e-3, lr_schedule="cosine")
    tr = TowerTrainer.load(path, build_model("mlp"))
    saved = tr.schedule
    assert tr.plan_schedule(BATCHES, 3) is None and tr.schedule is saved and tr.schedule_note is None
    tr.close()


def test_keep_schedule_runs_past_the_end_and_says_so(tmp_path, data):
    path = _first_run(tmp_path, data, lr=3e-3, lr_schedule="cosine")
    tr = TowerTrainer.load(path, build_model("mlp"), replan_schedule=False)
    before, steps = _weights(tr).clone(), Steps()
    tr.fit(_loader(data), epochs=4, callbacks=[steps])
    assert "ends at step 24" in tr.schedule_note and "--keep-schedule" in tr.schedule_note
    assert steps.lrs == [0.0] * BATCHES
    # lr 0 with AdamW and no weight decay: the weights cannot move (that is what was asked for)
    assert torch.equal(_weights(tr), before)
    tr.close()


def test_named_exponential_decays_per_epoch_and_continues(tmp_path, data):
    path = _first_run(tmp_path, data, lr=0.05, optimizer="sgd", lr_schedule="exponential")
    tr = TowerTrainer.load(path, build_model("mlp"))
    assert tr.schedule == ExponentialDecay(0.05, decay_steps=BATCHES, decay_rate=0.9)
    steps = Steps()
    tr.fit(_loader(data), epochs=5, callbacks=[steps])
    # the step counter drives it: epochs 4 and 5 (steps 24..39) run at 0.05 * 0.9**3 and 0.9**4
    want = [0.05 * 0.9 ** 3] * BATCHES + [0.05 * 0.9 ** 4] * BATCHES
    assert steps.lrs == pytest.approx(want, rel=1e-12)
    assert tr.schedule_note is None   # a per-epoch decay does not depend on the number of epochs
    tr.close()


def test_new_peak_lr_on_resume_is_planned_too(tmp_path, data):
    path = _first_run(tmp_path, data, lr=3e-3, lr_schedule="cosine")
    tr = TowerTrainer.load(path, build_model("mlp"), lr=1e-3)
    tr.fit(_loader(data), epochs=4)
    assert tr.schedule.lr == 1e-3 and tr.schedule.total_steps == 4 * BATCHES
    tr.close()


def test_explicit_schedule_is_never_replanned_but_its_end_is_reported(tmp_path, data, caplog):
    spec = {"kind": "cosine", "total_steps": 2 * BATCHES, "warmup_steps": 0}
    tr = TowerTrainer(build_model("mlp", seed=0), devices=["cpu"], lr=1e-3, lr_schedule=spec)
    with caplog.at_level("WARNING", logger="ncclavg.train.trainer"):
        tr.fit(_loader(data), epochs=3)
    assert tr.schedule.total_steps == 2 * BATCHES
    assert "given explicitly" in tr.schedule_note and "ends at step 16" in caplog.text
    tr.close()


def test_cli_resume_with_more_epochs_keeps_learning(tmp_path, capsys):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    common = ["train", "--model", "mlp", "--no-progress", "--checkpoint-dir", str(ck), "--metrics", str(metrics)]
    assert main(common + ["--epochs", "2"]) == 0
    capsys.readouterr()
    assert main(common + ["--epochs", "4", "--resume", str(ck)]) == 0
    out = capsys.readouterr().out
    assert "lr schedule re-planned for 4 epochs" in out and "(was 2 epochs" in out
    recs = [r for r in read_jsonl(str(metrics)) if r.get("event") == "epoch"]
    later = [r for r in recs if r["epoch"] > 2]
    assert [r["epoch"] for r in later] == [3, 4] and all(r["lr"] > 0 for r in later[:1])
    assert later[0]["loss"] != later[1]["loss"]

    assert main(common + ["--epochs", "5", "--resume", str(ck), "--keep-schedule"]) == 0
    out = capsys.readouterr().out
    assert "ends at step" in out and "--keep-schedule" in out


def test_cli_keep_schedule_needs_resume(tmp_path, capsys):
    assert main(["train", "--keep-schedule", "--metrics", str(tmp_path / "m.jsonl")]) == 2
    assert "--keep-schedule: only applies with --resume" in capsys.readouterr().err
    assert not (tmp_path / "m.jsonl").exists()
