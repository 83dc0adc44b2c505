"""gloo backend with 2 and 4 processes on loopback (spawned, bounded): collectives, and GradientAverager
against torch DDP(gloo) on the same model and data."""

import _gloo_workers
import pytest
from _dist_util import run_ranks


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_collectives_and_averager_match_ddp(world):
    run_ranks(_gloo_workers.collectives_and_ddp, world, timeout_s=180)


def test_gloo_wait_times_out():
    run_ranks(_gloo_workers.timeout_job, 2, timeout_s=60)
