"""A rank of the faults-between-hosts tests (test_two_hosts_faults.py), run by torchrun inside a network
namespace that stands for a host (tests/_netns.py):

    python _hosts_fault_workers.py FACE OUTDIR TIMEOUT SURVIVORS

FACE: "backend" (dist.init_process_group("ncclavg") and dist.all_reduce), "ddp" (stock DDP on that
backend) or "api" (gloo's process group under Communicator.from_torch_distributed(device="cpu") and
all_reduce_avg). Each rank warms up, says it is ready (OUTDIR/ready<rank>, its transport inside), then
runs collectives until one fails: the test injects its fault (a rank killed, the link cut, a host
frozen) while they run, so the fault lands mid-collective. The rank then writes what it raised, when
(time.monotonic(), one clock for every namespace of the machine) and what the next call says, to
OUTDIR/rank<rank>.json, and exits with status 1, as a rank whose collective failed would.
Two things a test of ncclavg's verdict must keep out of the way, both torchrun's, not ncclavg's:
- a torchrun agent ends its node's other ranks (SIGTERM) as soon as one of them exits: each rank notes
  that signal and goes on, so that a survivor's error is its own collective's (its timeout bounds it);
- host 0's agent hosts the store that names a lost rank (the heartbeats), and exits with its node's
  ranks: a rank that has reported waits (bounded) until every rank of SURVIVORS (comma-separated) has.
"""
import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

NUMEL = 1 << 18   # 1 MiB of float32 a call: long enough on the link that a fault lands inside one


def _report(outdir, name, **fields):
    tmp = os.path.join(outdir, f".{name}.json")
    with open(tmp, "w") as f:
        json.dump(fields, f)
    os.replace(tmp, os.path.join(outdir, f"{name}.json"))


def _error(e):
    return {"type": type(e).__name__, "classes": [c.__name__ for c in type(e).__mro__], "msg": str(e)}


class Backend:
    """dist.all_reduce on the `ncclavg` backend."""

    def __init__(self, timeout):
        import ncclavg  # noqa: F401  (registers the backend)

        dist.init_process_group("ncclavg", timeout=datetime.timedelta(seconds=timeout))
        self.transport = dist.group.WORLD.transport   # "shm+gloo": a channel per host; "gloo": none
        self.x = torch.ones(NUMEL)

    def step(self):
        dist.all_reduce(self.x)

    def later(self):
        dist.all_reduce(torch.ones(2))


class DDP(Backend):
    """Stock DDP on the `ncclavg` backend: one bucket of ~1 MiB a step."""

    def __init__(self, timeout):
        super().__init__(timeout)
        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(0)
        self.model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 2)))
        self.data = torch.randn(8, 512)

    def step(self):
        self.model(self.data).sum().backward()


class Api:
    """Communicator.from_torch_distributed(device="cpu") over gloo's process group: all_reduce_avg."""

    def __init__(self, timeout):
        from ncclavg import Communicator

        # gloo's own timeout far above the communicator's: the communicator's must be what fires
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10 * timeout))
        self.comm = Communicator.from_torch_distributed(device="cpu", timeout=timeout)
        self.transport = self.comm.transport   # as the backend's
        self.x = torch.ones(NUMEL)

    def step(self):
        self.comm.all_reduce_avg([self.x])

    def later(self):
        self.comm.all_reduce_avg([torch.ones(2)])


FACES = {"backend": Backend, "ddp": DDP, "api": Api}


def main(face, outdir, timeout, survivors):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    terminated = []
    signal.signal(signal.SIGTERM, lambda *_: terminated.append(time.monotonic()))
    job = FACES[face](timeout)
    for _ in range(3):
        job.step()
    _report(outdir, f"ready{rank}", transport=job.transport, pid=os.getpid())
    calls = 0
    try:
        while True:
            job.step()
            calls += 1
    except Exception as e:   # noqa: BLE001 (reported for the test to judge)
        raised = time.monotonic()
        fields = dict(_error(e), raised=raised, calls=calls)
    try:
        job.later()
        fields["later"] = "no error"
    except Exception as e:   # noqa: BLE001
        fields["later"] = f"{type(e).__name__}: {e}"
    fields["sigterm"] = terminated[:1]
    _report(outdir, f"rank{rank}", **fields)
    deadline = time.monotonic() + 4 * timeout   # the others raise within a few timeouts, or the test fails
    while time.monotonic() < deadline and not all(os.path.exists(os.path.join(outdir, f"rank{r}.json"))
                                                  for r in survivors):
        time.sleep(0.05)
    from ncclavg.comm import end_process

    end_process(1)   # the process group is broken: skip its teardown


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), [int(r) for r in sys.argv[4].split(",")])
