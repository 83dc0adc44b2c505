"""Stock DDP on the `ncclavg` backend on two hosts for real: two network namespaces joined by a veth pair
(Note [Two hosts from network namespaces] in tests/_netns.py), one torchrun node of 2 processes in each.
The group's transport is shm+gloo (a channel per host, gloo between the hosts' leaders), the gradients
cross the veth, and the four replicas end identical."""
import os
import re
import subprocess

import pytest
from _netns import two_hosts_fixture
from _paths import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture
def hosts():
    yield from two_hosts_fixture()


def test_stock_ddp_on_two_hosts_uses_a_channel_per_host(hosts):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    script = [str(ROOT / "examples" / "stock_ddp.py"), "--epochs", "1"]
    procs = [subprocess.Popen(hosts.torchrun(k, *script, nproc=2), env=hosts.env(k, env), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for k in (1, 0)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out1, out0 = outs
    assert [p.returncode for p in procs] == [0, 0], out0[-3000:] + out1[-3000:]
    m = re.search(r"stock_ddp: test_accuracy=(\d\.\d+) backend=ncclavg world_size=4 hook=off "
                  r"replicas_identical=True transport=shm\+ucx", out0)
    assert m and float(m.group(1)) > 0.6, out0[-3000:]
    # every step's bucket crossed the link between the hosts: one epoch is 6 steps of the global batch of 256
    # (4 x 64) over 1438 samples, and the MLP has 17 k fp32 gradients; each host receives the other's sum of
    # the whole bucket (a shard on each of its two lanes)
    assert hosts.rx_bytes(0) > 5 * 17_000 * 4 and hosts.rx_bytes(1) > 5 * 17_000 * 4
