"""ncclavg.comm: the Communicator and its backends.

What lives here: `Communicator` (base.py: the constructors, argument checks, failure state) and `Work`,
and one module per backend: local.py (CPU towers of one process, the core's one-pass host average),
gloo.py (CPU towers of several processes through torch.distributed, Note [Hierarchical CPU average]),
shm.py (gloo.py's transport between processes that share a host: the core's shared-memory channel),
dist.py (the bounded torch.distributed plumbing), nccl.py (the core's NCCL communicator), plus
liveness.py (heartbeats that name a lost rank) and debug.py (NCCLAVG_DEBUG's cross-rank sequence check).
The torch-facing adapters, loaded only on use (never by this __init__): torch_backend.py (the `ncclavg`
torch.distributed backend, registered lightly by ncclavg/__init__.py) with backend_lane.py (its ordered
worker, works and errors), backend_setup.py (its host channels and heartbeats) and backend_cpu.py (its CPU
collectives); ddp_hook.py (the DDP comm hook behind ncclavg.ddp) and fsdp_comms.py (FSDP2 custom comms).
What it may import: the core (`ncclavg.ops`, `buffers`, `_ext`, `errors`, ...) and torch; never
`ncclavg.train` or `ncclavg.bench`.
Where to start reading: base.py's `Communicator`, then local.py, the simplest backend.
"""
from .._ext import default_nccl_runtime_connect

# First, before anything here can make an NCCL communicator: See Note [Setting NCCL_RUNTIME_CONNECT once]
# in ncclavg/_ext.py.
default_nccl_runtime_connect()

from .base import CompletedWork, Communicator, Work, default_timeout, register_backend  # noqa: E402
from .dist import end_process  # noqa: E402
from .gloo import GlooCommunicator  # noqa: E402
from .local import LocalCommunicator  # noqa: E402
from .nccl import NcclCommunicator  # noqa: E402

# See Note [Backend table] in base.py.
for _cls in (LocalCommunicator, GlooCommunicator, NcclCommunicator):
    register_backend(_cls)
del _cls

__all__ = ["Communicator", "Work", "CompletedWork", "LocalCommunicator", "GlooCommunicator", "NcclCommunicator",
           "default_timeout", "register_backend", "end_process"]
