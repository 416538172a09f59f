"""Profiler.begin_step/end_step and begin_phase/end_phase: the scopes without context managers."""

from __future__ import annotations

import threading

import pytest
import torch

import stepprof

from .conftest import make, steps
from .fakes import FakeGpu


def _run(prof, gpu, hooks: bool) -> None:
    for _ in range(3):
        if hooks:
            prof.begin_step(batch_size=8)
            prof.begin_phase("forward")
            gpu.alloc(10); gpu.launch(1.0); gpu.host(0.5)
            prof.end_phase("forward")
            prof.begin_phase("backward")
            gpu.launch(2.0); gpu.host(0.5); gpu.free(10)
            prof.end_phase()
            prof.end_step()
        else:
            with prof.step(batch_size=8):
                with prof.measure("forward"):
                    gpu.alloc(10); gpu.launch(1.0); gpu.host(0.5)
                with prof.measure("backward"):
                    gpu.launch(2.0); gpu.host(0.5); gpu.free(10)
        gpu.host(1.0)


def _figures(r):
    return (r["step"], r["batch_size"], r["wall_ms"], r["gpu_ms"], r["peak_allocated_bytes"],
            {k: (v["wall_ms"], v["gpu_ms"], v["peak_allocated_bytes"], v["count"]) for k, v in r["phases"].items()})


def test_begin_and_end_record_what_the_context_managers_record(tmp_path):
    got = {}
    for hooks in (False, True):
        gpu = FakeGpu()
        log = str(tmp_path / f"{hooks}.jsonl")
        prof = make(log, gpu, phase_peaks_every=1)
        _run(prof, gpu, hooks)
        prof.close()
        got[hooks] = [_figures(r) for r in steps(log)]
    assert got[True] == got[False] and len(got[True]) == 3


def test_end_step_records_the_error_and_closes_phases_left_open(log, gpu):
    prof = make(log, gpu)
    prof.begin_step(batch=torch.zeros(4, 2))
    prof.begin_phase("forward")
    prof.begin_phase("inner")
    prof.end_step(error=ValueError("bad batch"))
    prof.begin_step()  # the next step is clean
    prof.end_step()
    prof.close()
    failed, after = steps(log)
    assert failed["error"] == {"type": "ValueError", "message": "bad batch"}
    assert failed["batch_size"] == 4 and set(failed["phases"]) == {"forward", "forward/inner"}
    assert after["error"] is None and after["phases"] == {}
    assert gpu.ranges.count("-") == sum(1 for x in gpu.ranges if x.startswith("+"))


def test_a_step_without_batches_records_why_it_has_no_batch_size(log, gpu):
    """begin_step(batch_reason=...): code that cannot see the batches (a framework's hooks
    alone) says why; the reason is the step's, not the next one's."""
    prof = make(log, gpu)
    prof.begin_step(batch_reason="the hooks cannot see the batches")
    prof.end_step()
    prof.begin_step(batch_size=8)
    prof.end_step()
    prof.close()
    unseen, sized = steps(log)
    assert unseen["batch_size"] is None and unseen["samples_per_s"] is None
    assert unseen["unavailable"]["batch_size"] == "the hooks cannot see the batches"
    assert unseen["unavailable"]["samples_per_s"] == "the hooks cannot see the batches"
    assert sized["batch_size"] == 8 and "batch_size" not in sized["unavailable"]


@pytest.mark.parametrize("misuse, message", [
    (lambda p: p.end_step(), r"end_step\(\) without begin_step\(\) on this thread"),
    (lambda p: p.begin_step(batch_reason=""), r"batch_reason=\.\.\.\) takes why the step has no batch size, a non-empty str \(got ''\)"),
    (lambda p: p.begin_step(batch_reason=3), r"takes why the step has no batch size.*\(got 3\)"),
    (lambda p: p.begin_step(8, batch_reason="x"), r"pass batch_size= or batch=, or batch_reason=, not both"),
    (lambda p: (p.begin_step(), p.begin_step()), r"begin_step\(\) was called while the step begun before is still open"),
    (lambda p: p.begin_phase("forward"), r"begin_phase\('forward'\) outside a step: call prof.begin_step\(\) first"),
    (lambda p: (p.begin_step(), p.end_phase()), r"end_phase\(\) without begin_phase\(\)"),
    (lambda p: (p.begin_step(), p.begin_phase("a"), p.end_phase("b")),
     r"end_phase\('b'\), but the innermost open phase is 'a'; end 'a' first"),
    (lambda p: (p.begin_step(), p.end_step(error="oops")), r"end_step\(error=\.\.\.\) takes the exception"),
    (lambda p: (p.begin_step(), p.begin_phase(None)), r"begin_phase\(\) needs a name"),
])
def test_misuse_gets_a_clear_error(log, gpu, misuse, message):
    prof = make(log, gpu)
    with pytest.raises(stepprof.UsageError, match=message):
        misuse(prof)
    prof.close()


def test_each_thread_has_its_own_begun_step(log, gpu):
    prof = make(log, gpu)
    prof.begin_step(name="main")
    errors = []

    def other():
        try:
            prof.begin_step(name="helper")
            prof.end_step()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    prof.end_step()
    prof.close()
    assert errors == []
    assert sorted(r["name"] for r in steps(log)) == ["helper", "main"]


def test_after_close_begin_step_says_the_profiler_is_closed(log, gpu):
    prof = make(log, gpu)
    prof.close()
    with pytest.raises(stepprof.UsageError, match="this Profiler is closed"):
        prof.begin_step()
