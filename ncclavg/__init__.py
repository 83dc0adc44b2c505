"""ncclavg: fused all-reduce averaging of gradient buckets, CPU master weights, multi-tower training.

The compiled core, `ops`, `build_info()` and `ncclavg info` need only numpy. Everything that works on
torch modules (bucket plans, communicators, the averager, optimizers, the trainer) is imported on first
use, so `import ncclavg` works, and says what it has, on a machine without torch.

Layout: the core is this folder (buffers, ops, bucketing, averager, optim, master, the `ncclavg`
command); `ncclavg.comm` holds the Communicator and its backends, `ncclavg.train` TowerTrainer and what
only training needs, `ncclavg.bench` the `ncclavg bench` command. The core imports none of them when it
loads; comm imports only the core; train and bench import comm and the core, never each other
(tests/test_layering.py checks it).
"""
from importlib import import_module as _import_module

from ._version import __version__
from ._ext import cuda_available, cuda_built
from .errors import CollectiveMismatchError, CommError, CommTimeoutError, CudaError, LayoutMismatchError, NcclError
from .info import build_info
from . import ops

# name -> module that defines it; loaded by __getattr__ on first access (PEP 562).
_LAZY = {
    "Bucket": "bucketing", "BucketPlan": "bucketing", "ParamSlot": "bucketing",
    "Communicator": "comm", "Work": "comm",
    "GradientAverager": "averager",
    "MasterWeights": "master",
    "TowerTrainer": "train.trainer",
}
# Modules and subpackages reachable as attributes of `ncclavg` once torch is there.
_LAZY_MODULES = ("optim", "comm", "train", "bench")


def __getattr__(name):
    if name not in _LAZY and name not in _LAZY_MODULES:
        raise AttributeError(f"module 'ncclavg' has no attribute {name!r}")
    try:
        module = _import_module(f".{_LAZY.get(name, name)}", __name__)
    except ModuleNotFoundError as e:
        if e.name == "torch":
            raise ModuleNotFoundError(
                f"ncclavg.{name} needs PyTorch, which is not installed: install the torch build for your "
                "machine (e.g. `pip install torch`), then retry", name="torch") from e
        raise
    value = module if name in _LAZY_MODULES else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY) + list(_LAZY_MODULES))


__all__ = [
    "__version__", "build_info", "cuda_available", "cuda_built", "ops", "optim", "MasterWeights", "TowerTrainer",
    "NcclError", "CudaError", "CommTimeoutError", "LayoutMismatchError", "CommError", "CollectiveMismatchError",
    "Bucket", "BucketPlan", "ParamSlot", "Communicator", "Work", "GradientAverager",
]
