"""ncclavg.comm: the Communicator and its backends (ncclavg's own API).

What lives here: `Communicator` (base.py: the constructors, argument checks, its runner and face) and
one module per backend: local.py (CPU towers of one process, the core's one-pass host average),
gloo.py (CPU towers of several processes through torch.distributed, Note [Hierarchical CPU average],
over the transport's shared-memory channel where processes share a host), nccl.py (the core's NCCL
communicator); dist.py (the bounded torch.distributed exchanges, as jobs of the runner), devices.py (the
one parser of device arguments, for every backend and the trainer), fast_average.py (the native fast path of
a small average, on one host's channel or the lanes between hosts) and debug.py (NCCLAVG_DEBUG's cross-rank sequence check). `Work` is
the transport's (ncclavg/transport/work.py). Two old addresses stay as aliases: flight.py (ncclavg.transport.flight)
and backend_lane.py (the torch backend's errors, now in ncclavg.errors).
What it may import: the core (`ncclavg.ops`, `buffers`, `_ext`, `errors`, ...), `ncclavg.transport`
and torch; never `ncclavg.process_group` (the torch face sits above this one), `ncclavg.train` or
`ncclavg.bench`.
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
