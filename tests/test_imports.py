"""The package's import graph: one-way, with no cycle, not even one hidden by a local import.

Imports under ``if TYPE_CHECKING:`` are left out: they name types for annotations and never
run, so they cannot make a cycle at run time.  Every other import counts, at module level or
inside a function.
"""

from __future__ import annotations

import ast
import os

import stepprof

PACKAGE_DIR = os.path.dirname(stepprof.__file__)


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(PACKAGE_DIR))[: -len(".py")]
    parts = rel.split(os.sep)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, str]:
    found = {}
    for root, _, files in os.walk(PACKAGE_DIR):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                found[_module_name(path)] = path
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_graph() -> dict[str, set[str]]:
    """Every import between stepprof's modules that can run: module level or in a function."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.endswith("__init__.py")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        skip = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node)
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                # `from . import _x` names a module; `from ._x import y` names a module's attribute.
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != module and t != "stepprof":
                    graph[module].add(t)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_graph_is_read() -> None:
    graph = import_graph()
    assert "stepprof._log" in graph
    assert any(graph.values()), "no import between stepprof's modules was found"


def test_no_import_cycle() -> None:
    cycle = _cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_a_local_import_counts_and_a_type_checking_one_does_not() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\ndef f():\n    import b\n"
    )
    skipped = _type_checking_only(tree)
    names = [n.names[0].name for n in ast.walk(tree) if isinstance(n, ast.Import) and id(n) not in skipped]
    assert names == ["b"]


def test_a_planted_cycle_is_found() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
