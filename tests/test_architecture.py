"""The package's shape (DESIGN.md principle 12, docs/architecture.md): imports point down the layers (import-linter's
contract in pyproject.toml, lazy imports inside functions included), no module imports itself through a circle,
and modules stay small enough to read.

These read source files only (no nxd_lc import), so they are fast and run in both CI lanes."""

from __future__ import annotations

import os
import subprocess
import sys

import grimp
import pytest

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Modules allowed over MAX_LINES, each with the reason it is one unit (the issue-25 rule: "no module over ~600
#: lines without a stated reason").
LONG_MODULES: dict[str, str] = {}
MAX_LINES = 600


def _lint_imports() -> subprocess.CompletedProcess:
    exe = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    return subprocess.run([exe, "--config", os.path.join(REPO, "pyproject.toml")], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)


def test_layers_contract_is_kept() -> None:
    """import-linter's layers contract (pyproject.toml): no package imports one above it, siblings of a layer do
    not import each other, every package has a layer (``exhaustive``)."""
    result = _lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_layers_contract_catches_a_lazy_upward_import(tmp_path: os.PathLike) -> None:
    """The contract can fail: a copy of the package with one lazy import from the config core up into the
    application layer breaks it (so the green test above means something)."""
    import shutil

    copy = os.path.join(str(tmp_path), "repo")
    shutil.copytree(os.path.join(REPO, "nxd_lc"), os.path.join(copy, "nxd_lc"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(REPO, "pyproject.toml"), copy)
    with open(os.path.join(copy, "nxd_lc", "config", "access.py"), "a") as f:
        f.write("\n\ndef _upward() -> None:\n    from nxd_lc.app.run import run  # noqa: F401\n")
    exe = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    env = {**os.environ, "PYTHONPATH": copy}
    result = subprocess.run([exe, "--config", os.path.join(copy, "pyproject.toml"), "--no-cache"], cwd=copy,
                            capture_output=True, text=True, timeout=300, env=env, check=False)
    assert result.returncode != 0
    assert "nxd_lc.config.access -> nxd_lc.app.run" in result.stdout


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), i.e. import circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return out


def test_no_import_cycles_between_modules() -> None:
    """No circle in the module-level import graph of nxd_lc (lazy imports included), inside packages too."""
    sys.path.insert(0, REPO)
    try:
        graph = grimp.build_graph("nxd_lc", cache_dir=None)
    finally:
        sys.path.remove(REPO)
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_circle() -> None:
    """The finder above on a hand-made graph with one circle (a -> b -> c -> a) and a tail (c -> d)."""
    graph = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")):
        graph.add_import(importer=a, imported=b)
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_modules_stay_readable() -> None:
    """Every module of nxd_lc has at most MAX_LINES lines, except the listed ones (each with its reason)."""
    long = {}
    for root, _, files in os.walk(os.path.join(REPO, "nxd_lc")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path) as f:
                    lines = sum(1 for _ in f)
                rel = os.path.relpath(path, REPO)
                if lines > MAX_LINES and rel not in LONG_MODULES:
                    long[rel] = lines
    assert long == {}, f"split these modules (or state why they are one unit in LONG_MODULES): {long}"
    assert all(os.path.isfile(os.path.join(REPO, p)) for p in LONG_MODULES), "LONG_MODULES names a missing file"
