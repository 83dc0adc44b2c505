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


def _run(tmp_path, counts, opt_name, master, data):
    run_ranks(workers.train_job, len(counts), args=(counts, OPTIMIZERS[opt_name], master, data, STEPS,
                                                   str(tmp_path)), timeout_s=240)
    return torch.load(tmp_path / "result.pt")


# Every optimizer and master on 2 x 2; the other shapes (4 x 1, and processes with 1 and 3 towers) with
# AdamW, the optimizer that amplifies a wrong average most. 4 processes cost ~15 s each on 2 cores.
CASES = ([((2, 2), opt, master) for opt in OPTIMIZERS for master in ("cpu", "device")] +
         [(counts, "adamw", master) for counts in ((1, 1, 1, 1), (1, 3)) for master in ("cpu", "device")])


@pytest.mark.parametrize("counts,opt_name,master", CASES,
                         ids=["x".join(map(str, c)) + f"-{o}-{m}" for c, o, m in CASES])
def test_processes_x_towers_equal_one_process(tmp_path, counts, opt_name, master):
    """Master weights within two fp32 noise floors of plain full-batch training (Note [Tolerance of
    training equivalence tests]); replicas and the processes' master copies identical bit for bit (checked
    in the workers); the step records sum every process's towers."""
    data = "uneven"
    result = _run(tmp_path, counts, opt_name, master, data)
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
