"""The JSON-lines log: lines written whole, torn lines skipped, read() and its arguments,
and version-1 logs are sent to stepprof 0.1.x."""

from __future__ import annotations

import os
import time
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stepprof
from stepprof._log import ScanStats, scan
from stepprof._report import build_report, render

from .conftest import make






def test_log_lines_are_whole_and_flushed_while_running(log, gpu):
    prof = make(log, gpu)
    for _ in range(3):
        with prof.step():
            pass                     # device idle: each step completes at once
    with prof.step():
        pass
    deadline = time.monotonic() + 5
    while True:                      # read while the profiler is still open
        with open(log, "rb") as f:
            data = f.read()
        if data.count(b"\n") >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    # Three steps, and after the first (warmup=0) its after-warm-up memory record.
    assert data.endswith(b"\n") and data.count(b"\n") == 4
    assert data.count(b'"kind":"memory"') == 1
    prof.close()


def test_pandas_loads_a_log_as_is(log, gpu):
    pd = pytest.importorskip("pandas")
    with make(log, gpu) as prof:
        for _ in range(3):
            with prof.step(batch_size=4):
                with prof.measure("forward"):
                    gpu.launch(1.0)
    df = pd.read_json(log, lines=True)
    # The fake is a CUDA device: memory records follow the first step and precede the summary.
    assert list(df["kind"]) == ["step", "memory", "step", "step", "memory", "summary"]
    assert df.loc[df.kind == "step", "gpu_ms"].notna().all()


def test_read_skips_torn_lines_with_a_warning(log, gpu):
    with make(log, gpu) as prof:
        with prof.step():
            pass
    with open(log, "ab") as f:
        f.write(b'{"kind": "step", "step": 9, "wal')   # a crash mid-line (not by stepprof)
    with pytest.warns(RuntimeWarning, match="skipped 1 line"):
        kinds = [r["kind"] for r in stepprof.read(log)]
    assert kinds == ["step", "memory", "memory", "summary"]   # after warm-up, and at close


def test_a_run_appended_after_a_torn_last_line_loses_no_record(log, gpu):
    with open(log, "wb") as f:
        f.write(b'{"kind": "step", "step": 9, "wal')   # an earlier process died mid-line
    with make(log, gpu) as prof:
        for _ in range(2):
            with prof.step():
                pass
    with pytest.warns(RuntimeWarning, match="skipped 1 line"):
        kinds = [(r["kind"], r.get("step")) for r in stepprof.read(log)]
    assert kinds[:2] == [("step", 0), ("memory", 0)]     # the run's first line is whole
    assert [s for k, s in kinds if k == "step"] == [0, 1]


def test_a_write_cut_short_by_a_full_disk_leaves_whole_lines(tmp_path, monkeypatch):
    import errno

    from stepprof import _log

    path = tmp_path / "full.jsonl"
    writer = _log.JsonlWriter(path)
    writer.write({"kind": "step", "step": 0})
    real_write, calls = os.write, []

    def disk_fills_up(fd, data):       # as Linux does: a short write, then ENOSPC
        if fd != writer._fd:
            return real_write(fd, data)
        calls.append(len(data))
        if len(calls) == 1:
            first = bytes(data).index(b"\n") + 1
            return real_write(fd, bytes(data)[: first + 10])   # line 1 whole, 10 bytes of line 2
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(_log.os, "write", disk_fills_up)
        writer.write_many([{"kind": "step", "step": 1}, {"kind": "step", "step": 2}])
    assert writer.failed is not None and "No space left" in writer.failed
    data = path.read_bytes()
    assert data.endswith(b"\n")                        # no half line
    assert [r["step"] for r in stepprof.read(path)] == [0, 1]   # and nothing whole is lost


def test_failed_log_write_warns_and_training_goes_on(gpu):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    prof = make("/dev/full", gpu)
    with pytest.warns(RuntimeWarning, match="logging stopped"):
        for _ in range(3):
            with prof.step():
                pass
        s = prof.close()
    assert s.steps == 3 and "failed" in s.unavailable["log"]


def test_read_checks_its_arguments_at_the_call(tmp_path):
    with pytest.raises(stepprof.ConfigError, match=r"'path' must be the path of a stepprof log.*got None"):
        stepprof.read(None)
    with pytest.raises(stepprof.ConfigError, match=r"'kind' must be a record kind.*got \['step'\]"):
        stepprof.read(tmp_path / "x.jsonl", kind=["step"])


def test_read_warns_about_a_kind_stepprof_never_writes(tmp_path):
    log = tmp_path / "run.jsonl"
    with stepprof.Profiler(log, device="cpu") as prof:
        with prof.step():
            pass
    with pytest.warns(RuntimeWarning, match=r"no record of kind 'steps'.*of kind 'step', 'summary'"):
        assert list(stepprof.read(log, kind="steps")) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # a kind stepprof writes, absent here: no warning
        assert list(stepprof.read(log, kind="ranks")) == []
        assert len(list(stepprof.read(log, kind="step"))) == 1


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=40),
            st.from_regex(
                rb'\{"kind": "(step|memory|summary|flops|sweep_point)"[^\n]{0,30}\}', fullmatch=True
            ),
        ),
        max_size=30,
    )
)
def test_reader_never_raises_on_any_bytes(tmp_path, lines):
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in lines))
    stats = ScanStats()
    records = list(scan(path, stats))
    assert all(isinstance(r, dict) for r in records)
    assert len(records) + stats.skipped <= stats.lines
    build_report([str(path)])  # never raises either


#: A version-1 log as stepprof 0.1 wrote it on the CPU (two steps, one warm-up).
V1_LOG = b"""\
{"schema_version":1,"kind":"step","step":0,"name":"step","warmup":true,"device":"cpu","start_unix_s":1796029798.0,"wall_ms":2.5,"gpu_ms":null,"gpu_busy":null,"peak_allocated_bytes":null,"reserved_bytes":null,"batch_size":8,"samples_per_s":3200.0,"phases":{},"overhead_us":40.0,"error":null,"syncs":null,"allocator":null,"unavailable":{"gpu_ms":"CUDA is not available","gpu_busy":"CUDA is not available"},"host_rss_bytes":329146368}
{"schema_version":1,"kind":"step","step":1,"name":"step","warmup":false,"device":"cpu","start_unix_s":1796029798.1,"wall_ms":2.0,"gpu_ms":null,"gpu_busy":null,"peak_allocated_bytes":null,"reserved_bytes":null,"batch_size":8,"samples_per_s":4000.0,"phases":{},"overhead_us":30.0,"error":null,"syncs":null,"allocator":null,"unavailable":{"gpu_ms":"CUDA is not available","gpu_busy":"CUDA is not available"},"host_rss_bytes":329146368}
{"schema_version":1,"kind":"summary","steps":2,"warmup_steps":1,"error_steps":0,"measured_steps":1,"device":"cpu","wall_ms":{"median":2.0,"p10":2.0,"p90":2.0},"gpu_ms":null,"gpu_busy_median":null,"peak_allocated_bytes_max":null,"samples_per_s_median":4000.0,"overhead_us_median":30.0,"log":"run.jsonl","syncs_per_step_median":null,"sync_mechanism":null,"tflops_per_s_median":null,"mfu_median":null,"unavailable":{"gpu_ms":"CUDA is not available","gpu_busy_median":"CUDA is not available"}}
"""


def test_a_version_1_log_reads_as_written_and_the_report_sends_it_to_0_1(tmp_path):
    """0.1.0 logs need 0.1.x to read (CHANGELOG): its steps read, its summary comes as it was
    written (no renaming), and the report says where to read it."""
    log = tmp_path / "v1.jsonl"
    log.write_bytes(V1_LOG)
    steps = list(stepprof.read(log, kind="step"))
    assert [r["wall_ms"] for r in steps] == [2.5, 2.0]           # steps are the same in v1 and v2
    (summary,) = stepprof.read(log, kind="summary")
    assert summary["schema_version"] == 1 and "wall_ms_percentiles" not in summary
    report = build_report([str(log)])
    assert report.logs[0].schema_versions == (1,)
    text = render(report)
    assert "written by stepprof 0.1.0 (schema 1)" in text and "stepprof<0.2" in text


def test_a_full_log_disk_under_warnings_as_errors_trains_every_step(gpu, capfd):
    """An error filter (``-W error``, pytest's ``filterwarnings = error``) does not turn
    stepprof's "logging stopped" into the loop's exception: every step runs, and the
    message goes to stderr."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    prof = make("/dev/full", gpu)
    ran = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(50):
            with prof.step():
                ran += 1
        s = prof.close()
    assert ran == 50 and s.steps == 50 and "failed" in s.unavailable["log"]
    err = capfd.readouterr().err
    assert "StepprofWarning: stepprof: writing '/dev/full' failed" in err and "not raised" in err


def test_a_full_log_disk_under_dash_w_error_in_a_fresh_process(tmp_path):
    """The same as a user runs it: ``python -W error``, on the CPU, a plain loop."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    import subprocess
    import sys

    script = (
        "import stepprof\n"
        "with stepprof.Profiler('/dev/full', device='cpu', flush_every_s=0.01) as prof:\n"
        "    for i in range(300):\n"
        "        with prof.step(batch_size=1):\n"
        "            sum(range(1000))\n"
        "print('steps', prof.summary.steps)\n"
    )
    out = subprocess.run([sys.executable, "-W", "error", "-c", script], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "steps 300" in out.stdout
    assert "StepprofWarning" in out.stderr


def test_stepprof_warnings_can_be_filtered_by_class(gpu):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    prof = make("/dev/full", gpu)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=stepprof.StepprofWarning)
        for _ in range(3):
            with prof.step():
                pass
        prof.close()
    assert not [w for w in seen if issubclass(w.category, stepprof.StepprofWarning)]


def test_read_of_one_kind_finds_it_however_the_line_spells_it(tmp_path):
    log = tmp_path / "k.jsonl"
    log.write_bytes(b'{"kind": "summary", "steps": 1}\n{"kind":"\\u0073ummary","steps":2}\n'
                    b'{"kind":"step","step":0,"wall_ms":1.0}\n')
    assert [r["steps"] for r in stepprof.read(str(log), kind="summary")] == [1, 2]
    assert [r["kind"] for r in stepprof.read(str(log))] == ["summary", "summary", "step"]
