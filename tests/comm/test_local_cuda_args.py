"""Argument handling of the local backend's `device` (towers sharing one GPU) and of the trainer's
communicator choice (`tower_communicator`), on any machine: where a check needs "torch sees a GPU", torch's
answers are patched, and nothing here launches CUDA work (the errors come before any). The CUDA behaviour
itself is tested in tests/test_gpu_averager.py."""
import inspect

import pytest
import torch

import ncclavg.comm.local as local_mod
from ncclavg import GradientAverager
from ncclavg.comm import Communicator, LocalCommunicator
from ncclavg.train.engines import tower_communicator


@pytest.fixture
def fake_gpus(monkeypatch):
    """torch reports `n` CUDA devices (current: 0) and this build has CUDA; nothing else is faked."""
    def install(n: int = 1):
        monkeypatch.setattr(local_mod, "cuda_built", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return install


@pytest.mark.parametrize("device", ["cpu", "CPU", "cpu:0", torch.device("cpu")])
def test_cpu_device_is_the_default_backend(device):
    comm = LocalCommunicator(3, device=device)
    assert comm.devices == ["cpu"] * 3 and comm.local_size == 3
    xs = [torch.full((5,), float(k)) for k in range(3)]
    comm.all_reduce_avg(xs)
    assert all(torch.equal(x, torch.ones(5)) for x in xs)
    comm.close()


@pytest.mark.parametrize("device, exc, match", [
    (True, TypeError, "device: expected"),
    (1.5, TypeError, "device: expected .* got float"),
    ([0], TypeError, "device: expected .* got list"),
    (-1, ValueError, "device: a GPU ordinal must be >= 0"),
    ("gpu0", ValueError, "device: unknown device 'gpu0'"),
    ("meta", ValueError, "device: meta is not supported"),
    ("cpu:1", ValueError, "device: cpu:1 is not a device: CPU towers all run on the one 'cpu'"),
    (torch.device("cpu", 2), ValueError, "device: cpu:2 is not a device"),
])
def test_bad_device_names_the_argument(device, exc, match):
    with pytest.raises(exc, match=match):
        LocalCommunicator(2, device=device)


def test_cuda_device_without_cuda_says_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for dev in ("cuda:0", "cuda", 0, torch.device("cuda", 1)):
        with pytest.raises(ValueError, match=r"device: cuda(:\d)? needs a GPU, and torch sees none: "):
            LocalCommunicator(2, device=dev)
    monkeypatch.setattr(local_mod, "cuda_built", lambda: False)
    with pytest.raises(ValueError, match="device: cuda:0 needs ncclavg built with CUDA support.*CPU-only"):
        LocalCommunicator(2, device="cuda:0")


def test_cuda_device_index_and_tower_limit(fake_gpus):
    fake_gpus(2)
    with pytest.raises(ValueError, match=r"device: cuda:2 does not exist \(2 visible"):
        LocalCommunicator(2, device="cuda:2")
    with pytest.raises(ValueError, match="n: at most 256 towers can share one GPU"):
        LocalCommunicator(257, device="cuda:1")
    with pytest.raises(ValueError, match="n: must be >= 1"):
        LocalCommunicator(0, device="cuda:0")
    for spec, want in (("cuda", "cuda:0"), (1, "cuda:1"), ("cuda:1", "cuda:1"), (torch.device("cuda", 0), "cuda:0")):
        comm = LocalCommunicator(4, device=spec)
        assert comm.devices == [want] * 4 and comm.size == 4, spec
        comm.close()


def test_cpu_tensors_on_a_gpu_communicator_are_refused(fake_gpus):
    fake_gpus(1)
    comm = LocalCommunicator(2, device="cuda:0")
    a, b = torch.ones(4), torch.full((4,), 3.0)
    for call in (lambda: comm.all_reduce_avg([a, b]), lambda: comm.all_reduce_avg_async([a, b]),
                 lambda: comm.reduce_scatter_avg([a, b], [torch.ones(2), torch.ones(2)])):
        with pytest.raises(ValueError, match=r"\[0\]: is on cpu but local tower 0 of this communicator is on cuda:0"):
            call()
    assert torch.equal(a, torch.ones(4)) and torch.equal(b, torch.full((4,), 3.0))
    towers = [[torch.zeros(3, requires_grad=True)] for _ in range(2)]
    with pytest.raises(ValueError, match=r"towers\[0\]\[0\]: is on cpu but the communicator's local tower 0 is "
                                         "on cuda:0"):
        GradientAverager(comm, towers)
    assert all(t[0].grad is None for t in towers)   # nothing was changed
    comm.close()


def test_public_constructor_passes_the_device():
    if "device" not in inspect.signature(Communicator.local).parameters:
        pytest.skip("Communicator.local has no device argument yet (ncclavg/comm/base.py)")
    comm = Communicator.local(2, device="cpu")
    assert isinstance(comm, LocalCommunicator) and comm.devices == ["cpu", "cpu"]
    with pytest.raises(ValueError, match="device: unknown device"):
        Communicator.local(2, device="gpu0")
    assert Communicator.local(2).devices == ["cpu", "cpu"]


# ---------------------------------------------------------------- the trainer's choice of communicator
def test_tower_communicator_cpu_towers_use_local():
    comm = tower_communicator([torch.device("cpu")] * 3)
    assert (comm.backend, comm.size, comm.devices) == ("local", 3, ["cpu"] * 3)
    comm.close()


def test_tower_communicator_towers_sharing_one_gpu_use_local(fake_gpus):
    fake_gpus(2)
    for devs in (["cuda:1"] * 4, ["cuda:0"], [torch.device("cuda", 0)] * 2):
        comm = tower_communicator(devs)
        assert comm.backend == "local" and comm.size == len(devs)
        assert comm.devices == [str(torch.device(devs[0]))] * len(devs)
        comm.close()


def test_tower_communicator_distinct_gpus_use_nccl(monkeypatch):
    calls = []
    monkeypatch.setattr(Communicator, "nccl", classmethod(lambda cls, devices, *a, **k: calls.append(list(devices))))
    tower_communicator([torch.device("cuda", 0), torch.device("cuda", 1)])
    tower_communicator(["cuda:3", "cuda:1", "cuda:2"])
    assert calls == [[0, 1], [3, 1, 2]]


@pytest.mark.parametrize("devs, match", [
    (["cpu", "cuda:0"], r"devices: cpu,cuda:0 mixes cpu and cuda towers"),
    (["cuda:0", "cuda:0", "cuda:1"], r"devices: cuda:0,cuda:0,cuda:1 puts several towers on some GPUs "
                                     r"\(cuda:0 x2, cuda:1 x1\)"),
    (["cuda:0", "cuda:1", "cuda:0", "cuda:1"], r"several towers on some GPUs \(cuda:0 x2, cuda:1 x2\)"),
    ([], "devices: the list is empty"),
])
def test_tower_communicator_refuses_mixtures(devs, match):
    with pytest.raises(ValueError, match=match):
        tower_communicator(devs)


@pytest.mark.parametrize("value", [True, 1.5, -1, "gpu0", "meta", "cuda:0", "cuda", 0, "7"])
def test_the_local_device_and_the_trainers_devices_read_alike(value, monkeypatch):
    """One parser behind both arguments: the same value fails the same way, each naming its argument."""
    from ncclavg.train.towers import parse_device

    monkeypatch.setattr(local_mod, "cuda_built", lambda: True)   # past the local-only build check
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises((TypeError, ValueError)) as local_err:
        LocalCommunicator(2, device=value)
    with pytest.raises((TypeError, ValueError)) as trainer_err:
        parse_device(value, "devices[3]")
    assert local_err.type is trainer_err.type
    assert str(local_err.value).replace("device:", "devices[3]:", 1) == str(trainer_err.value)


def test_a_digit_string_is_a_gpu_ordinal_for_both(fake_gpus):
    from ncclavg.train.towers import parse_device

    fake_gpus(2)
    assert parse_device("1", "devices[0]") == torch.device("cuda", 1)
    comm = LocalCommunicator(2, device=" 1 ")
    assert comm.devices == ["cuda:1"] * 2
    comm.close()
