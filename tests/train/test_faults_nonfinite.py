"""Non-finite gradients from one tower: the step is skipped (counted, logged with the tower and bucket),
master weights and optimizer state stay bit-identical, and training goes on exactly as if the bad batch
had never happened; on_nonfinite="raise" raises instead, naming the same places."""
import logging
import math

import pytest
import torch
from torch import nn

from ncclavg import Communicator, GradientAverager, TowerTrainer


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 32)
        self.fc2 = nn.Linear(32, 16)
        self.fc3 = nn.Linear(16, 5)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.relu(self.fc1(x)))))


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(n)]


def make(master, optimizer="adamw", **kw):
    torch.manual_seed(0)
    return TowerTrainer(Net(), devices=["cpu", "cpu", "cpu"], optimizer=optimizer, lr=1e-2, master=master,
                        bucket_cap_mb=0.002, first_bucket_mb=0.001, concurrent=False, **kw)


def snapshot(trainer):
    state = trainer.engine.master_state()
    towers = [[p.detach().clone() for p in t.parameters()] for t in trainer.towers]
    return state, towers


def same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def poison(trainer, tower, param_name, value):
    """A tensor hook that turns one parameter's gradient on one tower into `value` (once armed)."""
    armed = []
    p = dict(trainer.towers[tower].named_parameters())[param_name]
    p.register_hook(lambda g: torch.full_like(g, value) if armed else None)
    return armed


def bucket_of(trainer, param_name):
    return trainer.plan.slots[trainer.names.index(param_name)].bucket


@pytest.mark.parametrize("master", ["cpu", "device"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_nonfinite_gradient_skips_the_step_and_changes_nothing(master, value, caplog):
    data = batches(5)
    ref = make(master)
    for i in (0, 1, 3, 4):          # the reference never sees batch 2
        ref.train_step(data[i])
    tr = make(master)
    assert len(tr.plan.buckets) >= 2
    armed = poison(tr, 1, "fc2.weight", value)
    for i in (0, 1):
        tr.train_step(data[i])
    before = snapshot(tr)
    armed.append(True)
    with caplog.at_level(logging.WARNING, logger="ncclavg.train.trainer"):
        rec = tr.train_step(data[2])
    armed.clear()
    assert rec["skipped"] and tr.nonfinite_steps == 1
    assert rec["nonfinite"] == [[1, bucket_of(tr, "fc2.weight")]]
    assert same(before, snapshot(tr)), "a skipped step changed master weights, optimizer state or a tower"
    assert any(f"tower 1 bucket {bucket_of(tr, 'fc2.weight')}" in r.getMessage() and "skipped" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    for i in (3, 4):
        tr.train_step(data[i])
    # the skipped step left no trace: the same weights as a run that never saw the bad batch
    for a, b in zip(tr.master_params(), ref.master_params()):
        assert torch.equal(a, b)
    assert tr.state_dict()["nonfinite_steps"] == 1


@pytest.mark.parametrize("master", ["cpu", "device"])
def test_on_nonfinite_raise_names_tower_and_bucket(master):
    data = batches(3)
    tr = make(master, optimizer="sgd", on_nonfinite="raise")
    armed = poison(tr, 2, "fc1.bias", -math.inf)
    tr.train_step(data[0])
    before, step = snapshot(tr), tr.step
    armed.append(True)
    with pytest.raises(FloatingPointError, match=rf"non-finite gradient .*tower 2 bucket "
                                                 rf"{bucket_of(tr, 'fc1.bias')}.*on_nonfinite='raise'"):
        tr.train_step(data[1])
    armed.clear()
    assert same(before, snapshot(tr)) and tr.step == step and tr.nonfinite_steps == 0
    tr.train_step(data[2])          # still usable
    assert tr.step == step + 1


def test_on_nonfinite_is_validated():
    with pytest.raises(ValueError, match="on_nonfinite: must be one of 'skip', 'raise', 'ignore', got 'warn'"):
        make("cpu", on_nonfinite="warn")


def test_averager_check_finite_names_local_tower_and_bucket():
    comm = Communicator.local(3)
    towers = [[torch.zeros(300, requires_grad=True), torch.zeros(7, requires_grad=True)] for _ in range(3)]
    avg = GradientAverager(comm, towers, bucket_cap_mb=0.001, first_bucket_mb=0.001, check_finite=True)
    assert len(avg.plan.buckets) == 2
    for t in range(3):
        (towers[t][0].sum() + towers[t][1].sum()).backward()
    avg.average()
    assert avg.nonfinite() == []
    avg.zero_grad()
    for t in range(3):
        (towers[t][0].sum() + towers[t][1].sum() * (math.nan if t == 2 else 1.0)).backward()
    avg.average()
    b = avg.plan.slots[1].bucket
    assert avg.nonfinite() == [(2, b)]
    assert torch.isnan(towers[0][1].grad).all()     # the mean is NaN on every tower: only the flag knows
    with pytest.raises(TypeError, match="check_finite"):
        GradientAverager(comm, towers, check_finite="yes")
    with pytest.raises(RuntimeError, match="check_finite=True"):
        GradientAverager(comm, [[torch.zeros(3, requires_grad=True)] for _ in range(3)]).nonfinite()


@pytest.mark.parametrize("master", ["cpu", "device"])
def test_on_nonfinite_ignore_lets_the_nan_through_like_torch_optim(master):
    data = batches(2)
    tr = make(master, optimizer="sgd", on_nonfinite="ignore")
    armed = poison(tr, 0, "fc3.bias", math.nan)
    tr.train_step(data[0])
    armed.append(True)
    rec = tr.train_step(data[1])
    assert not rec["skipped"] and tr.nonfinite_steps == 0
    bias = tr.master_params()[tr.names.index("fc3.bias")]
    assert torch.isnan(bias).all()
