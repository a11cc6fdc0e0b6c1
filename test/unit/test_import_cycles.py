"""No runtime import cycle between radixserve's modules (issue 36).

The imports a module runs when it is loaded are read with ast: the module's top-level statements
(and those nested in top-level `if` / `try` / `with` / class bodies), but not imports inside
functions (run later, once everything is loaded) nor under `if TYPE_CHECKING:` (never run).
Importing `a.b.c` also runs the packages `a` and `a.b`, so those count as imported too, except a
module's own enclosing packages, which Python has always loaded (or is loading) before it.
The graph of these edges must have no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PYTHON_DIR = Path(__file__).resolve().parents[2] / "python"
PACKAGE = "radixserve"

# Runtime import edges (importer, imported) that other work in progress is removing; the test
# ignores these and nothing else. Empty the list as those changes land.
ALLOWED_EDGES: frozenset[tuple[str, str]] = frozenset()


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package)."""
    found = {}
    for path in (PYTHON_DIR / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(PYTHON_DIR).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _load_time_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                found += _load_time_imports(node.body)
            found += _load_time_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                found += _load_time_imports(block)
        elif isinstance(node, (ast.ClassDef, ast.With, ast.For, ast.While)):
            found += _load_time_imports(node.body)
    return found


def _imported(name: str, is_package: bool, node: ast.Import | ast.ImportFrom, modules: dict) -> set[str]:
    """The product modules that `node`, in module `name`, runs."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        # `from pkg import sub` imports the submodule; `from mod import Name` only mod.
        targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
    ran = set()
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            module = ".".join(parts[:i])
            enclosing = name == module or name.startswith(module + ".")
            if module in modules and not enclosing:
                ran.add(module)
    return ran


def runtime_import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, (path, is_package) in modules.items():
        edges: set[str] = set()
        for node in _load_time_imports(ast.parse(path.read_text(encoding="utf-8")).body):
            edges |= _imported(name, is_package, node, modules)
        graph[name] = {m for m in edges if (name, m) not in ALLOWED_EDGES}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (an iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_walker_counts_load_time_imports_only() -> None:
    source = """
import radixserve.utils.cpus
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from radixserve.scheduler.scheduler import Scheduler
try:
    from radixserve.sampling import sampling_params
except ImportError:
    pass
def later():
    from radixserve.managers import io_struct
"""
    modules = _modules()
    ran: set[str] = set()
    for node in _load_time_imports(ast.parse(source).body):
        ran |= _imported("radixserve.scheduler.some_module", False, node, modules)
    # Each imported module runs its packages too, except the importer's own (already loaded).
    assert ran == {
        "radixserve.utils",
        "radixserve.utils.cpus",
        "radixserve.sampling",
        "radixserve.sampling.sampling_params",
    }
    # On the real tree: a top-level import counts.
    assert "radixserve.scheduler.req" in runtime_import_graph()["radixserve.constrained.grammar_manager"]


def test_find_cycle_reports_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_runtime_import_cycle() -> None:
    cycle = find_cycle(runtime_import_graph())
    assert cycle is None, "runtime import cycle: " + " -> ".join(cycle or [])


def test_allowed_edges_still_exist() -> None:
    """An allowed edge that is gone must leave the list (it would hide a new cycle)."""
    modules = _modules()
    for importer, imported in ALLOWED_EDGES:
        path, is_package = modules[importer]
        nodes = _load_time_imports(ast.parse(path.read_text(encoding="utf-8")).body)
        assert any(imported in _imported(importer, is_package, n, modules) for n in nodes), (
            importer,
            imported,
        )
