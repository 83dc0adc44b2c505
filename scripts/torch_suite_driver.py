"""PyTorch's distributed test suite, driven as torch's test/distributed/test_distributed_spawn.py does.

The torch wheel ships torch/testing/_internal/distributed/distributed_test.py but not
test_distributed_spawn.py, so this file is its equivalent: one TestDistBackendWithSpawn class over
DistributedTest._DistTestBase with MultiProcessTestCase's spawn setup. scripts/torch_suite.py runs it
(one process per batch of tests) and reads the JSON lines it writes; run by hand it needs the same
environment: BACKEND, WORLD_SIZE, TEMP_DIR.

See Note [Module level runs in every rank]: every rank of every test re-imports this file.
"""
# Note [Module level runs in every rank]
# MultiProcessTestCase starts its ranks with the spawn start method, which re-executes this file (as
# __mp_main__) in each child before unpickling the test. So everything that must hold in a rank is
# done here at module level, not under __main__: importing the plugin backend's package (which
# registers it with torch.distributed), the per-test timeout, and building the suite module with
# its gates lifted. The children inherit os.environ, so they make the same choices as the parent.
import importlib
import importlib.util
import json
import os
import sys
import time
import traceback
import unittest

BACKEND = os.environ["BACKEND"]
# "" (the suite as torch ships it), "gates", or "gates,profiling" (see scripts/torch_suite_lift.py).
LIFT = {part for part in os.environ.get("TORCH_SUITE_LIFT", "").split(",") if part}
BUILTIN_BACKENDS = {"gloo", "nccl", "mpi", "ucc", "xccl"}

# Read by common_distributed when it is imported: the parent's join of the ranks of one test gives
# up after this many seconds, kills them and fails the test. The suite's longer overrides (400 s,
# 500 s for two DDP tests) are dropped below so that one number bounds every test.
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", os.environ.get("TORCH_SUITE_TIMEOUT", "300"))

if BACKEND not in BUILTIN_BACKENDS:
    # A plugin backend is registered by importing its package (for ncclavg: `import ncclavg`).
    importlib.import_module(os.environ.get("TORCH_SUITE_PLUGIN", BACKEND))

import torch  # noqa: E402
from torch.testing._internal import common_distributed, common_utils  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_suite_lift as lift  # noqa: E402

common_distributed.TIMEOUT_OVERRIDE.clear()
LIFT_REPORT = lift.LiftReport()


def _load_suite():
    """The suite module: as installed, or a lifted copy registered under the installed name (so that
    anything importing it sees the same classes)."""
    if "gates" not in LIFT:
        return importlib.import_module(lift.SUITE_MODULE)
    lift.lift_feature_sets(common_distributed.DistTestCases, BACKEND, LIFT_REPORT)
    spec = importlib.util.find_spec(lift.SUITE_MODULE)
    with open(spec.origin, encoding="utf-8") as f:
        src = lift.lift_source(f.read(), BACKEND, LIFT_REPORT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[lift.SUITE_MODULE] = module
    # Compiled under the installed file's name: the rewrites keep every line where it was, so
    # tracebacks point at the right lines of the real file.
    exec(compile(src, spec.origin, "exec"), module.__dict__)
    if "profiling" in LIFT:
        lift.lift_profiling(module, BACKEND, LIFT_REPORT)
    return module


suite = _load_suite()
torch.backends.cuda.matmul.allow_tf32 = False


class TestDistBackendWithSpawn(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
    # As in torch's test_distributed_spawn.py.
    def setUp(self):
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


def test_names() -> list[str]:
    return sorted(unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn))


class JsonLinesResult(unittest.TextTestResult):
    """unittest's text result, plus one JSON line per test start and outcome in `events`, flushed at
    once: the runner reads the file while this process runs, and kills it if a test hangs."""

    def __init__(self, events, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events = events
        self.started = 0.0

    def _emit(self, **record):
        self.events.write(json.dumps(record) + "\n")
        self.events.flush()

    def startTest(self, test):
        super().startTest(test)
        self.started = time.monotonic()
        self._emit(event="start", test=test._testMethodName)

    def _outcome(self, test, outcome, detail=""):
        self._emit(event="end", test=test._testMethodName, outcome=outcome,
                   seconds=round(time.monotonic() - self.started, 2), detail=detail)

    def addSuccess(self, test):
        super().addSuccess(test)
        self._outcome(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._outcome(test, "failed", "".join(traceback.format_exception(*err)))

    def addError(self, test, err):
        super().addError(test, err)
        self._outcome(test, "failed", "".join(traceback.format_exception(*err)))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._outcome(test, "skipped", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._outcome(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._outcome(test, "failed", "unexpected success")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--list"]:
        print(json.dumps({"tests": test_names(), "lift": LIFT_REPORT.as_dict(), "torch": torch.__version__}))
        return 0
    if len(argv) < 2 or argv[0] != "--events":
        print("usage: torch_suite_driver.py --list | --events FILE TEST_NAME...", file=sys.stderr)
        return 2
    events_path, names = argv[1], argv[2:]
    # The suite's TestCase reads globals that torch's run_tests() sets; parse no arguments of ours.
    sys.argv = sys.argv[:1]
    common_utils.parse_cmd_line_args()
    loader = unittest.TestLoader()
    tests = unittest.TestSuite(loader.loadTestsFromName(f"TestDistBackendWithSpawn.{n}", sys.modules[__name__])
                               for n in names)
    with open(events_path, "a", encoding="utf-8") as events:
        runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=2,
                                         resultclass=lambda *a, **k: JsonLinesResult(events, *a, **k))
        runner.run(tests)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
