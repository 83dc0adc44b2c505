"""torch.profiler ranges of ncclavg's own API (ncclavg/transport/profiling.py): the Communicator's collectives
as `ncclavg::<method>` with their inputs' shapes, and TowerTrainer's phases as `ncclavg:train:<phase>`;
nothing is recorded, and the result is the same, with no profiler running."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import ncclavg
from ncclavg.train.models import build_model
from ncclavg.train.trainer import TowerTrainer


def _events(prof, prefix="ncclavg"):
    return [(e.name, e.input_shapes) for e in prof.events() if e.name.startswith(prefix)]


def test_communicator_collectives_are_ranges_with_shapes():
    comm = ncclavg.Communicator.local(2)
    xs = [torch.full((3, 4), 1.0), torch.full((3, 4), 3.0)]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        comm.all_reduce_avg(xs)
        comm.all_reduce_avg_async(xs).wait()
    assert all(torch.equal(x, torch.full((3, 4), 2.0)) for x in xs)
    got = _events(prof)
    assert ("ncclavg::all_reduce_avg", [[3, 4], [3, 4]]) in got, got
    assert ("ncclavg::all_reduce_avg_async", [[3, 4], [3, 4]]) in got, got
    ins = [torch.arange(8.0), torch.arange(8.0) * 3]
    outs = [torch.empty(4), torch.empty(4)]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        comm.reduce_scatter_avg(ins, outs)
    assert torch.equal(outs[0], torch.arange(4.0) * 2) and torch.equal(outs[1], torch.arange(4.0, 8.0) * 2)
    assert ("ncclavg::reduce_scatter_avg", [[8], [8]]) in _events(prof)
    comm.close()


def test_without_the_profiler_nothing_is_recorded_and_results_agree():
    comm = ncclavg.Communicator.local(2)
    xs = [torch.full((5,), 1.0), torch.full((5,), 2.0)]
    comm.all_reduce_avg(xs)   # no profiler: the plain call
    assert all(torch.equal(x, torch.full((5,), 1.5)) for x in xs)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pass
    assert _events(prof) == []
    comm.close()


@pytest.mark.parametrize("master", ["cpu", "device"])
def test_trainer_phases_are_ranges(master):
    torch.manual_seed(0)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    with TowerTrainer(build_model("mlp", seed=0), devices=["cpu", "cpu"], master=master) as tr:
        tr.train_step((x, y))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            tr.train_step((x, y))
    names = [n for n, _ in _events(prof, "ncclavg:train:")]
    assert "ncclavg:train:compute" in names and "ncclavg:train:optimizer" in names, names
    assert names.count("ncclavg:train:compute") == 1, names
