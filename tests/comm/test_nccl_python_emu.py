"""The NCCL backend's Python layer (ncclavg/comm/nccl.py) over the emulated core: the real bindings and
NcclComm compiled against the emulated CUDA runtime, NCCL the stand-in (Note [The emulated core] in
csrc/cuda/emu/build_pycore.py). Each scenario of tests/_nccl_python_emu_workers.py runs in fresh
processes (one per rank), torch.cuda answering for the emulated machine (tests/_nccl_emu_core.py). No
GPU: what this cannot show is in docs/cuda_emulation.md."""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from _paths import ROOT, TESTS, load_script

build_pycore = load_script(ROOT / "csrc" / "cuda" / "emu" / "build_pycore.py", "ncclavg_build_pycore")

pytestmark = pytest.mark.skipif(build_pycore.skip_reason() is not None, reason=build_pycore.skip_reason() or "")

SLOW = {"NCCLEMU_SLOW_COLLECTIVE_S": "0.5"}
# scenario -> (processes, the stand-in's faults)
CASES = {
    "public_api": (1, {}),
    "public_api-nonblocking": (1, {"NCCLAVG_NCCL_COLLECTIVES": "nonblocking"}),
    "ordering": (1, SLOW),
    "work_keeps_its_tensors": (1, SLOW),
    "timeout_fails_the_communicator": (2, {}),
    "abort_ends_a_wait": (2, {}),
    "sticky_cuda_error_fails_the_communicator": (1, SLOW),
    "towers_of_several_processes": (2, {}),
    "peer_never_builds_the_communicator": (2, {}),
}
NCCL_PY = "ncclavg/comm/nccl.py"
# (case, [(old, new)] in nccl.py): each must make its case fail
PLANTED = {
    "work_forgets_its_tensors": ("work_keeps_its_tensors",
                                 [("tuple(tensors) if self._seq else None", "None")]),
    "no_stream_order_after_a_collective": ("ordering",
                                           [("self._call(self._handle.stream_wait, streams, seq)", "pass")]),
    "wait_ignores_its_timeout": ("timeout_fails_the_communicator",
                                 [("t = check_timeout(timeout) if timeout is not None else self._timeout",
                                   "t = self._timeout")]),
    "towers_numbered_from_the_last_process": ("towers_of_several_processes",
                                              [("return sum(counts), sum(counts[:rank])",
                                                "return sum(counts), sum(counts[rank + 1:])")]),
}


@pytest.fixture(scope="module")
def core(request, tmp_path_factory):
    c = getattr(request.config, "cache", None)
    cache = c.mkdir("nccl_python_emu") if c is not None else tmp_path_factory.mktemp("nccl_python_emu")
    return build_pycore.build(ROOT, cache, jobs=2)


def _run(core, tmp_path, case, plant=(), limit_s=90):
    scenario = case.split("-")[0]
    procs_n, faults = CASES[case]
    core_path, standin = core
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCLEMU_", "NCCLAVG_", "NCCL_"))}
    env.update({"NCCLAVG_EMU_CORE": str(core_path), "NCCLAVG_NCCL_LIBRARY": str(standin),
                "NCCLEMU_DIR": str(tmp_path / "rendezvous"), "NCCLAVG_AUTOLOAD": "0", "OMP_NUM_THREADS": "1",
                "NCCLAVG_EMU_PLANT": json.dumps(list(plant)), **faults})
    (tmp_path / "rendezvous").mkdir()
    init = tmp_path / "init"
    procs = [subprocess.Popen([sys.executable, str(TESTS / "_nccl_python_emu_workers.py"), scenario, str(r),
                               str(procs_n), str(init)], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(procs_n)]
    end = time.monotonic() + limit_s
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(end - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            out += f"\n(killed after {limit_s} s: a hang)"
        outs.append((p.returncode, out))
    return outs


def _report(outs):
    return "\n".join(f"--- rank {r}: rc={rc}\n{out[-5000:]}" for r, (rc, out) in enumerate(outs))


# With the slow tests: the emulated core's build alone takes ~25 s on 2 cores (the quick suite runs the
# same host logic in C++: tests/test_nccl_host_emu.py).
@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_python_layer_on_the_emulated_core(core, tmp_path, case):
    outs = _run(core, tmp_path, case)
    assert all(rc == 0 and "PASS" in out for rc, out in outs), _report(outs)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_planted_defect_fails_its_scenario(core, tmp_path, name):
    case, plant = PLANTED[name]
    outs = _run(core, tmp_path, case, plant)
    assert any(rc != 0 for rc, _ in outs), f"planted defect {name} went unnoticed:\n{_report(outs)}"
    # failed by an assertion or error of the scenario, not by the planting itself
    assert not any("does not occur" in out for _, out in outs), _report(outs)


def test_every_scenario_is_run():
    text = (TESTS / "_nccl_python_emu_workers.py").read_text()
    defined = set(re.findall(r"@scenario\ndef (\w+)\(", text))
    assert defined == {c.split("-")[0] for c in CASES}, defined ^ {c.split("-")[0] for c in CASES}
