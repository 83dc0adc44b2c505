"""Where things are, for tests in any folder under tests/ (conftest.py puts tests/ on sys.path)."""
from pathlib import Path

TESTS = Path(__file__).resolve().parent   # the shared helpers (_gpu.py, _dist_util.py, workers) live here
ROOT = TESTS.parent                        # the checkout: examples/, bench/, scripts/


def load_script(path: Path, name: str):
    """A script that is not part of a package (bench/*.py, the emulator's builder) loaded as module
    `name`, so that tests can call its functions in this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
