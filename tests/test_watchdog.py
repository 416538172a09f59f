"""A watchdog's exception always reaches the loop, and stepprof runs none of the user's code it does not need.

The usual watchdog: a SIGALRM handler that raises ``TimeoutError``.  The alarm lands at a
random point of the loop, stepprof's boundaries and its reads (the RSS read at each CPU
step's exit, the batch inference) included; whatever guard it lands in must let it go.
"""

from __future__ import annotations

import ast
import gc
import inspect
import pathlib
import random
import signal

import pytest
import torch

import stepprof
from stepprof._batch import infer_batch_size
from stepprof._recorder.boundaries import Boundaries
from stepprof._recorder.profiler import _make_profiler

from .conftest import make

pytestmark = [pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs setitimer"),
              pytest.mark.usefixtures("either_path")]

ALARMS = 2000


class Watchdog:
    """Counts the alarms it raised for, as a callable object, a bound method or a function."""

    def __init__(self) -> None:
        self.fired = 0

    def __call__(self, signum, frame):
        self.fired += 1
        raise TimeoutError("step took too long")

    def on_alarm(self, signum, frame):
        self.fired += 1
        raise TimeoutError("step took too long")


@pytest.mark.parametrize("kind", ["function", "callable object", "bound method"])
def test_every_watchdog_timeout_reaches_the_loop(tmp_path, kind):
    dog = Watchdog()
    if kind == "function":
        def handler(signum, frame):
            dog.fired += 1
            raise TimeoutError("step took too long")
    else:
        handler = dog if kind == "callable object" else dog.on_alarm
    rng = random.Random(1234)
    batch = (torch.ones(4, 2), torch.zeros(4))
    # Loaded before the alarms: the first use of a lazy name imports its module, and
    # importlib's own stat of a path takes an OSError (TimeoutError is one) for "not there".
    assert stepprof.measure and stepprof.Profiler
    previous = signal.signal(signal.SIGALRM, handler)
    caught = 0
    # The cyclic collector off: CPython drops what a handler raises inside a weakref callback
    # that a collection runs (seen once in ~10,000 alarms, on garbage other tests left).
    # stepprof itself leaves no cyclic garbage: see the test below.
    gc.collect()
    gc.disable()
    try:
        with _make_profiler(str(tmp_path / "run.jsonl"), device="cpu", energy_every_s=None) as prof:
            for _ in range(ALARMS):
                try:
                    # One shot, 1-120 µs away: it lands inside a step about as often as a
                    # step (a few tens of µs on the CPU) fills the loop.
                    signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 120e-6))
                    for _ in range(100_000):  # far longer than the alarm takes: a lost one ends here
                        with prof.step(batch=batch):
                            with stepprof.measure("fwd"):
                                pass
                except TimeoutError:
                    caught += 1
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            assert prof._boundaries.broken is None
            for _ in range(10):  # and it records on
                with prof.step(batch=batch):
                    pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        gc.enable()
    assert dog.fired == ALARMS
    assert caught == ALARMS  # none swallowed
    records = list(stepprof.read(tmp_path / "run.jsonl", kind="step"))
    errors = {r["error"]["type"] for r in records if r["error"] is not None}
    assert errors <= {"TimeoutError", "Interrupted"}, errors
    assert all(r["error"] is None and r["batch_size"] == 4 for r in records[-10:])


def test_steps_leave_no_cyclic_garbage(tmp_path):
    """Nothing for the cyclic collector, whose weakref callbacks would drop a handler's
    exception: plain steps with a phase, and steps that raise."""
    batch = (torch.ones(4, 2), torch.zeros(4))
    with _make_profiler(str(tmp_path / "run.jsonl"), device="cpu", energy_every_s=None) as prof:
        for _ in range(20):
            with prof.step(batch=batch):
                with stepprof.measure("fwd"):
                    pass
        gc.collect()
        gc.disable()
        try:
            for i in range(500):
                try:
                    with prof.step(batch=batch):
                        with stepprof.measure("fwd"):
                            if i % 2:
                                raise TimeoutError
                except TimeoutError:
                    pass
            assert gc.collect() == 0
        finally:
            gc.enable()


class Loud(Exception):
    """An exception whose message cannot be printed: its ``__str__`` raises."""

    def __init__(self, what: type[BaseException]) -> None:
        super().__init__()
        self.what = what

    def __str__(self) -> str:
        raise self.what("from __str__")


@pytest.mark.parametrize("what", [KeyboardInterrupt, SystemExit, ValueError])
def test_the_users_exception_propagates_even_when_its_str_raises(log, gpu, what):
    err = Loud(what)
    with make(log, gpu) as prof:
        with pytest.raises(Loud) as info:
            with prof.step():
                raise err
        with prof.step():
            pass
    assert info.value is err
    first, second = list(stepprof.read(log, kind="step"))
    assert first["error"]["type"] == "Loud" and "unprintable" in first["error"]["message"]
    assert second["error"] is None


class Nosy:
    """A batch-like object whose every hook is user code that must not run."""

    calls: list[str] = []

    def __init__(self) -> None:
        self.x = torch.ones(3, 2)

    def __getattr__(self, name):
        Nosy.calls.append(f"__getattr__ {name}")
        raise RuntimeError("user code ran")

    def __repr__(self):
        Nosy.calls.append("__repr__")
        raise RuntimeError("user code ran")


class Key:
    def __repr__(self):
        Nosy.calls.append("key __repr__")
        raise RuntimeError("user code ran")

    def __hash__(self):
        return 1


class Items(dict):
    def items(self):
        Nosy.calls.append("items")
        raise RuntimeError("user code ran")


class Iter(list):
    def __iter__(self):
        Nosy.calls.append("__iter__")
        raise RuntimeError("user code ran")


class Slotted:
    __slots__ = ("x",)

    def __getattr__(self, name):
        Nosy.calls.append(f"__getattr__ {name}")
        raise RuntimeError("user code ran")


def test_batch_inference_runs_none_of_the_users_code():
    Nosy.calls = []
    assert infer_batch_size(Nosy()) == (3, None)
    assert infer_batch_size(Items(a=torch.ones(5))) == (5, None)
    assert infer_batch_size(Iter([torch.ones(6), torch.ones(6, 1)])) == (6, None)
    assert infer_batch_size(Slotted())[0] is None
    size, why = infer_batch_size({Key(): torch.ones(2), "b": torch.ones(7)})
    assert size is None and "batch[<Key>] has 2" in why and "batch['b'] has 7" in why
    assert Nosy.calls == []


def test_batch_inference_never_raises_out_of_a_step(log, gpu):
    class Broken(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            raise RuntimeError("user code ran")

    t = torch.ones(4, 2).as_subclass(Broken)
    assert infer_batch_size(t) == (4, None)
    with make(log, gpu) as prof:
        with prof.step(batch=Nosy()):
            pass
    (r,) = list(stepprof.read(log, kind="step"))
    assert r["batch_size"] == 3 and r["error"] is None


# -- every guard around stepprof's own work lets a signal handler's exception go ----------

#: What a watchdog's handler raises (TimeoutError, InterruptedError) are OSErrors: a guard
#: around stepprof's own I/O that catches OSError must ask too.
_BROAD = {"Exception", "BaseException", "bare", "OSError", "IOError", "EnvironmentError", "TimeoutError",
          "InterruptedError"}
#: Readers and the CLI, which run outside a training step, are left to their own tests.
_READERS = ("_report/", "_export.py", "_plot.py", "_frame.py", "_cli.py", "_demo.py", "_peak_plot.py",
            "_env.py", "_sweep/plot.py")
#: The boundaries' exception handlers (the step core calls them too): a guard may hand its
#: exception to one, which asks ``raised_by_user`` itself.
_HANDLERS = ("entry_failed", "exit_failed")

_GUARD_EXEMPT = {
    # The check itself: a getsignal that this platform refuses.
    ("stepprof/_errors.py", "from_signal_handler"),
    # They swallow a second exception while the user's first one propagates.
    ("stepprof/_scopes.py", "_abandon"),
    ("stepprof/_scopes.py", "_exit_again"),
}


def test_every_broad_guard_re_raises_what_a_signal_handler_raised():
    """An ``except Exception`` (``BaseException``, ``OSError``...) around stepprof's own work first asks
    ``raised_by_user`` (or ``from_signal_handler``), unless it only cleans up and re-raises."""
    root = pathlib.Path(stepprof.__file__).parent
    missing = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        rel = f"stepprof/{path.relative_to(root)}"
        if any(r in rel for r in _READERS):
            continue
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, ast.ExceptHandler):
                    continue
                names = {n.id for n in ast.walk(node.type) if isinstance(n, ast.Name)} if node.type else {"bare"}
                if not names & _BROAD:
                    continue
                body = ast.Module(body=node.body, type_ignores=[])
                last = node.body[-1]
                if isinstance(last, ast.Raise) and last.exc is None:
                    continue  # cleans up, then re-raises
                text = ast.unparse(body)
                if "raised_by_user" in text or "from_signal_handler" in text:
                    continue
                if any(f"{h}(" in text for h in _HANDLERS):
                    continue  # hands it to a handler that asks (checked below)
                if (rel, fn.name) not in _GUARD_EXEMPT:
                    missing.append(f"{rel}:{node.lineno} in {fn.name}")
    assert not missing, "guards that would swallow a signal handler's exception:\n" + "\n".join(missing)
    for name in _HANDLERS:
        assert "raised_by_user(" in inspect.getsource(getattr(Boundaries, name)), name
