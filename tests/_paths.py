"""Where things are, for tests in any folder under tests/ (conftest.py puts tests/ on sys.path)."""
from pathlib import Path

TESTS = Path(__file__).resolve().parent   # the shared helpers (_gpu.py, _dist_util.py, workers) live here
ROOT = TESTS.parent                        # the checkout: examples/, bench/, scripts/
