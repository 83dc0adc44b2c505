"""Bad input to the boundary and to average_: a clear error naming the argument, nothing modified."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ncclavg
from ncclavg import _C
from ncclavg.buffers import Buffer, as_buffer


def _snapshot(xs):
    return [x.clone() if isinstance(x, torch.Tensor) else np.array(x, copy=True) for x in xs]


def _unchanged(xs, snap):
    for x, s in zip(xs, snap):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, s)
        else:
            np.testing.assert_array_equal(x, s)


CASES = {
    "mismatched sizes": (lambda: [torch.ones(4), torch.ones(5)], ValueError, "buffers[1]"),
    "mismatched dtypes": (lambda: [torch.ones(4), torch.ones(4, dtype=torch.float16)], TypeError, "buffers[1]"),
    "non-contiguous": (lambda: [torch.ones(4, 4).t(), torch.ones(4, 4)], ValueError, "buffers[0]"),
    "integer dtype": (lambda: [torch.ones(4, dtype=torch.int32)] * 2, TypeError, "buffers[0]"),
    "float64 dtype": (lambda: [torch.ones(4, dtype=torch.float64)] * 2, TypeError, "buffers[0]"),
    "read-only numpy": (lambda: [np.ones(4, np.float32), np.ones(4, np.float32)], ValueError, "buffers[1]"),
    "same buffer twice": (lambda: (lambda t: [t, torch.ones(4), t])(torch.ones(4)), ValueError, "share memory"),
    "overlapping views": (lambda: (lambda t: [t[0:6], t[4:10]])(torch.ones(10)), ValueError, "share memory"),
    "not a tensor": (lambda: [torch.ones(2), [1.0, 2.0]], TypeError, "buffers[1]"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_average_rejects(case):
    make, exc, needle = CASES[case]
    xs = make()
    if case == "read-only numpy":
        xs[1].flags.writeable = False
    snap = _snapshot(xs)
    with pytest.raises(exc, match=needle.replace("[", r"\[").replace("]", r"\]")):
        ncclavg.ops.average_(xs)
    _unchanged(xs, snap)


def test_empty_list():
    with pytest.raises(ValueError, match="buffers.*empty"):
        ncclavg.ops.average_([])


def test_not_a_list():
    with pytest.raises(TypeError, match="buffers"):
        ncclavg.ops.average_(torch.ones(3))


def test_gpu_tensor_on_cpu_only_build_or_machine():
    # A descriptor that claims to be on cuda:0: a CPU-only build must refuse it by name; a CUDA build
    # must refuse it before touching memory when it is a fake pointer on a machine without a device.
    bufs = [Buffer(4096, 4, 0, 0, False), Buffer(8192, 4, 0, 0, False)]
    if not ncclavg.cuda_built():
        with pytest.raises(ValueError, match="no CUDA support"):
            _C.average_(bufs)
    elif not ncclavg.cuda_available():
        with pytest.raises(ncclavg.CudaError):
            _C.average_(bufs)


def test_meta_device_rejected():
    with pytest.raises(ValueError, match="device meta"):
        as_buffer(torch.ones(3, device="meta"), "x")


def test_core_revalidates_raw_descriptors():
    # The C++ side checks again, so a raw Buffer cannot bypass validation.
    a = torch.ones(8)
    with pytest.raises(ValueError, match="readonly|read-only"):
        _C.average_([Buffer(a.data_ptr(), 8, 0, -1, True), Buffer(torch.ones(8).data_ptr(), 8, 0, -1, False)])
    with pytest.raises(TypeError, match="dtype"):
        Buffer(a.data_ptr(), 8, 7, -1, False)
    with pytest.raises(ValueError, match="numel"):
        Buffer(a.data_ptr(), -1, 0, -1, False)
    with pytest.raises(ValueError, match="null"):
        Buffer(0, 8, 0, -1, False)
    with pytest.raises(ValueError, match="aligned"):
        Buffer(a.data_ptr() + 2, 4, 0, -1, False)


def test_bad_simd_level_names_argument():
    with pytest.raises(ValueError, match="level"):
        _C.set_simd_level("sse9")
    assert _C.simd_level() in _C.simd_levels_supported()


def test_a_tensor_subclass_from_outside_torch_is_a_torch_tensor():
    # A user's (or a library's) torch.Tensor subclass is a torch tensor to the buffer layer, wherever its
    # class was defined; before, only classes whose module starts with "torch" were.
    class Mine(torch.Tensor):
        pass

    t = torch.arange(6, dtype=torch.float32).as_subclass(Mine)
    b = as_buffer(t, "grad")
    assert (b.ptr, b.numel) == (t.data_ptr(), 6)
    with pytest.raises(TypeError, match="grad: dtype torch.int64"):
        as_buffer(torch.arange(3).as_subclass(Mine), "grad")
