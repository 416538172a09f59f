"""stepprof._scopes: profile_step and measure as a user meets them, forms and misuse."""

from __future__ import annotations

import inspect
import pydoc

import pytest
import torch

import stepprof

from .conftest import make, steps


def steps(log):
    return list(stepprof.read(log, kind="step"))


def test_measure_forms_step_outside_a_step_and_phase_inside(log, gpu):
    with make(log, gpu) as prof:

        @stepprof.measure
        def train_step(x):
            with stepprof.measure("forward"):
                return x + 1

        @stepprof.measure("named")
        def other():
            return "ok"

        @stepprof.measure()
        def third():
            return 3

        assert train_step(1) == 2 and train_step.__name__ == "train_step"
        assert other() == "ok" and third() == 3
        with prof.step("outer"):
            train_step(2)           # inside a step: a phase
    recs = steps(log)
    names = [r["name"] for r in recs]
    assert names[:3] == [
        "test_measure_forms_step_outside_a_step_and_phase_inside.<locals>.train_step",
        "named",
        "test_measure_forms_step_outside_a_step_and_phase_inside.<locals>.third",
    ]
    assert recs[0]["phases"].keys() == {"forward"}
    outer = recs[3]
    assert outer["name"] == "outer"
    key = "test_measure_forms_step_outside_a_step_and_phase_inside.<locals>.train_step"
    assert set(outer["phases"]) == {key, key + "/forward"}


def test_measured_function_that_raises_is_recorded(log, gpu):
    @stepprof.measure("boom")
    def boom():
        raise KeyError("k")

    with make(log, gpu):
        with pytest.raises(KeyError):
            boom()
    (r,) = steps(log)
    assert r["error"]["type"] == "KeyError"


def test_recursive_measured_function(log, gpu):
    @stepprof.measure("fib")
    def fib(n):
        return n if n < 2 else fib(n - 1) + fib(n - 2)

    with make(log, gpu):
        assert fib(5) == 5
    (r,) = steps(log)                # the outer call is the step, inner calls nest as phases
    assert r["name"] == "fib"
    assert r["phases"]["fib"]["count"] == 2


def test_measure_above_staticmethod_and_classmethod(log, gpu):
    class Model:
        @stepprof.measure
        @staticmethod
        def loss(x):
            return x + 1

        @stepprof.measure("make")
        @classmethod
        def make(cls, x):
            return cls, x

        @stepprof.measure
        @classmethod
        def name(cls):
            return cls.__name__

    with make(log, gpu) as prof:
        assert Model.loss(1) == 2 and Model().loss(1) == 2
        assert Model.make(3) == (Model, 3) and Model().make(3) == (Model, 3)
        assert Model.name() == "Model"
    assert prof.summary.steps == 5
    local = "test_measure_above_staticmethod_and_classmethod.<locals>.Model."
    assert [r["name"] for r in steps(log)] == [local + "loss"] * 2 + ["make"] * 2 + [local + "name"]


def test_profile_step_inside_a_step_is_a_clear_error(log, gpu):
    with make(log, gpu):
        with stepprof.profile_step("outer"):
            with pytest.raises(stepprof.UsageError, match="steps do not nest.*measure"):
                with stepprof.profile_step("inner"):
                    pass
    (r,) = steps(log)
    assert r["name"] == "outer" and r["error"] is None


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: stepprof.measure.__enter__(), "forget the brackets"),
        (lambda: stepprof.profile_step.__enter__(), "forget the brackets"),
        (lambda: stepprof.measure(123), "takes a name"),
        (lambda: stepprof.measure("x")(5), "decorates a function"),
        (lambda: stepprof.measure("x")(lambda: (yield)), "generator or coroutine"),
        (lambda: stepprof.profile_step(print), "'name' must be a str.*@stepprof.measure"),
    ],
)
def test_misuse_gets_a_hint(call, match):
    with pytest.raises(stepprof.UsageError, match=match):
        call()


def test_with_measure_without_brackets_is_hinted():
    with pytest.raises(stepprof.UsageError, match="forget the brackets"):
        with stepprof.measure:  # type: ignore[attr-defined]
            pass


def test_measure_as_context_needs_a_name(log, gpu):
    with make(log, gpu):
        with pytest.raises(stepprof.UsageError, match="needs a name"):
            with stepprof.measure():
                pass


def test_no_graph_break_inside_a_compiled_region(log, gpu):
    def f(x):
        with stepprof.measure("inside"):
            y = x.sin()
        return y.cos()

    measured = stepprof.measure("compiled-step")(lambda x: x.sin() * 2)
    with make(log, gpu):
        compiled = torch.compile(f, fullgraph=True, backend="eager")
        x = torch.randn(4)
        assert torch.allclose(compiled(x), f(x))
        compiled_measured = torch.compile(measured, fullgraph=True, backend="eager")
        assert torch.allclose(compiled_measured(x), x.sin() * 2)
        # Recommended form: measure outside torch.compile records a step per call.
        outer = stepprof.measure("outside")(torch.compile(lambda x: x.cos(), backend="eager"))
        outer(x)
        outer(x)
    names = [r["name"] for r in steps(log)]
    assert names == ["inside", "outside", "outside"]  # the eager call of f recorded one step


@pytest.mark.parametrize("fn", ["profile_step", "measure"])
def test_help_shows_the_function_not_a_private_class(fn):
    obj = getattr(stepprof, fn)
    text = pydoc.render_doc(obj, renderer=pydoc.plaintext)
    assert f"\n{fn}(name" in text and "Example:" in text
    assert "class " not in text and "_scopes" not in text
    assert "name" in inspect.signature(obj).parameters
    assert repr(obj) == f"<function stepprof.{fn}>" and obj.__name__ == fn


def test_a_public_function_as_a_class_attribute_stays_itself():
    class Holder:
        step = stepprof.profile_step

    assert Holder().step is stepprof.profile_step


def test_steps_and_phases_are_ranges_in_a_torch_profiler_trace(log, gpu, tmp_path):
    """While a torch.profiler records, each step is a ``ProfilerStep#N`` range (as torch names
    its steps, for HTA and TensorBoard) and each phase a range of its name; outside, none."""
    from torch.profiler import ProfilerActivity, profile

    with make(log, gpu) as prof:
        with prof.step():  # before the profiler: no range
            pass

        @prof.measure("optimizer")
        def optimizer_step():
            torch.ones(2).sum()

        with profile(activities=[ProfilerActivity.CPU]) as traced:
            for _ in range(3):
                with prof.step():
                    with prof.measure("forward"):
                        torch.ones(4).sum()
                    optimizer_step()
        with prof.step():  # after it: none
            pass
    names = [e.name for e in traced.events()]  # (torch shows its steps' ranges as "ProfilerStep*")
    assert names.count("ProfilerStep*") == 3 and names.count("forward") == 3 and names.count("optimizer") == 3
    trace = tmp_path / "trace.json"
    traced.export_chrome_trace(str(trace))
    text = trace.read_text()
    assert all(f'"ProfilerStep#{i}"' in text for i in (1, 2, 3)) and '"ProfilerStep#0"' not in text
    assert [r["step"] for r in steps(log)] == [0, 1, 2, 3, 4]


def test_a_range_that_fails_to_open_leaves_the_step_recorded(log, gpu, monkeypatch):
    from torch.profiler import ProfilerActivity, profile

    def broken(name):
        raise RuntimeError("no range")

    monkeypatch.setattr(torch.autograd.profiler, "record_function", broken)
    with make(log, gpu) as prof:
        with profile(activities=[ProfilerActivity.CPU]):
            with prof.step():
                with prof.measure("forward"):
                    pass
    (r,) = steps(log)
    assert r["error"] is None and r["phases"]["forward"]["count"] == 1
