"""Several CPU towers per process over gloo (Note [Hierarchical CPU average] in ncclavg/comm/gloo.py):
2 to 3 spawned processes on loopback, equal and unequal tower counts, with and without predivide."""
import _comm_gloo_tower_workers
import pytest
from _dist_util import run_ranks

from ncclavg import Communicator


@pytest.mark.parametrize("counts,predivide", [((2, 2), False), ((1, 3), False), ((3, 1, 2), False),
                                              ((2, 2), True), ((1, 2), True)])
def test_collectives_over_towers_of_every_process(counts, predivide):
    run_ranks(_comm_gloo_tower_workers.collectives, len(counts), args=(counts, predivide), timeout_s=180)


@pytest.mark.parametrize("counts", [(2, 2), (1, 3)])
def test_averager_over_towers_of_every_process(counts):
    run_ranks(_comm_gloo_tower_workers.averager, len(counts), args=(counts,), timeout_s=180)


@pytest.mark.parametrize("devices,match", [
    ("cpu", "non-empty list"), ([], "non-empty list"), (["cpu", "meta"], "mixes"), (["cpu:1"], "CPU towers"),
    ([3.5], r"devices\[0\]"),
])
def test_bad_devices_name_the_argument(devices, match):
    with pytest.raises(ValueError, match=match):
        Communicator.from_torch_distributed(devices=devices)


def test_device_and_devices_together_are_refused():
    with pytest.raises(ValueError, match="either device"):
        Communicator.from_torch_distributed(device="cpu", devices=["cpu"])


def test_towers_argument_is_checked():
    from ncclavg.comm.base import check_count

    assert check_count(3, "towers") == 3
    with pytest.raises(ValueError, match="towers"):
        check_count(0, "towers")
    with pytest.raises(TypeError, match="towers"):
        check_count(True, "towers")
    with pytest.raises(TypeError, match="towers"):
        check_count(2.5, "towers")
