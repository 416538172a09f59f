from __future__ import annotations

import os
import signal
import sys
import warnings

import pytest
import torch

import stepprof
from stepprof import _registry
from stepprof._recorder.profiler import _make_profiler

from .fakes import FakeGpu, FakeNvml

# A suite started in the background (`cmd &`, nohup) inherits SIGINT ignored, and then Python
# installs no KeyboardInterrupt handler: stepprof rightly leaves an ignored signal alone, so the
# Ctrl-C tests would test that instead.  Run them as a terminal would (children inherit it too).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _warm_torch() -> None:
    """Let torch make its lazy imports (sympy adds a warning filter) before the state checks."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()


_warm_torch()


def _build_the_c_fold() -> None:
    """The suite runs on the C fold and record build where a C compiler is there, as a user's
    profiler does once its background build is done; tests/test_fold.py holds Python to them."""
    from stepprof import _native
    from stepprof._errors import BuildError

    try:
        _native.build()
    except BuildError:
        return
    _native.reload()


_build_the_c_fold()


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _forget_compiles() -> None:
    """Clear torch._dynamo's counters: a profiler takes a process that compiled a graph
    before its first step as one running compiled code (stepprof/_recorder/compiles.py)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is not None:
        utils.counters.clear()


@pytest.fixture(autouse=True)
def clean_state(monkeypatch, request):
    """Reset stepprof's process-wide state (stepprof._registry); afterwards assert none was left behind.

    Tests without the ``cuda`` marker never reach the real NVML: ``import pynvml``
    fails in them (NVML missing) unless the test installs a ``FakeNvml``.
    """
    monkeypatch.delenv("STEPPROF_LOG", raising=False)
    monkeypatch.delenv("STEPPROF_WARMUP", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    # No test builds the compiled boundary in the background unless it asks to
    # (tests/test_build.py); one built ahead of time (`stepprof build`) is still used.
    monkeypatch.setenv("STEPPROF_BUILD", "0")
    if "cuda" not in request.keywords:
        monkeypatch.setitem(sys.modules, "pynvml", None)
    _registry.reset()
    _forget_compiles()
    filters = list(warnings.filters)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    sync_mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else None
    yield
    leftover = _registry.reset()
    assert not leftover, f"a Profiler was left active: {leftover}"
    assert warnings.filters == filters, "warning filters were not restored"
    assert {s: signal.getsignal(s) for s in handlers} == handlers, "signal handlers were not restored"
    if sync_mode is not None:
        assert torch.cuda.get_sync_debug_mode() == sync_mode, "sync-debug mode was not restored"


@pytest.fixture(params=["core", "python"])
def either_path(request, monkeypatch) -> str:
    """The test once on the step core (stepprof/_core.c) and the C harvest, and once on the
    Python boundaries and harvest, as a profiler without the C module runs (the fault suite
    and the energy tests run on both)."""
    from stepprof._recorder import collector, core, energy

    if request.param == "python":
        monkeypatch.setattr(core._STATE, "module", None)
        monkeypatch.setattr(collector._NATIVE, "harvest", None)
        monkeypatch.setattr(energy._NATIVE, "fill", None)
    elif core._STATE.module is None:
        pytest.skip("stepprof's C module is not built here (no C compiler)")
    return request.param


@pytest.fixture
def gpu() -> FakeGpu:
    return FakeGpu()


@pytest.fixture
def nvml(monkeypatch, gpu) -> FakeNvml:
    """A fake NVML that sees ``gpu``, imported by stepprof._nvml as ``pynvml``."""
    fake = FakeNvml(gpu)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


@pytest.fixture
def log(tmp_path):
    return str(tmp_path / "run.jsonl")


def make(log, gpu, **kw) -> stepprof.Profiler:
    """A profiler on the fake device, harvesting inline at step exits (deterministic).

    Energy sampling (a thread of its own) is off unless a test asks for it.
    """
    kw.setdefault("collect_every_s", None)
    kw.setdefault("energy_every_s", None)
    return _make_profiler(log, backend=gpu, clock=gpu.clock, **kw)


def steps(log, prof=None) -> list[dict]:
    """The step records of ``log``, in file order."""
    return list(stepprof.read(log, kind="step"))


def marked_line(path: str, marker: str) -> str:
    """``file:line`` (relative to the working directory, as sync sites are) of the line in
    ``path`` that ends with ``# <marker>``."""
    with open(path) as f:
        for i, text in enumerate(f, 1):
            if text.rstrip().endswith(f"# {marker}"):
                return f"{os.path.relpath(path)}:{i}"
    raise AssertionError(f"no line ends with '# {marker}' in {path}")
