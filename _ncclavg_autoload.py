"""The `torch.backends` entry point of the ncclavg distribution: torch calls `register()` at the end of
every `import torch` (torch/__init__.py, `_import_device_backends`), so `init_process_group("ncclavg")`
works in programs that never import ncclavg: a plain torchrun script, Ray Train's workers, any launcher
that starts its own processes.

`NCCLAVG_AUTOLOAD=0` turns it off for ncclavg alone, torch's `TORCH_DEVICE_BACKEND_AUTOLOAD=0` for every
such plugin (torch then never calls this). `import ncclavg` registers the backend too, as before.

Note [Autoload outside the package]
torch turns any exception raised while loading or calling an entry point into a failed `import torch`
("Failed to load the backend extension"). Loading an entry point imports its module's parent package
first, and `ncclavg/__init__.py` raises on a broken install (its compiled core missing or unloadable),
as it should for `import ncclavg`. A module inside the package could therefore not keep that promise, so
this one is a top-level module of the distribution (as setuptools' `_distutils_hack`): it imports nothing
of ncclavg until `register()` runs, and catches what that import raises. The import is the whole of the
work: ncclavg/__init__.py registers the backend itself (Note [Registering the torch.distributed backend]
there), and it stays light (numpy and the compiled core; the backend's own module is imported when the
first group is created). Doing the import here rather than registering the bare name means a broken
install is reported at `import torch`, by a warning, instead of by `init_process_group` later.
"""
import logging
import os

OFF_VALUES = ("0", "false", "no", "off")


def enabled() -> bool:
    """False when NCCLAVG_AUTOLOAD says off (0, false, no, off; any case)."""
    return os.environ.get("NCCLAVG_AUTOLOAD", "1").strip().lower() not in OFF_VALUES


def register() -> None:
    """Registers the `ncclavg` torch.distributed backend; never raises (Note [Autoload outside the package])."""
    if not enabled():
        return
    try:
        import ncclavg  # noqa: F401  (registers the backend as it loads)
    except Exception as e:  # noqa: BLE001  (torch must import whatever is wrong with ncclavg)
        logging.getLogger("ncclavg").warning(
            "ncclavg: the 'ncclavg' torch.distributed backend was not registered, import torch goes on "
            "without it: %s: %s. Reinstall ncclavg (pip install --force-reinstall ncclavg), or set "
            "NCCLAVG_AUTOLOAD=0 to skip this.", type(e).__name__, e)
