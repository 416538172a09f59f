"""Mutated logs never crash a reader: the reproducers of issue 25, and a seeded fuzz of every tool.

Each reproducer is a log of one line (or two, for a sweep) that crashed a tool before the
sanitising pass (stepprof/_sanitise.py) read every record against the declaration; each runs
through every tool of ``tests.readerlogs.TOOLS``.  The fuzz runs bench/fuzz.py on 2,000 mutated
logs in a fresh process: no crash, no call over 30 s, peak RSS under 2 GiB, every (kind, field,
value class) combination dealt, and each plot shown every value class.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from . import fuzzlogs, readerlogs
from . import logfixtures as fx
from .fuzzlogs import Deep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _step(**changes):
    r = fx.step_record(5, warmup=False, wall=7.0, gpu=6.5)
    r.update({"run_id": "a" * 12, **changes})
    return r


def _peak(**changes):
    return {**readerlogs.peak_record(5), "run_id": "a" * 12, **changes}


def _sweep(point=None, result=None):
    p, *_, r = readerlogs.sweep_records()
    return [dict(p, **(point or {})), dict(r, **(result or {}))]


def _site(**changes):
    r = _step()
    r["syncs"]["sites"][0].update(changes)
    return r


#: issue 25's one-line logs (two lines where a site needs another record beside), each of which
#: crashed a tool at the site named.
REPRODUCERS = {
    "unhashable kind (report/read.py:211, _export.py:101)": [{"kind": ["step"]}],
    "unhashable run_id": [_step(run_id=["a"])],
    "unhashable rank": [_step(rank={"a": 1})],
    "overhead_us 1e306 (_aggregate.py:423)": [_step(overhead_us=1e306)],
    "data_wait_ms 1e303 (_aggregate.py:412)": [_step(data_wait_ms=1e303)],
    "wall_ms 1e305 (_aggregate.py:413, _export.py:62)": [_step(wall_ms=1e305, data_wait_ms=1.0)],
    "start_unix_s 1e300 (_export.py:332)": [_step(), _step(step=6, start_unix_s=1e300)],
    "start_unix_s -1e300 (_export.py:332)": [_step(), _step(step=6, start_unix_s=-1e300)],
    "bytes 1e308 (report/diagnose.py:108)": [
        _step(peak_allocated_bytes=1e308, reserved_bytes=1e308),
        {**fx.memory_record(5, "periodic"), "run_id": "a" * 12, "nvml_process_bytes": -1e308, "total_bytes": 1e308,
         "mem_get_info_used_bytes": 1e308}],
    "schema_version nested 1000 deep (report/read.py:204)": [_step(schema_version=Deep(1000, "[]"))],
    "a sync site nested 990 deep (_aggregate.py:621)": [_site(where=Deep(990, "[]"), kind=Deep(990, "{}"))],
    "error nested 500 deep (_export.py:260)": [_step(error=Deep(500, "{}"))],
    "a phase nested 990 deep (_frame.py:61)": [_step(phases={"forward": Deep(990, "{}")})],
    "a phase holding a number (_frame.py:61)": [_step(phases={"forward": 3})],
    "phases holding a number": [_step(phases=3)],
    "unknown field nested 1000 deep": [_step(future=Deep(1000, "{}"))],
    "flops record nested 800 deep (report/model.py:306)": [
        _step(), {**fx.flops_record(5), "run_id": "a" * 12, "calibration": Deep(800, "{}")}],
    "summary phases nested 600 deep": [_step(), {"kind": "summary", "run_id": "a" * 12, "phases": Deep(600, "{}")}],
    "peak modules nested 700 deep (report/model.py:306)": [_step(), _peak(modules=Deep(700, "[]"))],
    "sweep point nested 900 deep (report/build.py:92)": _sweep({"unavailable": {"a": Deep(900, "{}")}}),
    "step index past int64 (_export.py:530)": [_step(step=2**64 - 1)],
    "batch_size 2**64-1 (_frame.py:88)": [_step(batch_size=2**64 - 1)],
    "peak unavailable [1] (report/peak.py:50)": [_step(), _peak(unavailable=[1], bytes_by_category=None)],
    "peak of wrong types (_peak_plot.py:48)": [_step(), _peak(bytes_by_category={"parameters": "x", "other": [1]},
                                                              modules="m", phase=["p"], peak_at_ms="4", step="5")],
    "peak timeline of unequal lengths (_peak_plot.py:66)": [_step(), _peak(timeline_ms=[0.0, 1.0, 2.0],
                                                                           timeline_bytes=[1])],
    "peak of 1e308": [_step(), _peak(peak_at_ms=1e308, live_bytes=-1e308, timeline_ms=[1e308, -1e308],
                                     timeline_bytes=[1e308, 5])],
    "sweep of lists (_sweep/plot.py:66, 87)": _sweep({"samples_per_s": [1.0]},
                                                     {"device": "cpu", "first_oom": [128], "knee_within": [0.1]}),
    "sweep of lists (_sweep/plot.py capacity)": _sweep({"batch_size": [8]}, {"capacity_bytes": [5],
                                                                              "fit_base_bytes": [1]}),
    "sweep of batch size 0 (_sweep/plot.py: the fit's line)": _sweep({"batch_size": 0}),
    "sweep with its thrash zone backwards": _sweep(None, {"thrash_zone": [64, 8]}),
}


@pytest.mark.parametrize("name", sorted(REPRODUCERS))
def test_a_reproducer_of_issue_25_crashes_no_tool(tmp_path, name):
    pytest.importorskip("matplotlib")
    pytest.importorskip("pandas")
    log = str(tmp_path / "one.jsonl")
    with open(log, "w") as f:
        f.writelines(fuzzlogs._dumps(r) + "\n" for r in REPRODUCERS[name])
    out = tmp_path / "out"
    for tool in readerlogs.TOOLS:
        if tool == "export --tensorboard" and not _has("tensorboard"):
            continue
        out.mkdir(exist_ok=True)
        result = readerlogs.run_tool(tool, [log], str(out))  # raises on a crash
        if tool not in ("read", "frame"):  # the CLI: done, or a refusal naming the log (exit status 2)
            assert set(result if tool.startswith("plot") else [result]) <= {0, 2}, (tool, result)
        for p in out.iterdir():
            if p.is_dir():
                import shutil

                shutil.rmtree(p)


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def test_the_reproducers_fields_are_read_as_null_with_the_reason(tmp_path):
    import stepprof

    log = fx.write(str(tmp_path / "r.jsonl"), [_step(overhead_us=1e306, batch_size=2**64 - 1, phases=3)])
    (r,) = stepprof.read(log)
    assert r["overhead_us"] is None and r["batch_size"] is None and r["phases"] is None
    assert all(r["unavailable"][k].startswith("the log held an invalid value here") for k in
               ("overhead_us", "batch_size", "phases"))


def test_two_thousand_mutated_logs_crash_no_tool_in_bounded_time_and_memory(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("pandas")
    pytest.importorskip("tensorboard")
    out = tmp_path / "fuzz.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "fuzz.py"), "--cases", "2000", "--seed", "25",
         "--plot-cases", "30", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    rss_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    tools = result["tools"]
    assert set(tools) == set(readerlogs.TOOLS)
    assert all(not t["crashes"] for t in tools.values())
    assert all(t["cases"] >= (2000 if not name.startswith("plot") else 30) for name, t in tools.items())
    assert max(t["max_s"] for t in tools.values()) < 30, {n: t["max_s"] for n, t in tools.items()}
    assert result["combos_covered"] == result["combos"] == len(fuzzlogs.COMBOS)
    assert all(set(classes) == set(fuzzlogs.CLASSES) for classes in result["plot_classes"].values())
    assert rss_mib < 2048, rss_mib
