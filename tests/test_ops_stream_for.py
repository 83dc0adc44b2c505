"""ops._stream_for on a CPU, with a stand-in cupy: a cupy array's work goes on the current stream of the
ARRAY's device, not on the current device's (each device has its own current stream in cupy)."""
from __future__ import annotations

import sys
import types

from ncclavg import ops


class FakeDevice:
    """cupy.cuda.Device: a context manager that makes its device current."""

    current = 0

    def __init__(self, id):
        self.id = id

    def __enter__(self):
        self._prev, FakeDevice.current = FakeDevice.current, self.id
        return self

    def __exit__(self, *exc):
        FakeDevice.current = self._prev


def fake_cupy():
    mod = types.ModuleType("cupy")
    mod.cuda = types.SimpleNamespace(
        get_current_stream=lambda: types.SimpleNamespace(ptr=1000 + FakeDevice.current),  # one stream per device
        Device=FakeDevice)
    return mod


def test_cupy_array_uses_the_stream_of_its_own_device(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    Array = type("ndarray", (), {"__module__": "cupy._core.core"})
    x = Array()
    x.device = FakeDevice(3)
    FakeDevice.current = 0
    assert ops._stream_for(x) == 1003, "took the current device's stream, not the array's"
    assert FakeDevice.current == 0, "the caller's current device must be restored"
