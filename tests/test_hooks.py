"""The recorder's hooks (stepprof._recorder.hooks): called only while active, and only if on."""

from __future__ import annotations

import pytest
import torch

import stepprof
from stepprof._recorder.compiles import CompileHook
from stepprof._recorder.flops import FlopsHook
from stepprof._recorder.memory_records import MemoryHook

from .conftest import make, steps


def _hook_types(hooks):
    return [type(h) for h in hooks]


def test_without_flops_or_an_exchange_no_hook_runs_at_step_entry(log, gpu):
    prof = make(log, gpu, memory_every=0)
    assert prof._flops is None and prof._exchange is None
    # The compile hook looks for torch._dynamo at the first step's entry, then retires.
    assert _hook_types(prof._boundaries.hooks.begin) == [CompileHook]
    assert _hook_types(prof._boundaries.hooks.end) == [MemoryHook]
    with prof.step():
        pass
    assert prof._boundaries.hooks.begin == ()
    # memory_every=0: the record after warm-up was the last periodic one; none is due again.
    assert prof._boundaries.hooks.end == ()
    prof.close()
    kinds = [(r["kind"], r.get("trigger")) for r in stepprof.read(log)]
    assert kinds == [("step", None), ("memory", "after_warmup"), ("memory", "close"), ("summary", None)]


def test_periodic_memory_records_keep_the_memory_hook_on_the_boundaries(log, gpu):
    prof = make(log, gpu, memory_every=2)
    for _ in range(5):
        with prof.step():
            pass
    assert _hook_types(prof._boundaries.hooks.end) == [MemoryHook]
    prof.close()
    memory = [r["step"] for r in stepprof.read(log, kind="memory") if r["trigger"] != "close"]
    assert memory == [0, 2, 4]


def test_the_flops_hook_leaves_the_boundaries_once_it_has_counted(log, gpu):
    prof = make(log, gpu, warmup=1, flops="auto")
    assert _hook_types(prof._boundaries.hooks.begin) == [FlopsHook, CompileHook]
    a = torch.ones(8, 16)
    for i in range(3):
        with prof.step():
            a @ torch.ones(16, 4)
        if i == 0:
            assert not prof._flops.retired  # warm-up: nothing counted yet
    assert prof._flops.retired
    assert prof._boundaries.hooks.begin == ()
    assert _hook_types(prof._boundaries.hooks.end) == [MemoryHook]
    prof.close()
    records = steps(log)
    assert [r["flops"] for r in records] == [None, 2 * 8 * 16 * 4, 2 * 8 * 16 * 4]
    assert [r.get("flops_counted") for r in records] == [None, True, None]


def test_given_flops_never_run_at_the_boundaries(log, gpu):
    prof = make(log, gpu, flops_per_step=1e9)
    assert prof._flops.retired and _hook_types(prof._boundaries.hooks.begin) == [CompileHook]
    with prof.step():
        gpu.launch(1.0)
    assert prof._boundaries.hooks.begin == ()
    prof.close()
    (record,) = steps(log)
    assert record["flops"] == 1e9 and record["tflops_per_s"] is not None
    assert next(stepprof.read(log, kind="flops"))["source"] == "given"


def test_a_failure_in_the_counted_step_gives_up_counting_with_the_reason(log, gpu):
    prof = make(log, gpu, flops="auto")
    gpu.fail_on = "mark"
    with pytest.warns(RuntimeWarning, match="internal error"):
        with prof.step():           # recording fails as the counted step opens
            torch.ones(2, 2) @ torch.ones(2, 2)
    gpu.fail_on = None
    assert prof._flops.retired and not prof._flops.counting
    summary = prof.close()
    why = summary.unavailable["tflops_per_s_median"]
    assert why.startswith("FLOPs were not counted: recording stopped during the counted step")
    assert "fake failure in mark" in why
