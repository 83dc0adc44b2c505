"""Stock torch DDP and FSDP2 on the `ncclavg` backend, and the ncclavg.ddp hook, against the same runs on
gloo in the same processes: weights and BatchNorm buffers bit for bit at 2 processes, gradients within a
tolerance derived from the summation order at 3 and 4 (see tests/_process_group_ddp_workers.py)."""
import _process_group_ddp_workers as W
import pytest
from _dist_util import run_ranks


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_stock_ddp_on_ncclavg_matches_gloo(world):
    run_ranks(W.ddp_job, world, timeout_s=240)


@pytest.mark.slow
def test_stock_ddp_on_ncclavg_matches_gloo_four_processes():
    run_ranks(W.ddp_job, 4, timeout_s=400)


# the hook on a DDP model built over ncclavg, and over gloo (the hook makes its own ncclavg group)
@pytest.mark.parametrize("group", ["ncclavg", pytest.param("gloo", marks=pytest.mark.slow)])
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_ddp_hook_matches_stock_ddp(group, world):
    run_ranks(W.ddp_job, world, args=((group, None),), timeout_s=240)


@pytest.mark.parametrize("group", [pytest.param("ncclavg", marks=pytest.mark.slow), pytest.param("gloo", marks=pytest.mark.slow)])
def test_ddp_hook_bfloat16_wire(group, monkeypatch):
    # over gloo the bfloat16 wire takes the all-to-all path (fp32 adds), over ncclavg the channel's sum
    run_ranks(W.ddp_job, 3, args=((group, "bfloat16"),), timeout_s=240)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_fsdp2_on_ncclavg_matches_gloo(world):
    run_ranks(W.fsdp2_job, world, timeout_s=240)


def test_distributed_checkpoint_and_object_collectives(tmp_path):
    run_ranks(W.checkpoint_job, 2, args=(str(tmp_path / "ckpt"),), timeout_s=240)


@pytest.mark.slow   # ~3 s
def test_stock_ddp_with_sparse_gradients_matches_gloo():
    run_ranks(W.sparse_ddp_job, 2, timeout_s=240)
