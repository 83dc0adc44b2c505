"""The package's layering rules, checked from its source (every import statement, at any depth) and
by importing each module alone. Kept apart from test_layering.py so the negative tests can run the
same checks on a copy of the package with a rule broken on purpose.

The rules (also in ncclavg/__init__.py and each subpackage's __init__):
- the core (the modules directly in ncclavg/) imports no subpackage when it loads; inside a function
  it may (the `ncclavg` command builds the bench and train subcommands, `ncclavg.TowerTrainer` loads on
  first use, the torch backend's creator loads ncclavg.process_group when torch makes a group);
- ncclavg.transport (what both communication faces use) imports only the core;
- ncclavg.comm (ncclavg's Communicator) imports the core and ncclavg.transport;
- ncclavg.process_group (the torch.distributed face) imports those and ncclavg.comm, never the reverse;
- ncclavg.train and ncclavg.bench import any of the above, never each other;
- no import cycles: no module imports, directly or through others, a module that imports it.

An edge of the import graph is an import a module writes (`import x`, `from x import y`, relative or
absolute, wherever it stands), plus the lazy names of ncclavg/__init__.py's `_LAZY` table (imported by
`importlib` on first access, so no statement shows them). Python also runs a package's __init__ before
any module inside it; that is how packages work, not an import a module chose, so it is no edge.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

TOP = "ncclavg"
SUBPACKAGES = ("transport", "comm", "process_group", "train", "bench")
# what each subpackage may import besides the core and itself (at any depth, when it loads or later)
MAY_IMPORT = {
    "transport": set(),
    "comm": {"transport"},
    "process_group": {"transport", "comm"},
    "train": {"transport", "comm", "process_group"},
    "bench": {"transport", "comm", "process_group"},
}
COMPILED = {"ncclavg._C"}   # the compiled core: an extension module, it imports nothing of the package


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    module_level: bool   # runs when `src` is imported (not only inside a function body)
    line: int


def module_names(pkg_dir: Path) -> dict[str, Path]:
    """'ncclavg.comm.base' -> its file, for every .py file of the package."""
    out = {}
    for path in sorted(pkg_dir.rglob("*.py")):
        rel = path.relative_to(pkg_dir.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def layer(module: str) -> str:
    """'core', 'comm', 'train' or 'bench'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SUBPACKAGES else "core"


def _is_package(module: str, modules: dict[str, Path]) -> bool:
    return modules[module].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom, modules: dict[str, Path]) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module, modules):
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _walk(tree: ast.AST):
    """(node, module_level) for every import; module level = not inside a function body."""
    stack = [(tree, True)]
    while stack:
        node, top = stack.pop()
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, top
            stack.append((child, inner))


def import_edges(pkg_dir: Path) -> list[Edge]:
    modules = module_names(pkg_dir)
    edges = []
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, top in _walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _resolve(mod, node, modules)
                # `from pkg import name`: the module pkg.name when there is one, else pkg itself
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules or f"{base}.{a.name}" in COMPILED
                           else base for a in node.names]
            for t in targets:
                if t in modules:
                    edges.append(Edge(mod, t, top, node.lineno))
    edges += _lazy_edges(pkg_dir, modules)
    return edges


def _lazy_edges(pkg_dir: Path, modules: dict[str, Path]) -> list[Edge]:
    """ncclavg/__init__.py's `_LAZY` / `_LAZY_MODULES` tables: imported on first attribute access."""
    tree = ast.parse((pkg_dir / "__init__.py").read_text())
    edges = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) in ("_LAZY", "_LAZY_MODULES") for t in node.targets):
            value = ast.literal_eval(node.value)
            names = value.values() if isinstance(value, dict) else value
            for name in sorted(set(names)):
                dst = f"{TOP}.{name}"
                if dst not in modules:
                    raise AssertionError(f"ncclavg/__init__.py: lazy name {name!r} is no module of the package")
                edges.append(Edge(TOP, dst, False, node.lineno))
    return edges


def layer_violations(edges: list[Edge]) -> list[str]:
    out = []
    for e in edges:
        a, b = layer(e.src), layer(e.dst)
        if a == b or b == "core":
            continue
        if a == "core":
            if e.module_level:
                out.append(f"{e.src} (line {e.line}) imports {e.dst} when it loads: the core may import "
                           f"ncclavg.{b} only inside a function")
        elif b not in MAY_IMPORT[a]:
            allowed = ", ".join(["the core", *(f"ncclavg.{x}" for x in SUBPACKAGES if x in MAY_IMPORT[a])])
            out.append(f"{e.src} (line {e.line}) imports {e.dst}: ncclavg.{a} must not import ncclavg.{b} "
                       f"(it may import only {allowed})")
    return out


def cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), and modules importing themselves."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.src, set()).add(e.dst)
        graph.setdefault(e.dst, set())
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                found.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


# Imports each module named on the command line in a process of its own: the probe loads the
# third-party libraries once, then forks one child per module, so every child starts with no ncclavg
# module loaded (a fresh interpreter as far as the package is concerned) without paying torch's
# import time (~1.5 s) forty times over.
_PROBE = r"""
import importlib, json, os, sys
import numpy, torch  # noqa: F401  (third-party only: nothing of ncclavg is loaded before the fork)
assert not any(m == "ncclavg" or m.startswith("ncclavg.") for m in sys.modules)
results = []
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(name)
            out = {"module": name, "ok": True}
        except BaseException as e:
            out = {"module": name, "ok": False, "error": f"{type(e).__name__}: {e}"}
        out["loaded"] = sorted(m for m in sys.modules if m == "ncclavg" or m.startswith("ncclavg."))
        out["origin"] = getattr(sys.modules.get("ncclavg"), "__file__", None)
        with os.fdopen(w, "w") as f:
            f.write(json.dumps(out))
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    results.append(json.loads(data) if data else {"module": name, "ok": False, "error": "child died", "loaded": []})
print(json.dumps(results))
"""


def import_alone(pkg_parent: Path, modules: list[str], timeout: float = 300) -> list[dict]:
    """For each module: did `import module` succeed on its own, and which ncclavg modules did it load."""
    # NCCLAVG_AUTOLOAD=0: the installed ncclavg's torch.backends entry point would import it with torch,
    # before the probe's first fork (and from the installed tree, not pkg_parent's copy).
    env = dict(os.environ, PYTHONPATH=str(pkg_parent) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               NCCLAVG_AUTOLOAD="0")
    r = subprocess.run([sys.executable, "-c", _PROBE, *modules], capture_output=True, text=True, env=env,
                       cwd=str(pkg_parent), timeout=timeout)
    if r.returncode != 0:
        raise AssertionError(f"import probe failed ({r.returncode}):\n{r.stderr}")
    results = json.loads(r.stdout.strip().splitlines()[-1])
    for res in results:  # the copy under test, not an installed ncclavg found first on the path
        origin = res.get("origin")
        if origin is not None and not Path(origin).resolve().is_relative_to(pkg_parent.resolve()):
            raise AssertionError(f"import probe loaded ncclavg from {origin}, not from {pkg_parent}")
    return results


def load_violations(results: list[dict]) -> list[str]:
    """What importing one module alone loaded that its layer may not import when it loads."""
    out = []
    for res in results:
        mod = res["module"]
        if not res["ok"]:
            out.append(f"import {mod} alone failed: {res['error']}")
            continue
        a = layer(mod)
        for other in res["loaded"]:
            b = layer(other)
            if a == b or b == "core":
                continue
            if a == "core" or b not in MAY_IMPORT[a]:
                who = "the core" if a == "core" else f"ncclavg.{a}"
                out.append(f"import {mod} alone loads {other}: {who} must not import ncclavg.{b} when it loads")
    return out
