"""ncclavg: fused all-reduce averaging of gradient buckets, CPU master weights, multi-tower training.

The compiled core, `ops`, `build_info()` and `ncclavg info` need only numpy. Everything that works on
torch modules (bucket plans, communicators, the averager, optimizers, the trainer) is imported on first
use, so `import ncclavg` works, and says what it has, on a machine without torch.

Layout: the core is this folder (buffers, ops, bucketing, averager, optim, master, errors, the `ncclavg`
command); `ncclavg.transport` holds what both communication faces use (the shared-memory channel's
Python side, call signatures, heartbeats, the flight recorder, profiler ranges); `ncclavg.comm` the
Communicator and its backends; `ncclavg.process_group` the `ncclavg` torch.distributed backend (its
ProcessGroup, CPU collectives, DDP hook and FSDP2 comms); `ncclavg.train` TowerTrainer and what only
training needs; `ncclavg.bench` the `ncclavg bench` command. The core imports none of them when it loads;
transport imports only the core; comm the core and transport; process_group those and comm; train and
bench any of them, never each other (tests/test_layering.py checks it; docs/architecture.md draws it).

`import ncclavg` also registers the `ncclavg` torch.distributed backend, lightly: Note [Registering the
torch.distributed backend] below.
"""
from importlib import import_module as _import_module

from ._version import __version__
from ._ext import cuda_available, cuda_built
from .errors import (CollectiveMismatchError, CommError, CommTimeoutError, CudaError, LayoutMismatchError, NcclError,
                     ReplicaMismatchError)
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
_LAZY_MODULES = ("optim", "comm", "train", "bench", "ddp")


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
    "ReplicaMismatchError", "Bucket", "BucketPlan", "ParamSlot", "Communicator", "Work", "GradientAverager",
]


# Note [Registering the torch.distributed backend]
# `init_process_group("ncclavg")` needs the name registered with torch.distributed first, and users write
# `import ncclavg` for that. But this package must import fast and without torch (a second and a half). So
# the registration is the one call Backend.register_backend("ncclavg", creator), made when
# torch.distributed's distributed_c10d module exists: now if torch is imported already, else right after
# it loads (a one-shot finder on sys.meta_path wraps that module's loader). The creator imports the
# backend itself (ncclavg/process_group/group.py) when torch creates the first group.
_C10D = "torch.distributed.distributed_c10d"


def _create_torch_group(dist_opts, backend_options):
    from .process_group.group import _create

    return _create(dist_opts, backend_options)


def _register_torch_backend(c10d) -> None:
    backend = getattr(c10d, "Backend", None)
    if backend is None or "NCCLAVG" in getattr(backend, "_plugins", {}):
        return
    backend.register_backend("ncclavg", _create_torch_group, extended_api=True, devices=["cpu", "cuda"])


class _RegisterAfterTorchDistributed:
    """A meta-path finder that only watches for torch.distributed's c10d module: it lets the finders after
    it find the module and registers the backend once the module has run."""

    def find_spec(self, name, path=None, target=None):
        if name != _C10D:
            return None
        import sys

        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec

        def exec_and_register(module):
            run(module)
            try:
                _register_torch_backend(module)
            except Exception as e:   # noqa: BLE001 (torch must import whatever happens here)
                import warnings

                warnings.warn(f"ncclavg: could not register the torch.distributed backend: {e}", RuntimeWarning)

        loader.exec_module = exec_and_register
        return spec


def _arrange_registration() -> None:
    import sys

    c10d = sys.modules.get(_C10D)
    if c10d is not None:
        _register_torch_backend(c10d)
    elif not any(isinstance(f, _RegisterAfterTorchDistributed) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterTorchDistributed())


_arrange_registration()
