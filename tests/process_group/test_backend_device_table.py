"""The `ncclavg` backend's collectives by device type (Note [Device types] in
ncclavg/process_group/devices.py): each collective's CUDA tensors reach the inner NCCL group's method for
the same call, on a machine without CUDA (tensors that answer as CUDA tensors, an NCCL group that records)."""
import ast
import inspect
import textwrap

import _process_group_device_workers as W
from _dist_util import run_ranks

from ncclavg.process_group.devices import NcclCollectives
from ncclavg.process_group.group import ProcessGroupNcclavg


def test_every_collective_routes_cuda_tensors_to_the_nccl_group():
    run_ranks(W.routes_job, 2, timeout_s=120)


def test_every_tensor_method_of_the_group_asks_for_its_device_first():
    """A collective added to the group without a CUDA implementation, or that does not ask, would take CUDA
    tensors down the CPU path."""
    untouched = {"barrier", "monitored_barrier", "start_coalescing", "end_coalescing", "barrier_free_marker",
                 "submit_custom", "shutdown", "abort", "getBackendName", "name", "cpu", "straggler_report"}
    methods = {v.__name__ for n, v in vars(ProcessGroupNcclavg).items()
               if callable(v) and not n.startswith("_") and n not in untouched}
    cuda = {n for n in vars(NcclCollectives) if not n.startswith("_")}
    assert methods == cuda, methods ^ cuda
    for name in methods:
        fn = ast.parse(textwrap.dedent(inspect.getsource(getattr(ProcessGroupNcclavg, name)))).body[0]
        body = [st for st in fn.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
        first = ast.unparse(body[0])
        assert first.startswith("device = self._device("), (name, first)   # before any check of the CPU path
        assert ast.unparse(body[1]) == f"if device is not None:\n    return device.{name}" + \
            ast.unparse(body[1].body[0].value)[len(f"device.{name}"):], (name, ast.unparse(body[1]))
