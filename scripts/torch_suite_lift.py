"""Lift the gloo-only gates of PyTorch's distributed test suite for another backend.

torch/testing/_internal/distributed/distributed_test.py skips, for any backend but gloo, what it gates
on ``BACKEND == "gloo"`` (timeouts, sparse all_reduce, monitored_barrier, ...), on
``require_backend_is_available({"gloo"})`` and on ``DistTestCases.backend_feature`` (DDP, subgroups).
A CPU backend that means to stand in for gloo should be held to those tests too. This module builds a
copy of the suite with those gates extended to one more backend name, in memory: the installed torch
is never edited. Every rewrite stays on its own line, so tracebacks keep the installed file's line
numbers.

Pure functions of the source text (``lift_source``), plus the two run-time patches that cannot be done
in text (``lift_feature_sets``, ``lift_profiling``). No torch import at module level, so the quick
tests of the rules need no suite.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

SUITE_MODULE = "torch.testing._internal.distributed.distributed_test"

# `BACKEND == "gloo"` / `BACKEND != "gloo"` (either quote style, any spacing). The suite only ever
# compares the BACKEND global with a literal; anything else (dist.get_backend() == "gloo" on a
# group made with backend="gloo") is about gloo itself and is left alone.
_EQ = re.compile(r"""\bBACKEND\s*==\s*(["'])gloo\1""")
_NE = re.compile(r"""\bBACKEND\s*!=\s*(["'])gloo\1""")
# `require_backend_is_available({"gloo"})`: the only literal backend set the suite requires of gloo.
_REQUIRE = re.compile(r"""require_backend_is_available\(\s*\{\s*(["'])gloo\1\s*\}\s*\)""")


@dataclass
class LiftReport:
    """How many gates each rule lifted (stated in the results, so a torch upgrade that renames a gate
    shows up as a zero rather than as silently fewer tests)."""
    eq: int = 0
    ne: int = 0
    require: int = 0
    feature_sets: list[str] = field(default_factory=list)
    profiling_lists: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"BACKEND == gloo": self.eq, "BACKEND != gloo": self.ne,
                "require_backend_is_available({gloo})": self.require,
                "backend_feature sets": self.feature_sets, "profiling allowlists": self.profiling_lists}


def lift_source(src: str, backend: str, report: LiftReport | None = None) -> str:
    """The suite's source with its gloo comparisons and gloo requirement sets also true for `backend`."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", backend):
        raise ValueError(f"backend name {backend!r} is not a plain identifier")
    both = f'("gloo", "{backend}")'
    src, n_eq = _EQ.subn(f"BACKEND in {both}", src)
    src, n_ne = _NE.subn(f"BACKEND not in {both}", src)
    src, n_req = _REQUIRE.subn(f'require_backend_is_available({{"gloo", "{backend}"}})', src)
    if report is not None:
        report.eq, report.ne, report.require = n_eq, n_ne, n_req
    return src


def lift_feature_sets(dist_test_cases, backend: str, report: LiftReport | None = None) -> None:
    """Give `backend` every DistTestCases.backend_feature that gloo has (ddp, subgroup, gpu, cuda), and
    mark it a plugin so require_backend_is_available's availability check accepts it.

    Must run before the suite module is executed: its decorators read the sets at class definition.
    """
    for name, members in dist_test_cases.backend_feature.items():
        if "gloo" in members and backend not in members:
            members.add(backend)
            if report is not None:
                report.feature_sets.append(name)
    dist_test_cases.backend_feature.setdefault("plugin", set()).add(backend)
    if report is not None:
        report.feature_sets.append("plugin")


def lift_profiling(suite_module, backend: str, report: LiftReport | None = None) -> None:
    """Add `backend` to the suite's profiling allowlists that hold gloo. Opt-in and separate from the
    gates: with it the suite asserts profiler events named "<backend>:<collective>", a feature of
    its own rather than a gloo-only skip."""
    for name in dir(suite_module):
        value = getattr(suite_module, name)
        if name.endswith("PROFILING_SUPPORTED_BACKENDS") and isinstance(value, list) and "gloo" in value:
            value.append(backend)
            if report is not None:
                report.profiling_lists.append(name)
