"""A battery of bad inputs across the public API. Each case must raise an exception whose message names
the argument, must not crash the process, must leave every tensor, parameter and optimizer state as it
was, and must leave the communicator (and averager, optimizer, trainer) usable afterwards."""
import io
import math
import re
from contextlib import redirect_stderr

import pytest
import torch
from torch import nn

import ncclavg
from ncclavg import (Communicator, GradientAverager, LayoutMismatchError, MasterWeights, TowerTrainer, _C,
                     ops)
from ncclavg.buffers import as_buffer
from ncclavg.cli import main as cli_main
from ncclavg.comm import default_timeout
from ncclavg.optim import CPUAdamW, CPUSGD


def _net(hidden=8):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, hidden), nn.Tanh(), nn.Linear(hidden, 3))


class Ctx:
    """Everything a case may touch, built fresh for each case."""

    def __init__(self):
        self.comm = Communicator.local(2, timeout=30)
        self.towers = [_net(), _net()]
        self.avg = GradientAverager(self.comm, self.towers, bucket_cap_mb=0.0005, first_bucket_mb=0.0002)
        self.a, self.b = torch.arange(8.0), torch.full((8,), 2.0)
        self.params = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(7))]
        for p in self.params:
            p.grad = torch.ones_like(p)
        self.opt = CPUAdamW(self.params, lr=1e-2)
        self.opt.step()                      # some state to protect
        self.sgd = CPUSGD([nn.Parameter(torch.ones(5))], lr=0.1, momentum=0.9)
        self.master = MasterWeights([torch.randn(10), torch.randn(3, 3)], pin=False, lr=1e-2)
        self.trainer = TowerTrainer(_net(), devices=["cpu", "cpu"], lr=1e-2, concurrent=False)
        self.batch = (torch.randn(6, 5), torch.randint(0, 3, (6,)))
        self.trainer.train_step(self.batch)

    def tensors(self):
        """Every piece of state, flattened to tensors and values in a fixed order."""
        out = [self.a, self.b]
        for t in self.towers:
            out += [x for p in t.parameters() for x in (p, p.grad) if x is not None]
        out += [self.avg.bucket_storage(t, b) for t in range(2) for b in range(len(self.avg.plan.buckets))]
        for o in (self.opt, self.sgd):
            out += list(o.param_groups[0]["params"])
            out += [v for s in o.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            out += [torch.tensor(float(o.param_groups[0]["lr"]))]
        out += list(self.master.flat) + list(self.master.exp_avg) + list(self.master.exp_avg_sq)
        out += [torch.tensor(float(self.master.hp["lr"]))]
        out += self.trainer.master_params() + [p for t in self.trainer.towers for p in t.parameters()]
        out += [torch.tensor(float(self.trainer.step))]
        return [x.detach().clone() for x in out]

    def still_usable(self):
        xs = [torch.full((5,), 1.0), torch.full((5,), 3.0)]
        self.comm.all_reduce_avg(xs)
        assert torch.equal(xs[0], torch.full((5,), 2.0)) and torch.equal(xs[1], xs[0])
        self.avg.zero_grad()
        for t in self.towers:
            t(torch.ones(2, 5)).sum().backward()
        self.avg.average()
        self.opt.step()
        self.master.step([torch.ones(b.numel) for b in self.master.plan.buckets])
        self.trainer.train_step(self.batch)


def _bad_towers(c):
    return GradientAverager(c.comm, [_net(), _net(hidden=9)])


CASES = [
    # ---- Buffer / boundary
    ("Buffer null ptr", ValueError, "argument 'ptr'", lambda c: _C.Buffer(0, 4, 0)),
    ("Buffer negative numel", ValueError, "argument 'numel'", lambda c: _C.Buffer(4096, -1, 0)),
    ("Buffer dtype code", TypeError, "argument 'dtype'", lambda c: _C.Buffer(4096, 4, 9)),
    ("Buffer device", ValueError, "argument 'device'", lambda c: _C.Buffer(4096, 4, 0, -5)),
    ("as_buffer float64", TypeError, "^grad: dtype torch.float64", lambda c: as_buffer(torch.ones(3).double(), "grad")),
    ("as_buffer strided", ValueError, "^grad: tensor is not contiguous",
     lambda c: as_buffer(torch.ones(4, 4).t(), "grad")),
    # ---- ops
    ("average_ sizes", ValueError, r"buffers\[1\]", lambda c: ops.average_([c.a, torch.ones(9)])),
    ("average_ aliasing", ValueError, "share memory", lambda c: ops.average_([c.a, c.a])),
    ("pack_ offset out of range", ValueError, "argument 'offsets'", lambda c: ops.pack_([c.a], c.b, [4])),
    ("pack_ offsets count", ValueError, "^offsets: has 2 entries", lambda c: ops.pack_([c.a], torch.ones(16), [0, 8])),
    ("pack_ divisor zero", ValueError, "^divisor: must be non-zero",
     lambda c: ops.pack_([c.a], torch.ones(16), [0], divisor=0)),
    ("unpack_ scale nan", ValueError, "^scale: must be finite",
     lambda c: ops.unpack_(torch.ones(16), [c.a], [0], scale=math.nan)),
    # ---- Communicator
    ("local n=0", ValueError, "^n: must be >= 1", lambda c: Communicator.local(0)),
    ("local timeout<0", ValueError, "^timeout: must be a positive", lambda c: Communicator.local(2, timeout=-1)),
    ("local timeout str", TypeError, "^timeout: expected seconds", lambda c: Communicator.local(2, timeout="9")),
    ("all_reduce count", ValueError, "^tensors: got 1 tensors", lambda c: c.comm.all_reduce_avg([c.a])),
    ("all_reduce dtype", TypeError, r"^tensors\[1\]: dtype", lambda c: c.comm.all_reduce_avg([c.a, c.b.half()])),
    ("all_reduce same tensor", ValueError, "^tensors: entries 0 and 1 share memory",
     lambda c: c.comm.all_reduce_avg_async([c.a, c.a])),
    ("all_reduce not a list", TypeError, "^tensors: expected a list", lambda c: c.comm.all_reduce_avg(c.a)),
    ("reduce_scatter divisibility", ValueError, "^inputs: 7 elements is not divisible",
     lambda c: c.comm.reduce_scatter_avg([torch.ones(7), torch.ones(7)], [torch.ones(3), torch.ones(3)])),
    ("all_gather output size", ValueError, r"^outputs\[0\]: has 9 elements, expected 16",
     lambda c: c.comm.all_gather([c.a, c.b], [torch.ones(9), torch.ones(16)])),
    ("wait timeout zero", ValueError, "^timeout: must be a positive",
     lambda c: (lambda w: (w.wait(), w.wait(timeout=0)))(c.comm.all_reduce_avg_async([torch.ones(3),
                                                                                     torch.zeros(3)]))),
    ("all_reduce timeout nan", ValueError, "^timeout: must be a positive",
     lambda c: c.comm.all_reduce_avg([c.a, c.b], timeout=math.nan)),
    # ---- GradientAverager
    ("averager tower count", ValueError, "^towers: got 1 towers but comm.local_size is 2",
     lambda c: GradientAverager(c.comm, [_net()])),
    ("averager layouts", LayoutMismatchError, r"tower 1: parameter 0 \('0.weight'\) has shape \(9, 5\)", _bad_towers),
    ("averager bucket_cap_mb", ValueError, "^bucket_cap_mb: must be a positive",
     lambda c: GradientAverager(c.comm, [_net(), _net()], bucket_cap_mb=0)),
    ("averager grad_dtype", TypeError, "^grad_dtype: unknown dtype 'int8'",
     lambda c: GradientAverager(c.comm, [_net(), _net()], grad_dtype="int8")),
    ("averager overlap", TypeError, "^overlap: expected a bool",
     lambda c: GradientAverager(c.comm, [_net(), _net()], overlap="yes")),
    ("averager names", ValueError, "^names: has 1 entries",
     lambda c: GradientAverager(c.comm, [_net(), _net()], names=["x"])),
    ("averager same params twice", ValueError, r"^towers\[1\]\[0\]: is the same tensor as towers\[0\]\[0\]",
     lambda c: (lambda m: GradientAverager(c.comm, [list(m.parameters()), list(m.parameters())]))(_net())),
    ("averager comm", TypeError, "^comm: expected an ncclavg Communicator",
     lambda c: GradientAverager(object(), [_net()])),
    ("bucket_storage index", IndexError, "^tower: 5 out of range", lambda c: c.avg.bucket_storage(5, 0)),
    # ---- optimizers
    ("AdamW lr", ValueError, "^lr: must be >= 0", lambda c: CPUAdamW(c.params, lr=-1)),
    ("AdamW betas", ValueError, r"^betas\[0\]: must be in \[0, 1\)", lambda c: CPUAdamW(c.params, betas=(1.5, 0.9))),
    ("SGD momentum", ValueError, "^momentum: must be >= 0", lambda c: CPUSGD(c.params, lr=0.1, momentum=-0.1)),
    ("step grad_scale", ValueError, "^grad_scale: must be a loss scale > 0", lambda c: c.opt.step(grad_scale=0)),
    ("step max_grad_norm", ValueError, "^max_grad_norm: must be > 0", lambda c: c.opt.step(max_grad_norm=-1)),
    ("step lr edited to nan", ValueError, "lr: must be finite",
     lambda c: (c.sgd.param_groups[0].update(lr=math.nan), c.sgd.step())),
    # ---- MasterWeights
    ("master optimizer", ValueError, "^optimizer: must be one of", lambda c: MasterWeights(c.params, optimizer="lamb")),
    ("master grads numel", ValueError, r"^tower_grads\[0\]\[0\]: has 5 elements",
     lambda c: c.master.step([torch.ones(5)])),
    ("master bucket", ValueError, "^bucket: must be None or a bucket index",
     lambda c: c.master.step([torch.ones(128)], bucket=3)),
    ("master copy_out dtype", ValueError, "^dtype: torch.int32 is not supported",
     lambda c: c.master.copy_out(dtype=torch.int32)),
    ("master load_state_dict", ValueError, "^state_dict: expected a dict", lambda c: c.master.load_state_dict({})),
    ("master lr edited to nan", ValueError, "lr: must be finite",
     lambda c: (c.master.hp.update(lr=math.nan), c.master.step([torch.ones(b.numel) for b in c.master.plan.buckets]))),
    # ---- TowerTrainer
    ("trainer lr", ValueError, "^lr: must be > 0", lambda c: TowerTrainer(_net(), devices=["cpu"], lr=0)),
    ("trainer on_nonfinite", ValueError, "^on_nonfinite: must be one of",
     lambda c: TowerTrainer(_net(), devices=["cpu"], on_nonfinite="warn")),
    ("trainer devices", ValueError, r"^devices\[1\]: unknown device 'tpu'",
     lambda c: TowerTrainer(_net(), devices=["cpu", "tpu"])),
    ("trainer batch dict", TypeError, "^batch: expected a tuple/list", lambda c: c.trainer.train_step({"x": 1})),
    ("trainer batch too small", ValueError, "^batch: has 1 samples, fewer than the 2 towers",
     lambda c: c.trainer.train_step((torch.randn(1, 5), torch.zeros(1, dtype=torch.long)))),
    ("trainer batch lengths", ValueError, r"^batch\[1\]: has 5 samples but batch\[0\] has 6",
     lambda c: c.trainer.train_step((torch.randn(6, 5), torch.zeros(5, dtype=torch.long)))),
    ("trainer fit epochs", ValueError, "^epochs: must be a positive integer", lambda c: c.trainer.fit([], epochs=0)),
]

CLI_CASES = [
    ("--epochs", ["train", "--epochs", "0"]),
    ("--devices", ["train", "--devices", "cpu,tpu"]),
    ("--test-fraction", ["train", "--test-fraction", "1.5"]),
    ("--batch-size", ["train", "--batch-size", "1", "--towers", "2"]),
    ("--optimizer", ["train", "--optimizer", "lamb"]),
    ("--on-nonfinite", ["train", "--on-nonfinite", "warn"]),
    ("--towers", ["train", "--towers", "3", "--devices", "cpu,cpu"]),
    ("--synthetic-samples", ["train", "--synthetic-samples", "100"]),
]


def test_battery_is_large_enough():
    assert len(CASES) + len(CLI_CASES) >= 25


@pytest.mark.parametrize("name,exc,pattern,call", CASES, ids=[c[0] for c in CASES])
def test_bad_input(name, exc, pattern, call):
    c = Ctx()
    before = c.tensors()
    with pytest.raises(exc) as ei:
        call(c)
    assert re.search(pattern, str(ei.value)), f"{name}: {ei.value!r} does not match {pattern!r}"
    # the hyper-parameter edits of two cases are the user's own doing: undo them before comparing
    c.sgd.param_groups[0]["lr"] = 0.1
    c.master.hp["lr"] = 1e-2
    after = c.tensors()
    assert len(before) == len(after)
    for i, (x, y) in enumerate(zip(before, after)):
        assert torch.equal(x, y), f"{name}: state entry {i} changed"
    c.still_usable()


@pytest.mark.parametrize("flag,argv", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_bad_cli_flag(flag, argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = io.StringIO()
    with redirect_stderr(err):
        try:
            code = cli_main(argv + ["--checkpoint-dir", str(tmp_path / "ck"), "--metrics", str(tmp_path / "m.jsonl")])
        except SystemExit as e:   # argparse's own usage errors
            code = e.code
    assert code == 2, err.getvalue()
    assert flag in err.getvalue(), err.getvalue()
    assert list(tmp_path.iterdir()) == [], "a rejected command line wrote files"


def test_bad_timeout_environment(monkeypatch):
    monkeypatch.setenv("NCCLAVG_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="^NCCLAVG_TIMEOUT: expected a number of seconds, got 'soon'"):
        Communicator.local(2)
    monkeypatch.setenv("NCCLAVG_TIMEOUT", "-3")
    with pytest.raises(ValueError, match="^NCCLAVG_TIMEOUT: must be a positive"):
        default_timeout()
    monkeypatch.setenv("NCCLAVG_TIMEOUT", "12.5")
    assert Communicator.local(2).timeout == 12.5
    assert ncclavg.Communicator.local(2, timeout=3).timeout == 3.0
