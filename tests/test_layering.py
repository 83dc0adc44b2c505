"""The package layout: the core at the top of ncclavg/, ncclavg.comm, ncclavg.train and ncclavg.bench
below it, and the import rules between them (see _layering.py for the rules and how they are read).
The negative tests break each rule once in a copy of the package and check that the same checks fail."""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

import _layering as L
import ncclavg
from ncclavg import _C

PKG = Path(ncclavg.__file__).resolve().parent
MAX_TOP_LEVEL_MODULES = 14


def test_top_level_holds_the_core_only():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    for sub in L.SUBPACKAGES:
        assert (PKG / sub / "__init__.py").is_file(), sub


@pytest.mark.parametrize("sub", L.SUBPACKAGES)
def test_each_subpackage_says_what_it_holds_may_import_and_where_to_start(sub):
    doc = ast.get_docstring(ast.parse((PKG / sub / "__init__.py").read_text())) or ""
    for needle in ("What lives here", "What it may import", "Where to start reading"):
        assert needle in doc, f"ncclavg/{sub}/__init__.py's docstring lacks {needle!r}"


def test_the_checker_sees_the_whole_package():
    # A checker that parsed nothing would pass everything: make sure it saw every layer and the edges
    # between them that the design promises (the command builds both subcommands; train uses comm).
    edges = L.import_edges(PKG)
    mods = L.module_names(PKG)
    assert {L.layer(m) for m in mods} == {"core", *L.SUBPACKAGES}
    pairs = {(e.src, e.dst) for e in edges}
    assert ("ncclavg.cli", "ncclavg.bench.cli") in pairs and ("ncclavg.cli", "ncclavg.train.cli") in pairs
    assert ("ncclavg.train.engines", "ncclavg.comm") in pairs
    # the two faces over the one transport: both get their channel from host_setup, run their jobs on a
    # runner and take their steps from the same ordered implementations
    for face in ("ncclavg.comm.gloo", "ncclavg.process_group.connect"):
        assert (face, "ncclavg.transport.host_setup") in pairs and (face, "ncclavg.transport.runner") in pairs
    assert ("ncclavg.comm.gloo", "ncclavg.transport.paths") in pairs
    assert ("ncclavg.process_group.cpu_collectives", "ncclavg.transport.paths") in pairs
    assert ("ncclavg", "ncclavg.process_group.group") in pairs   # the creator torch calls, on use
    assert ("ncclavg", "ncclavg.train.trainer") in pairs  # the lazy table of ncclavg/__init__.py
    assert all(not e.module_level for e in edges if e.src == "ncclavg.cli" and L.layer(e.dst) != "core")


def test_no_import_cycles():
    assert L.cycles(L.import_edges(PKG)) == []


def test_every_import_follows_the_layering():
    assert L.layer_violations(L.import_edges(PKG)) == []


def test_every_module_imports_alone_and_loads_only_what_its_layer_may():
    modules = sorted(L.module_names(PKG))
    results = L.import_alone(PKG.parent, modules)
    assert [r["module"] for r in results] == modules
    assert L.load_violations(results) == []
    # importing the core alone loads no subpackage at all (the lazy names stay unloaded)
    core = {r["module"]: r["loaded"] for r in results}["ncclavg"]
    assert all(L.layer(m) == "core" for m in core), core


# ---------------------------------------------------------------- negative tests: break a rule, see it caught
@pytest.fixture
def pkg_copy(tmp_path):
    """A copy of the package (sources and the compiled core) to break on purpose."""
    dst = tmp_path / "ncclavg"
    shutil.copytree(PKG, dst, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
    shutil.copy2(_C.__file__, dst / Path(_C.__file__).name)
    return dst


def _insert(path: Path, after: str, line: str) -> None:
    text = path.read_text()
    assert after in text, (path, after)
    path.write_text(text.replace(after, after + line, 1))


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def test_negative_comm_importing_train_is_caught(pkg_copy):
    _insert(pkg_copy / "comm" / "local.py", "from __future__ import annotations\n",
            "from ..train import data as _not_allowed  # noqa\n")
    found = L.layer_violations(L.import_edges(pkg_copy))
    assert len(found) == 1 and "ncclavg.comm.local" in found[0] and "must not import ncclavg.train" in found[0], found
    loaded = L.load_violations(L.import_alone(pkg_copy.parent, ["ncclavg.comm.local"]))
    assert any("loads ncclavg.train.data" in v for v in loaded), loaded


def test_negative_comm_importing_the_torch_adapter_is_caught_even_inside_a_function(pkg_copy):
    # the Communicator is the lower face: a lazy import of the torch backend from it is caught too
    _append(pkg_copy / "comm" / "gloo.py",
            "\n\ndef _not_allowed():\n    from ..process_group import face  # noqa\n    return face\n")
    found = L.layer_violations(L.import_edges(pkg_copy))
    assert len(found) == 1 and "ncclavg.comm.gloo" in found[0] and "must not import ncclavg.process_group" in found[0], found


def test_negative_transport_importing_comm_when_it_loads_is_caught(pkg_copy):
    _insert(pkg_copy / "transport" / "shm.py", "from __future__ import annotations\n",
            "from ..comm import dist as _not_allowed  # noqa\n")
    found = L.layer_violations(L.import_edges(pkg_copy))
    assert len(found) == 1 and "ncclavg.transport.shm" in found[0] and "must not import ncclavg.comm" in found[0], found
    # comm's __init__ loads gloo.py, which imports shm.py: importing shm.py alone now fails half-way
    loaded = L.load_violations(L.import_alone(pkg_copy.parent, ["ncclavg.transport.shm"]))
    assert len(loaded) == 1 and "import ncclavg.transport.shm alone failed" in loaded[0], loaded


def test_negative_core_importing_a_subpackage_when_it_loads_is_caught(pkg_copy):
    _insert(pkg_copy / "bucketing.py", "from __future__ import annotations\n",
            "from .comm import base as _not_allowed  # noqa\n")
    found = L.layer_violations(L.import_edges(pkg_copy))
    assert len(found) == 1 and found[0].startswith("ncclavg.bucketing") and "only inside a function" in found[0]
    loaded = L.load_violations(L.import_alone(pkg_copy.parent, ["ncclavg.bucketing"]))
    assert any("the core must not import ncclavg.comm" in v for v in loaded), loaded


def test_negative_train_and_bench_importing_each_other_is_caught_even_inside_a_function(pkg_copy):
    _append(pkg_copy / "train" / "towers.py",
            "\n\ndef _not_allowed():\n    from ..bench import inputs  # noqa\n    return inputs\n")
    found = L.layer_violations(L.import_edges(pkg_copy))
    assert len(found) == 1 and "ncclavg.train must not import ncclavg.bench" in found[0], found


def test_negative_a_cycle_through_function_level_imports_is_caught(pkg_copy):
    # errors.py <- cli.py already; an import back from errors.py (even a lazy one) closes a cycle
    _append(pkg_copy / "errors.py", "\n\ndef _not_allowed():\n    from . import cli  # noqa\n    return cli\n")
    cyc = L.cycles(L.import_edges(pkg_copy))
    assert len(cyc) == 1 and {"ncclavg.cli", "ncclavg.errors"} <= set(cyc[0]), cyc


def test_negative_a_module_level_cycle_breaks_importing_one_module_alone(pkg_copy):
    # averager.py imports bucketing.py when it loads; the reverse import makes `import ncclavg.bucketing`
    # fail with a partially initialised module: found statically, and by importing the module alone.
    _insert(pkg_copy / "bucketing.py", "from __future__ import annotations\n",
            "from .averager import GradientAverager as _not_allowed  # noqa\n")
    cyc = L.cycles(L.import_edges(pkg_copy))
    assert any({"ncclavg.averager", "ncclavg.bucketing"} <= set(c) for c in cyc), cyc
    loaded = L.load_violations(L.import_alone(pkg_copy.parent, ["ncclavg.bucketing"]))
    assert len(loaded) == 1 and "import ncclavg.bucketing alone failed" in loaded[0], loaded


# ---------------------------------------------------------------- the addresses users were told about
def test_old_addresses_users_were_told_about_still_work():
    # docs once sent users to ncclavg.comm.backend_lane.BackendError and ncclavg.comm.flight.dump: both
    # still resolve, to the very same objects (an alias, not a copy that a monkeypatch or isinstance misses)
    import pickle

    import torch.distributed as dist

    import ncclavg.comm.backend_lane as old_lane
    import ncclavg.comm.flight as old_flight
    from ncclavg import errors
    from ncclavg.process_group import face
    from ncclavg.transport import flight

    assert old_flight is flight and old_flight.dump is flight.dump
    for name in ("BackendError", "BackendTimeoutError", "BackendMismatchError"):
        cls = getattr(errors, name)
        assert getattr(old_lane, name) is cls and getattr(face, name) is cls, name
        assert cls.__module__ == "ncclavg.errors" and cls.__qualname__ == name
        assert issubclass(cls, dist.DistBackendError) and issubclass(cls, errors.CommError)
        again = pickle.loads(pickle.dumps(cls("rank 1 stopped responding")))   # Ray and multiprocessing do this
        assert type(again) is cls and str(again) == "rank 1 stopped responding"
    assert errors.BackendTimeoutError.is_timeout and not errors.BackendMismatchError.is_timeout
    with pytest.raises(AttributeError, match="BackendErr"):
        old_lane.BackendErr   # noqa: B018  (a typo is an AttributeError, not a silent None)


def test_the_errors_module_loads_no_torch_until_a_backend_error_is_asked_for():
    # `import ncclavg` must stay torch-free (the torch.backends entry point, `ncclavg info`): the three
    # Backend* classes derive from torch's DistBackendError, so they are made on first use, once
    import os
    import subprocess
    import sys
    code = ("import sys, ncclavg.errors as e; assert 'torch' not in sys.modules, 'loaded torch';"
            "a = e.BackendError; assert 'torch' in sys.modules; assert e.BackendError is a; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "NCCLAVG_AUTOLOAD": "0"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
