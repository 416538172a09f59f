"""stepprof is typed for its users (PEP 561): ``py.typed`` ships in the package, ``mypy
--strict`` checks code that uses stepprof against stepprof's own types (it does not skip it
as an untyped package), and the package itself passes ``mypy --strict``."""

from __future__ import annotations

import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

from stepprof._accumulators import Fields

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "stepprof"
#: mypy's cache: git-ignored, kept between runs (a cold run analyses torch: about a minute).
CACHE = ROOT / ".mypy_cache" / "test_typed"

#: Code that uses the public API as a user writes it: never run, only type-checked.  Each
#: ``assert_type`` fails if stepprof's type there were Any (an untyped package gives Any);
#: the lines marked ``# error`` are mistakes mypy must report (``# error: <code>``: with that code).
USER_CODE = '''\
from __future__ import annotations

from typing import Any

import torch
from typing_extensions import assert_type

import stepprof


@stepprof.measure
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@stepprof.measure("loss")
def loss_of(y: torch.Tensor) -> float:
    return float(y.sum())


def train(steps: int) -> stepprof.Summary:
    batches = [torch.ones(8, 4)] * steps
    with stepprof.Profiler("train.jsonl", warmup=1, device="cpu", syncs="off") as prof:
        assert_type(prof, stepprof.Profiler)
        for batch in stepprof.iterate(batches):
            with stepprof.profile_step(batch_size=8):
                with stepprof.measure("forward"):
                    y = double(batch)
                assert_type(y, torch.Tensor)
                assert_type(loss_of(y), float)
            with prof.step(batch=batch), prof.measure("backward"):
                assert_type(prof.measure(double)(batch), torch.Tensor)
        assert_type(stepprof.memory_report(), stepprof.MemoryReport)
        assert_type(prof.warmup, int)
    summary = prof.close()
    assert_type(summary.measured_steps, int)
    assert_type(prof.summary, stepprof.Summary | None)
    if summary.wall_ms is not None:
        assert_type(summary.wall_ms.median, float)
    for phase in summary.phases.values():
        assert_type(phase.gpu_ms_median, float | None)
    label: str = summary.gpu_busy_median  # error: assignment
    return summary


def batch_size() -> int | None:
    model = torch.nn.Linear(4, 2)

    def step(batch: torch.Tensor) -> None:
        model.forward(batch)

    result = stepprof.sweep(step, lambda n: torch.randn(n, 4), max_batch=64, progress=False)
    assert_type(result, stepprof.SweepResult)
    point = result.point(8)
    if point is not None:
        assert_type(point.samples_per_s, float | None)
    stepprof.sweep(step, lambda n: "not a batch", max_batch=64)  # error (its code varies with mypy's version)
    return result.recommended


def explained() -> int | None:
    stepprof.configure(log=None, warmup=2)
    exp = stepprof.explain_peak(double, torch.ones(2, 2), model=torch.nn.Linear(2, 2))
    assert_type(exp, stepprof.PeakExplanation)
    return exp.peak_allocated_bytes


def records(path: str) -> list[float]:
    walls: list[float] = []
    for record in stepprof.read(path, kind="step"):
        assert_type(record, dict[str, Any])
        walls.append(float(record["wall_ms"]))
    try:
        stepprof.frame([path, path])
    except stepprof.MissingExtraError as e:
        assert_type(e, stepprof.MissingExtraError)
    return walls
'''


def _mypy(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    """``python -m mypy --strict ARGS`` in ``cwd``, with this checkout's stepprof first on the path."""
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(CACHE), "--no-color-output",
         "--no-error-summary", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False,
    )


def test_py_typed_ships_in_the_package() -> None:
    assert (PACKAGE / "py.typed").is_file()
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10
        assert re.search(r'^"stepprof" = \["py.typed"\]$', text, re.M), "py.typed is not in the package data"
    else:
        assert "py.typed" in tomllib.loads(text)["tool"]["setuptools"]["package-data"]["stepprof"]


def test_every_accumulator_has_its_type_declared() -> None:
    """A ``Fields`` class makes its accumulators from ``FIELDS``; their types are declared apart
    (for a type checker): a field added to one must be added to the other."""
    from stepprof import _aggregate

    classes = [c for c in vars(_aggregate).values() if isinstance(c, type) and issubclass(c, Fields)
               and c.FIELDS]
    assert len(classes) == 3
    for cls in classes:
        declared = {name for klass in cls.__mro__ for name in inspect.get_annotations(klass)}
        assert {name for name, _ in cls.FIELDS} - declared == set(), cls.__name__


def test_mypy_strict_checks_code_that_uses_stepprof(tmp_path: pathlib.Path) -> None:
    """Found on the path as an installed package, stepprof is checked (py.typed), not skipped."""
    pytest.importorskip("mypy", reason="mypy is not installed (it is in the dev extra)")
    (tmp_path / "mypy.ini").write_text("[mypy]\n")  # this test's settings, not a user's own
    script = tmp_path / "user_code.py"
    script.write_text(USER_CODE)
    expected = {i: m.group(1) for i, line in enumerate(USER_CODE.splitlines(), 1)
                if (m := re.search(r"# error(?:: ([a-z-]+)$)?", line))}
    done = _mypy(script.name, cwd=tmp_path)
    out = done.stdout + done.stderr
    found = {int(m.group(1)): m.group(2)
             for m in re.finditer(r"^user_code\.py:(\d+): error: .*\[([a-z-]+)\]$", out, re.M)}
    assert found.keys() == expected.keys(), out
    assert all(code is None or found[i] == code for i, code in expected.items()), out
    assert 'expression has type "float | None", variable has type "str"' in out, out
    assert done.returncode == 1, out


def test_mypy_strict_passes_on_the_package() -> None:
    pytest.importorskip("mypy", reason="mypy is not installed (it is in the dev extra)")
    done = _mypy("stepprof", cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
