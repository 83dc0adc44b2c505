"""The `ncclavg` torch.distributed backend with 2-4 spawned processes on loopback: every collective x dtype x
op against gloo's result in the same processes (bit for bit: the inputs are exact in any summation order),
through the shared-memory channel (the default on one host), through gloo alone (NCCLAVG_SHM=0) and across
pretend hosts (shm+gloo); subgroups and a 2-D DeviceMesh; sizes that differ across ranks."""
import _process_group_workers as W
import pytest
from _dist_util import run_ranks


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_collectives_match_gloo(world, monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", "auto")
    run_ranks(W.collectives_job, world, timeout_s=240)


@pytest.mark.slow
@pytest.mark.parametrize("shm", ["auto", "0"])
def test_collectives_match_gloo_four_processes(shm, monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", shm)
    run_ranks(W.collectives_job, 4, timeout_s=400)


@pytest.mark.slow   # ~4 s; tests/transport/test_hosts_algorithm.py runs a group without a channel in the quick suite
def test_collectives_without_the_channel(monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", "0")
    run_ranks(W.collectives_job, 2, timeout_s=240)


# Interleaved pretend hosts: gathers come back in rank order, broadcasts from a root other than 0 go
# through gloo between the hosts (Note [Which CPU collectives take the channel]).
@pytest.mark.slow
def test_collectives_across_pretend_hosts(monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", "auto")
    run_ranks(W.collectives_job, 4, args=((0, 1, 0, 1),), timeout_s=400)


def test_subgroups_and_device_mesh(monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", "auto")
    run_ranks(W.subgroups_job, 4, timeout_s=240)


def test_mismatched_sizes_fail_on_every_rank(monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", "auto")
    run_ranks(W.mismatch_job, 2, timeout_s=120)


def test_file_init_destroy_and_init_again(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", "auto")
    run_ranks(W.reinit_job, 2, args=([str(tmp_path / "init1"), str(tmp_path / "init2")],), timeout_s=120)
