"""TowerTrainer across processes (Note [Towers of several processes] in ncclavg/train/distributed.py):
P processes x T CPU towers over gloo on loopback take the steps of one process with P*T towers."""
import functools

import _trainer_proc_workers as workers
import pytest
import torch
from _dist_util import run_ranks
from _training_reference import OPTIMIZERS, assert_params_close, fp32_training_spread

from ncclavg.train.models import build_model
from ncclavg.train.trainer import TowerTrainer

STEPS = 8


@functools.lru_cache(maxsize=None)
def _reference(opt_name, data):
    return fp32_training_spread(lambda: build_model("mlp", seed=0), lambda: workers.digits_loader(data),
                                opt_name, STEPS)


def _run(tmp_path, counts, opt_name, master, data, shard=False, overlap=True):
    run_ranks(workers.train_job, len(counts), args=(counts, OPTIMIZERS[opt_name], master, data, STEPS,
                                                   str(tmp_path), shard, overlap), timeout_s=240)
    return torch.load(tmp_path / "result.pt")


# Every optimizer and master on 2 x 2; the other shapes (4 x 1, and processes with 1 and 3 towers) with
# AdamW, the optimizer that amplifies a wrong average most. 4 processes cost ~15 s each on 2 cores.
# shard_master (Note [Sharded CPU master]) with both optimizers on 2 x 2 and with AdamW on 1 + 3.
CASES = ([((2, 2), opt, master, False) for opt in OPTIMIZERS for master in ("cpu", "device")] +
         [(counts, "adamw", master, False) for counts in ((1, 1, 1, 1), (1, 3)) for master in ("cpu", "device")] +
         [((2, 2), opt, "cpu", True) for opt in OPTIMIZERS] + [((1, 3), "adamw", "cpu", True)])


# The quick suite runs one case per shape, optimizer and master kind (~4 s each on 2 cores); the rest of
# the matrix, and the 4-process shapes, run in the slow suite.
QUICK = {((2, 2), "adamw", "device", False), ((1, 3), "adamw", "cpu", False), ((2, 2), "sgd_nesterov", "cpu", True)}


@pytest.mark.parametrize("counts,opt_name,master,shard", [
    pytest.param(*case, id="x".join(map(str, case[0])) + f"-{case[1]}-{case[2]}" + ("-sharded" if case[3] else ""),
                 marks=[] if case in QUICK else [pytest.mark.slow]) for case in CASES])
def test_processes_x_towers_equal_one_process(tmp_path, counts, opt_name, master, shard):
    """Master weights within two fp32 noise floors of plain full-batch training (Note [Tolerance of
    training equivalence tests]); replicas and the processes' master copies identical bit for bit (checked
    in the workers); the step records sum every process's towers."""
    data = "uneven"
    result = _run(tmp_path, counts, opt_name, master, data, shard)
    want, floor = _reference(opt_name, data)
    assert_params_close(result["master"], want, floor)
    with TowerTrainer(build_model("mlp", seed=0), devices=["cpu"] * sum(counts), master=master,
                      **OPTIMIZERS[opt_name]) as one:
        first = one.train_step(next(iter(workers.digits_loader(data))))
    rec = result["records"][0]
    assert rec["samples"] == first["samples"] == workers.DATA[data][1]
    assert rec["accuracy"] == first["accuracy"]
    # step 1 starts from the same weights on the same slices: the per-tower losses are the same float32
    # numbers, summed in float64 in another order (a few float64 ulps)
    assert rec["loss"] == pytest.approx(first["loss"], rel=1e-12)
    assert len(result["records"]) == STEPS
    # the checkpoint state is the portable, unsharded one: it loads into a one-process trainer whose
    # master then holds the same weights and whose next step matches the processes' state
    with TowerTrainer(build_model("mlp", seed=0), devices=["cpu"] * 2, master=master,
                      **OPTIMIZERS[opt_name]) as back:
        back.load_state_dict(result["state"])
        assert all(torch.equal(a, b) for a, b in zip(back.master_params(), result["master"]))
        moments = result["state"]["master"]["optimizer"]["state"]
        assert len(moments) == len(result["master"])   # every parameter's moments came back


@pytest.mark.parametrize("counts", [(2, 2), pytest.param((1, 3), marks=pytest.mark.slow)], ids=["2x2", "1+3"])
def test_cpu_master_without_overlap_equals_one_process(tmp_path, counts):
    """overlap=False: the CPU master reduces every bucket after backward instead of in the averager's
    hooks; same tolerance as above."""
    result = _run(tmp_path, counts, "adamw", "cpu", "uneven", overlap=False)
    want, floor = _reference("adamw", "uneven")
    assert_params_close(result["master"], want, floor)


def test_debug_mode_catches_processes_whose_weights_drift(tmp_path):
    from _fault_util import read_reports

    run_ranks(workers.debug_replicas_job, 2, args=(str(tmp_path),), timeout_s=120)
    reports = read_reports(tmp_path, 2)
    for r in (0, 1):
        out = reports[r]["outcome"]
        assert reports[r]["checks"] == 2, reports[r]   # debug mode: after every step, not every 100th
        assert out.startswith(f"the replica check after step 2: the replicas differ (this is rank {r})"), out
        # rank 1's drifted master weights, and the tower weights copied from them, named with their first part
        assert "rank 1 master weights differs from rank 0 master weights: first at part 0 (master bucket 0)" in out, out
        assert "rank 1 tower 1 differs from rank 0 tower 0: first at part " in out, out
