"""The finiteness noted by the passes that write the gradients, across processes (2-3 ranks, loopback,
bounded): the channel's checked sums, the gloo communicator and GradientAverager on both of its paths
between processes (the shared-memory channel and torch.distributed), and the DDP hook. Bodies in
tests/_finite_workers.py."""
import pytest

import _finite_workers as W
from _dist_util import run_ranks
from _transport_shm_util import run


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])   # 3: ~7 s, with the slow tests
def test_channel_sums_flag_what_every_rank_writes(world):
    out = run(W.channel_sums, world, 64 << 10, timeout_s=240)
    assert [m[1] for m in out] == ["ok"] * world, out
    assert len({tuple(m[2]) for m in out}) == 1, "the ranks disagree on a flag"


@pytest.mark.parametrize("shm", ["1", "0"])
@pytest.mark.parametrize("ntowers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_averaged_gradients_flag_a_value_on_any_rank(shm, ntowers):
    run_ranks(W.averager_job, 3 if ntowers == 1 else 2, args=(ntowers, shm, "float32"), timeout_s=300)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_averaged_half_gradients_flag_a_value_on_any_rank(dtype):
    run_ranks(W.averager_job, 2, args=(1, "1", dtype), timeout_s=300)


def test_ddp_hook_flag_skips_on_every_rank():
    run_ranks(W.ddp_hook_job, 2, timeout_s=240)


@pytest.mark.parametrize("overlap", [True, False])
def test_trainer_hands_the_reduction_s_answer_to_the_master_step(overlap):
    run_ranks(W.trainer_job, 2, args=(overlap,), timeout_s=240)
