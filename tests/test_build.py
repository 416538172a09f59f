"""The compiled boundary builds itself: a profiler starts the build in a child process, never
on the training thread, and takes the result at a step boundary.

On the CPU the same source builds the host core (``STEPPROF_CUDA=0``), so these run in CI
with a real compiler; the CUDA test switches a real run from the Python boundary to the
compiled one on the H200.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import stepprof
from stepprof import _registry
from stepprof._device import compiled
from stepprof._records import Summary


#: How long a real build may take on a loaded 2-core machine (it takes 3-10 s).
BUILD_WITHIN_S = float(os.environ.get("STEPPROF_TEST_BUILD_S", "240"))


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    """stepprof's cache in tmp_path (nothing built there), background builds allowed."""
    monkeypatch.setenv("STEPPROF_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("STEPPROF_BUILD", raising=False)
    _registry.reset()
    yield tmp_path / "cache"
    bg = compiled._BACKGROUND
    if bg.proc is not None and bg.proc.poll() is None:
        bg.proc.kill()
        bg.proc.wait()


def _step_until(prof, done, within_s: float) -> list[float]:
    """Step (a few ms of host work each) until ``done()``; the steps' wall times, in s."""
    walls = []
    deadline = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < deadline, f"not done within {within_s} s"
        t0 = time.perf_counter()
        with prof.step(batch_size=1):
            sum(range(20_000))
        walls.append(time.perf_counter() - t0)
        time.sleep(0.01)
    return walls


@pytest.mark.skipif(not compiled.shutil.which("c++") and not compiled.shutil.which("g++"),
                    reason="needs a C++ compiler")
def test_a_cpu_profiler_builds_the_host_core_in_a_child_and_takes_it_at_a_step(fresh_cache, tmp_path):
    log = str(tmp_path / "run.jsonl")
    prof = stepprof.Profiler(log, device="cpu")
    b = prof._boundaries
    walls = _step_until(prof, lambda: b.next_index > 0 and b.slot.awaiting is None and b.slot.read_rss != _registry.HOST_RSS.read,
                        BUILD_WITHIN_S)
    with prof.step(batch_size=1):  # on the core
        pass
    prof.close()
    bg = compiled._BACKGROUND
    assert bg.proc is not None and bg.proc.pid != os.getpid() and bg.proc.returncode == 0
    assert os.path.isfile(os.path.join(compiled.cache_dir(), "stepprof_boundary.so"))
    with open(bg.log, encoding="utf-8") as f:
        assert "the compiled boundary is ready in" in f.read()
    assert b.slot.core_reason is None
    # The build ran beside the loop: no step waited for it (a compile takes seconds).
    assert len(walls) >= 2 and max(walls) < 1.0, max(walls)
    rss = [r["host_rss_bytes"] for r in stepprof.read(log, kind="step")]
    assert all(isinstance(x, int) and x > 10 * 2**20 for x in rss)
    assert abs(rss[-1] - rss[-2]) < 256 * 2**20  # the core reads the same figure
    # The next process (here: after a reset) loads it at once, building nothing.
    _registry.reset()
    state, why = compiled.build_in_background()
    assert why is None and state.module is not None and state.proc is None


def test_the_core_reads_what_statm_says(fresh_cache):
    try:
        compiled.build()
    except stepprof.StepprofError as e:
        pytest.skip(f"cannot build here: {e}")
    module, why = compiled.load()
    assert why is None and module.CUDA is (torch.version.cuda is not None)
    fd = os.open("/proc/self/statm", os.O_RDONLY)
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        got = module.host_rss(fd, page)
        want = int(os.pread(fd, 256, 0).split()[1]) * page
        assert abs(got - want) < 16 * 2**20
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        module.host_rss(fd, page)  # closed


def test_STEPPROF_BUILD_0_turns_the_background_build_off(fresh_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("STEPPROF_BUILD", "0")
    state, why = compiled.build_in_background()
    assert state is None and why.startswith("STEPPROF_BUILD=0 turned the background build off")
    assert "`stepprof build`" in why
    assert compiled._BACKGROUND.proc is None and not os.path.exists(fresh_cache / "boundary")
    with stepprof.Profiler(str(tmp_path / "r.jsonl"), device="cpu") as prof:
        with prof.step():
            pass
    assert prof._boundaries.slot.core_reason == why


def test_without_a_compiler_no_build_starts_and_the_reason_names_the_fix(fresh_cache, monkeypatch):
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    state, why = compiled.build_in_background()
    assert state is None and compiled._BACKGROUND.proc is None
    assert why.startswith("the boundary cannot be built here: no C++ compiler") and "apt-get install g++" in why
    assert compiled.build_in_background() == (None, why)  # asked once per process


def test_a_failed_build_leaves_its_reason_and_is_not_retried_until_stepprof_build(
        fresh_cache, monkeypatch):
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    state, why = compiled.build_in_background()
    assert why is None and state is not None
    deadline = time.monotonic() + BUILD_WITHIN_S
    while state.reason is None and state.module is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert state.module is None and state.reason.startswith("the background build failed (")
    assert "`stepprof build --verbose` shows why and retries" in state.reason
    assert os.path.isfile(compiled.cache_dir() + ".failed")
    _registry.reset()  # a later process: the failure is read, no build is started
    state2, why2 = compiled.build_in_background()
    assert state2 is None and why2.startswith("the background build failed (")
    assert compiled._BACKGROUND.proc is None
    monkeypatch.delenv("CXX")
    if compiled._missing_tool() is None:
        # The manual build (a process of its own, as a user runs it) retries, and clears the mark.
        proc = subprocess.run([sys.executable, "-m", "stepprof", "build"], capture_output=True, text=True,
                              timeout=BUILD_WITHIN_S, cwd=os.path.dirname(os.path.dirname(__file__)))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert not os.path.exists(compiled.cache_dir() + ".failed")


def test_the_summary_and_the_report_say_why_the_python_boundary_ran():
    why = "the boundary cannot be built here: no C++ compiler (no `c++` on PATH): install one"
    text = str(Summary(steps=1, warmup_steps=0, error_steps=0, measured_steps=1, device="cuda:0",
                       wall_ms=None, gpu_ms=None, gpu_busy_median=None, peak_allocated_bytes_max=None,
                       samples_per_s_median=None, overhead_us_median=None, log=None,
                       boundary="python", unavailable={"boundary": why}))
    assert f"the Python boundary ran ({why}); the compiled one costs about" in text


def _why_not(b) -> str:
    bg = compiled._BACKGROUND
    log = ""
    if bg.log and os.path.exists(bg.log):
        with open(bg.log, encoding="utf-8", errors="replace") as f:
            log = f.read()[-3000:]
    return (f"backend {type(b.backend).__name__}, awaiting {b.slot.awaiting is not None}, core_reason {b.slot.core_reason!r}, "
            f"build: started {bg.started}, rc {bg.proc.poll() if bg.proc else None}, module {bg.module}, "
            f"reason {bg.reason!r}, log {log!r}")


@pytest.mark.cuda
def test_a_cuda_run_switches_to_the_compiled_boundary_it_built_at_a_step_boundary(fresh_cache, tmp_path):
    """boundary="auto" with nothing built: the first steps run the Python boundary while a
    child builds the compiled one; later steps run on it; every step has its GPU figures."""
    dev = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(1024, 1024, device=dev)
    log = str(tmp_path / "run.jsonl")
    prof = stepprof.Profiler(log)
    b = prof._boundaries

    def step():
        with prof.step(batch_size=8):
            with prof.measure("matmul"):
                (a @ a).relu_()

    t_end = time.monotonic() + BUILD_WITHIN_S
    walls = []
    try:
        while b.backend is None or b.backend.boundary != "compiled":
            assert time.monotonic() < t_end, _why_not(b)
            assert not (b.next_index and b.slot.awaiting is None and b.slot.core_reason), _why_not(b)
            t0 = time.perf_counter()
            step()
            walls.append(time.perf_counter() - t0)
            time.sleep(0.01)
        switched_at = len(walls)
        for _ in range(20):
            step()
    finally:
        summary = prof.close()
    assert summary.boundary == "compiled" and "boundary" not in summary.unavailable
    assert switched_at >= 2 and max(walls) < 1.0, (switched_at, max(walls))
    recs = list(stepprof.read(log, kind="step"))
    assert len(recs) == switched_at + 20
    for r in recs:
        assert r["gpu_ms"] > 0 and r["peak_allocated_bytes"] > 0 and r["phases"]["matmul"]["gpu_ms"] > 0
    with open(compiled._BACKGROUND.log or "", encoding="utf-8") as f:
        assert "the compiled boundary is ready in" in f.read()


def test_two_threads_taking_the_finished_build_at_once_is_harmless(tmp_path):
    """Each thread's step entry may see the build done; the first takes it, the next finds nothing."""
    import types

    with stepprof.Profiler(str(tmp_path / "r.jsonl"), device="cpu") as prof:
        with prof.step():
            pass
        b = prof._boundaries
        b.slot.awaiting = types.SimpleNamespace(module=None, reason="the background build failed (oops)")
        b.slot.take_core()
        b.slot.take_core()  # the second thread's: nothing left to take
        assert b.slot.awaiting is None and b.slot.core_reason == "the background build failed (oops)"
