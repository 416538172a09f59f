"""The import contract: stepprof's layers, and no import from a layer above.

From the bottom: the base (errors, units, rules, the field declarations), records and analysis
(pure: no torch), the device boundary, capture (the profiler, the sweep, the integrations),
and the report, the views and the CLI on top.  A module imports only from its own layer or
from those below it, lazily or not.  docs/architecture.md draws the same table.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent / "stepprof"

BASE, ANALYSIS, DEVICE, CAPTURE, VIEWS = range(5)
NAMES = ("base", "records and analysis", "device", "capture", "report, views and CLI")

#: Each module's layer, by its dotted name under ``stepprof`` (a package's entry covers the
#: modules inside it that have none of their own).
LAYERS = {
    "_errors": BASE, "_units": BASE, "_stats": BASE, "_fields": BASE, "_rules": BASE, "_paths": BASE,
    "_signals": BASE, "_native": BASE, "_datasheet": BASE,
    "_schema": ANALYSIS, "_records": ANALYSIS, "_sanitise": ANALYSIS, "_log": ANALYSIS,
    "_aggregate": ANALYSIS, "_accumulators": ANALYSIS, "_peak": ANALYSIS, "_peak_record": ANALYSIS, "_validate": ANALYSIS,
    "_sweep": ANALYSIS, "_sweep.result": ANALYSIS, "_sweep.rules": ANALYSIS, "_sweep.verdict": ANALYSIS,
    "_sweep.output": ANALYSIS,
    "_device": DEVICE, "_registry": DEVICE, "_syncs": DEVICE, "_dist": DEVICE, "_batch": DEVICE,
    "_roofline": DEVICE,
    "_recorder": CAPTURE, "_scopes": CAPTURE, "_api": CAPTURE, "_options": CAPTURE, "_memory": CAPTURE,
    "_sweep.search": CAPTURE, "_sweep.trial": CAPTURE, "_sweep.restore": CAPTURE, "integrations": CAPTURE,
    "_report": VIEWS, "_plot": VIEWS, "_peak_plot": VIEWS, "_sweep.plot": VIEWS, "_export": VIEWS,
    "_frame": VIEWS, "_env": VIEWS, "_demo": VIEWS, "_cli": VIEWS, "_schema_doc": VIEWS, "__main__": VIEWS,
    "": VIEWS,
}

#: The upward imports allowed, each a lazy import with its reason (module, what it imports).
ALLOWED = {
    ("_sweep.result", "_sweep.plot"): "SweepResult.plot(path), the result's shortcut to its "
    "own chart, loads the view when it is called",
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def layer_of(module: str) -> int | None:
    """The layer of ``module`` (dotted, under stepprof; "" is the package itself)."""
    name = module
    while name not in LAYERS:
        if not name:
            return None
        name = name.rpartition(".")[0]
    return LAYERS[name]


def _imports(module: str, path: pathlib.Path) -> set[str]:
    """The stepprof modules ``module`` imports, anywhere in it (a lazy import counts)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module and (node.module == "stepprof" or node.module.startswith("stepprof.")):
                target = node.module.removeprefix("stepprof").lstrip(".")
            else:
                continue
            for alias in node.names:  # `from . import _export` names a module
                sub = f"{target}.{alias.name}".lstrip(".")
                found.add(sub if layer_of(sub) is not None and sub in _modules() else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "stepprof" or alias.name.startswith("stepprof."):
                    found.add(alias.name.removeprefix("stepprof").lstrip("."))
    return found


def test_every_module_has_a_layer():
    assert [m for m in _modules() if layer_of(m) is None] == []


def test_no_module_imports_from_a_layer_above_its_own():
    upward = []
    for module, path in sorted(_modules().items()):
        own = layer_of(module)
        for target in sorted(_imports(module, path)):
            theirs = layer_of(target)
            if theirs is not None and theirs > own and (module, target) not in ALLOWED:  # type: ignore[operator]
                upward.append(f"stepprof.{module} ({NAMES[own]}) imports stepprof.{target} ({NAMES[theirs]})")
    assert upward == []


def test_an_allowed_upward_import_is_lazy():
    """Each allowed one is inside a function, never at a module's top level."""
    modules = _modules()
    for module, target in ALLOWED:
        tree = ast.parse(modules[module].read_text())
        top = {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
        assert not any(target.endswith(m or "") and m for m in top), (module, target)


def test_the_base_and_the_analysis_import_no_torch():
    """Importing them leaves torch out (``stepprof report`` reads logs on machines without it).

    The package's own ``__init__`` (the public API, which imports torch) is left out: a bare
    package stands in for it, so that each module's own imports are what is checked.
    """
    pure = sorted(m for m in _modules() if layer_of(m) in (BASE, ANALYSIS) and m)
    code = (
        "import importlib, sys, types\n"
        "pkg = types.ModuleType('stepprof')\n"
        f"pkg.__path__ = [{str(ROOT)!r}]\n"
        "sys.modules['stepprof'] = pkg\n"
        f"for m in {pure!r}:\n"
        "    importlib.import_module('stepprof.' + m)\n"
        "    assert 'torch' not in sys.modules, m\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT.parent)


def test_the_integrations_use_only_the_profilers_public_methods():
    """A framework callback reaches a Profiler through its public methods (issue 26, item 8):
    no attribute of a Profiler that starts with an underscore appears in stepprof/integrations."""
    import stepprof
    from stepprof._recorder.profiler import Profiler

    private = {n for c in Profiler.__mro__ for n in vars(c) if n.startswith("_") and not n.startswith("__")}
    private |= {"_boundaries", "_collector", "_summary", "_energy", "_begun"}

    def a_profiler(node: ast.expr) -> bool:  # how the integrations name a Profiler
        return (isinstance(node, ast.Name) and node.id in ("prof", "profiler")) or (
            isinstance(node, ast.Attribute) and node.attr in ("_prof", "_profiler", "prof"))

    root = pathlib.Path(stepprof.__file__).parent / "integrations"
    uses = [
        (path.name, node)
        for path in sorted(root.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and a_profiler(node.value)
    ]
    assert len(uses) > 10  # the check sees the integrations' calls
    found = [f"{name}:{node.lineno}: .{node.attr}" for name, node in uses if node.attr in private]
    assert not found, found
