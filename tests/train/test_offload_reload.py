"""GpuOffloadEngine.load_master_state waits for the copy streams before it overwrites the pinned
host_params: the last step's non-blocking H2D copies may still be reading them (the towers' streams
waited for those copies, the host did not).

No GPU here, so this is a stand-in: the engine is built over CPU "towers" with torch.cuda.Stream replaced
by a stream that records its synchronize() calls, and the master's copy_out (the only writer of
host_params in a reload) records when it runs. What it shows is the order of the host's calls; a real
DMA race needs a GPU (tests/train/test_trainer_gpu.py::test_gpu_resume_continues_the_run[cpu]).
"""
from __future__ import annotations

import torch

from ncclavg.train import offload
from ncclavg.train.engines import OptimConfig


class RecordingStream:
    """Stands in for torch.cuda.Stream: synchronize() is logged, nothing else is used by a reload."""

    def __init__(self, log, device=None):
        self.log, self.device = log, device

    def synchronize(self):
        self.log.append(("synchronize", id(self)))


class OneTowerComm:
    """The communicator attributes the engine reads when it is built and closed; a reload uses none."""
    size, timeout = 1, 10.0

    def close(self):
        pass


def test_reload_synchronizes_every_copy_stream_before_overwriting_host_params(monkeypatch):
    log = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: RecordingStream(log, device))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    params = [p for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    opt = OptimConfig("adamw", 1e-3, 0.0, 0.0, False, (0.9, 0.999), 1e-8)
    engine = offload.GpuOffloadEngine([params], names, [torch.device("cpu")], opt, bucket_cap_mb=0.0005,
                                      first_bucket_mb=0.0005, comm=OneTowerComm())
    try:
        assert len(engine.plan.buckets) > 1 and len(engine.copy_streams) == 1
        state = engine.master_state()
        for p in state["params"]:
            p.add_(1.0)   # a checkpoint whose weights differ from the towers'
        real_copy_out = engine.master.copy_out

        def copy_out(*args, **kw):
            log.append(("copy_out", kw.get("bucket")))
            return real_copy_out(*args, **kw)

        monkeypatch.setattr(engine.master, "copy_out", copy_out)
        engine.load_master_state(state)
        synced = {i for what, i in log if what == "synchronize"}
        first_write = next(k for k, (what, _) in enumerate(log) if what == "copy_out")
        assert synced == {id(s) for s in engine.copy_streams}, log
        assert all(what == "synchronize" for what, _ in log[:first_write]), log
        for p, saved in zip(params, state["params"]):   # and the towers hold the checkpoint's weights
            assert torch.equal(p.detach(), saved.to(p.dtype).view_as(p))
    finally:
        engine.close()
