"""The `ncclavg` backend's device table (Note [The device table] in ncclavg/process_group/device_table.py):
each collective's CUDA tensors reach the inner NCCL group's method for the same call, on a machine
without CUDA (tensors that answer as CUDA tensors, an NCCL group that records)."""
import _process_group_device_workers as W
from _dist_util import run_ranks

from ncclavg.process_group import device_table
from ncclavg.process_group.group import ProcessGroupNcclavg


def test_every_collective_routes_cuda_tensors_to_the_nccl_group():
    run_ranks(W.routes_job, 2, timeout_s=120)


def test_the_table_covers_every_tensor_method_of_the_group():
    """A collective added to the group without an entry would take CUDA tensors down the CPU path."""
    untouched = {"barrier", "monitored_barrier", "start_coalescing", "end_coalescing", "barrier_free_marker",
                 "submit_custom", "shutdown", "abort", "getBackendName", "name"}
    methods = {n for n, v in vars(ProcessGroupNcclavg).items()
               if callable(v) and not n.startswith("_") and n not in untouched}
    routed = {n for n in methods if hasattr(getattr(ProcessGroupNcclavg, n), "__wrapped__")}
    assert methods == routed, methods - routed
    assert set(device_table.TABLE) <= methods, set(device_table.TABLE) - methods
