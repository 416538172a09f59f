"""The bench scripts' own method, on the CPU: what each round charges to which variant."""

from __future__ import annotations

import importlib
import os
import time

import pytest
import torch

import stepprof

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.fixture
def overhead(monkeypatch):
    """bench/overhead.py, with its workload on the CPU and no CUDA synchronisation."""
    monkeypatch.syspath_prepend(BENCH)
    mod = importlib.import_module("overhead")
    make = mod.make_workload
    monkeypatch.setattr(mod, "make_workload",
                        lambda width, batch: make(16, 4, depth=2, device="cpu", dtype=torch.float32))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return mod


def test_overhead_leaves_no_records_for_the_next_round(overhead, monkeypatch, tmp_path):
    """A stepprof variant's records are written in its own round, never in another's.

    The collector here never wakes by itself (as if every round ended just before it
    would): whatever a variant's round leaves pending is written later, while some other
    variant is being timed.  At every step after the warm-up (which ends with the first
    synchronisation), no other variant's profiler may have work pending.
    """
    made = []
    timing = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: timing.append(True))

    class Profiler(stepprof.Profiler):
        def __init__(self, *a, **kw):
            kw.setdefault("_collect_every_s", 3600.0)
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(stepprof, "Profiler", Profiler)
    make = overhead.make_workload
    leftovers = []

    def workload(width, batch):
        fwd, bwd, opt = make(width, batch)

        def checked_fwd():
            if timing:
                leftovers.extend(os.path.basename(p.log) for p in made if p._step is None and p._pending)
            fwd()

        return checked_fwd, bwd, opt

    monkeypatch.setattr(overhead, "make_workload", workload)
    overhead.run("cpu", 16, 4, rounds=3, k=4, tmp=str(tmp_path), profiler=False)
    assert len(made) == 3
    assert leftovers == []


def test_overhead_post_processing_counts_the_profilers_exit(overhead, monkeypatch, tmp_path):
    """torch.profiler's post-processing is its exit (the trace stopped and collected) plus
    ``key_averages()``: the docs report it as the trace's processing at exit."""

    class FakeProfile:
        def __init__(self, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            time.sleep(0.05)  # stopping the trace

        def key_averages(self):
            return []

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    out = overhead.run("cpu", 16, 4, rounds=2, k=2, tmp=str(tmp_path), profiler=True)
    assert out["profiler_postprocess_s_median"] >= 0.05
