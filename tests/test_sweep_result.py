"""stepprof._sweep.result: the logged records and the table."""

from __future__ import annotations

import os
import warnings

import pytest

import stepprof

from .sweep_helpers import run, setup


# -- output: log, table, progress, plot ------------------------------------------------------------


def test_log_has_a_point_per_trial_then_the_result(log):
    gpu, step = setup(thrash_from=3000, thrash_factor=1.3)
    r = run(step, gpu, log=log)
    recs = list(stepprof.read(log))
    assert [x["kind"] for x in recs] == ["sweep_point"] * r.trials + ["sweep_result"]
    assert all(x["schema_version"] == stepprof.SCHEMA_VERSION for x in recs)
    points, result = recs[:-1], recs[-1]
    assert [x["trial"] for x in points] == list(range(1, r.trials + 1))
    first = points[0]
    assert set(first) == {
        "schema_version", "kind", "trial", "phase", "batch_size", "oom", "samples_per_s", "step_ms",
        "step_ms_p10", "step_ms_p90", "timed_steps", "warmup_steps", "peak_allocated_bytes",
        "alloc_retries", "device_allocs", "leaked_bytes", "error", "wall_s", "unavailable", "run_id",
    }
    # one id per sweep() call, on each of its records (12 hex digits)
    assert len({x["run_id"] for x in recs}) == 1 and len(first["run_id"]) == 12
    int(first["run_id"], 16)
    again = run(step, gpu, log=log)
    ids = [x["run_id"] for x in stepprof.read(log)]
    assert len(set(ids[:r.trials + 1])) == len(set(ids[r.trials + 1:])) == 1 and ids[0] != ids[-1]
    assert len(ids) == r.trials + again.trials + 2
    oom = next(x for x in points if x["oom"])
    assert oom["samples_per_s"] is None and oom["leaked_bytes"] == 0 and "out of memory" in oom["error"]
    assert result["knee"] == r.knee and result["max_fit"] == r.max_fit
    assert result["thrash_zone"] == [r.thrash_zone.start, r.thrash_zone[-1]]
    assert result["recommended"] == r.recommended and result["reason"] == r.reason
    assert result["stopped"] == "boundary" and result["predicted_max"] == r.predicted_max
    assert "points" not in result



def _disk_full_after(monkeypatch, log, lines):
    """os.write in stepprof._log writes ``lines`` whole lines to ``log``, then fails with ENOSPC."""
    import errno

    from stepprof import _log

    real_write, written = os.write, []

    def disk_fills_up(fd, data):
        if os.path.realpath(f"/proc/self/fd/{fd}") != os.path.realpath(log):
            return real_write(fd, data)
        if len(written) >= lines:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(_log.os, "write", disk_fills_up)
    return written


@pytest.mark.parametrize("lines", [3, "all points"])
def test_a_full_disk_warns_once_and_says_so_in_unavailable(log, monkeypatch, lines):
    gpu, step = setup(thrash_from=3000, thrash_factor=1.3)
    trials = run(step, gpu).trials
    gpu, step = setup(thrash_from=3000, thrash_factor=1.3)
    _disk_full_after(monkeypatch, log, trials if lines == "all points" else lines)  # the result record fails
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = run(step, gpu, log=log)
    full = [w for w in caught if issubclass(w.category, RuntimeWarning) and "No space left" in str(w.message)]
    assert len(full) == 1 and log in str(full[0].message)
    assert full[0].filename.endswith("sweep_helpers.py")  # the caller's line, not stepprof's
    assert "No space left on device" in r.unavailable["log"] and log in r.unavailable["log"]
    assert r.trials == trials  # the sweep itself went on
    recs = list(stepprof.read(log))
    assert [x["kind"] for x in recs] == ["sweep_point"] * min(trials, 3 if lines == 3 else trials)


def test_a_sweep_that_logs_fine_has_no_log_reason(log):
    gpu, step = setup(thrash_from=3000, thrash_factor=1.3)
    assert "log" not in run(step, gpu, log=log).unavailable
    assert "log" not in run(step, gpu).unavailable

def test_str_is_a_table(log):
    gpu, step = setup(thrash_from=3000, thrash_factor=1.3)
    r = run(step, gpu)
    text = str(r)
    lines = text.splitlines()
    assert lines[0].startswith("stepprof.sweep on cuda:0:") and "trials" in lines[0]
    assert "samples/s" in lines[1] and "peak alloc" in lines[1]
    rows = lines[2:2 + r.trials]
    assert [int(row.split()[0].replace(",", "")) for row in rows] == [p.batch_size for p in r.points]
    assert any(row.rstrip().endswith("recommended") for row in rows)
    assert any("OOM" in row for row in rows) and any("thrash" in row for row in rows)
    assert f"knee {r.knee:,}" in text and f"max_fit {r.max_fit:,}" in text
    assert f"recommended {r.recommended:,}: " in text
    assert str(r.point(1)) .startswith("batch 1: ")
