"""The readers' bounds: a line's size, its values, blank lines, and the memory of a hostile line.

bench/readers.py measures the same at full size (a 94 MiB line, 20M blank lines, 20,000 steps
that never nest, 100,000 runs, 20,000 steps x 50 phase names) and prints a table.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import stepprof
from stepprof._log import LINE_MAX_BYTES, VALUES_MAX, ScanStats, scan

from . import logfixtures as fx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20

#: Runs a reader tool in a fresh process and prints its peak RSS in KiB, imports included: the
#: process's VmHWM (ru_maxrss would count the memory of the process it was forked from), plus,
#: for a log that the report reads in parallel, each worker's peak (a bound on their sum).
_PEAK = """
import os, resource, sys, warnings
warnings.simplefilter("ignore")
tool, path = sys.argv[1], sys.argv[2]
workers = 0
if tool == "read":
    import stepprof
    n = sum(1 for _ in stepprof.read(path))
else:
    from stepprof._cli import main
    from stepprof._report.read import PARALLEL_BYTES
    import contextlib, io
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["report", "--json", path]) == 0
    workers = min(16, os.cpu_count() or 1) if os.path.getsize(path) >= PARALLEL_BYTES else 0
own = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
print(own + workers * resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def peak_rss_mib(tool: str, path: str) -> float:
    out = subprocess.run([sys.executable, "-c", _PEAK, tool, path], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    return int(out.split()[-1]) / 1024


def one_line_array(path: str, mib: int = 94) -> str:
    """A one-line JSON array of ``mib`` MiB of empty objects (then a record, which is read)."""
    with open(path, "wb") as f:
        f.write(b"[")
        block = b"{}," * (MiB // 3 + 1)
        for _ in range(mib):
            f.write(block)
        f.write(b"{}]\n")
        f.write(b'{"kind":"step","step":0,"wall_ms":1.0}\n')
    return path


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc (Linux)")
@pytest.mark.parametrize("tool", ["read", "report"])
def test_a_94_mib_one_line_array_stays_under_200_mb_of_rss(tmp_path, tool):
    path = one_line_array(str(tmp_path / "array.jsonl"))
    assert os.path.getsize(path) > 94 * MiB
    assert peak_rss_mib(tool, path) < 200


def test_a_line_over_the_cap_is_skipped_unread_and_counted(tmp_path):
    filler = "x" * (LINE_MAX_BYTES - 100)
    just_under = ('{"kind":"step","step":0,"wall_ms":1.0,"note":"%s"}\n' % filler[:LINE_MAX_BYTES - 200]).encode()
    over = ('{"kind":"step","step":1,"wall_ms":1.0,"note":"%s"}\n' % (filler * 2)).encode()
    log = tmp_path / "long.jsonl"
    log.write_bytes(just_under + over + b'{"kind":"step","step":2,"wall_ms":1.0}\n')
    stats = ScanStats()
    assert [r["step"] for r in scan(str(log), stats)] == [0, 2]
    assert (stats.lines, stats.skipped) == (3, 1)
    assert [r["step"] for r in scan(str(log), ScanStats(), start=len(just_under) + 10)] == [2]  # a range cut inside it


def test_a_long_line_of_too_many_values_is_skipped_before_it_is_parsed(tmp_path):
    log = tmp_path / "values.jsonl"
    log.write_bytes(b'{"kind":"step","step":0,"wall_ms":1.0,"x":[' + b"0," * VALUES_MAX + b"0]}\n")
    stats = ScanStats()
    assert list(scan(str(log), stats)) == [] and stats.skipped == 1


def test_a_line_that_does_not_begin_with_a_brace_is_never_parsed(tmp_path, monkeypatch):
    import orjson

    parsed = []
    loads = orjson.loads
    monkeypatch.setattr(orjson, "loads", lambda b: parsed.append(b) or loads(b))
    log = tmp_path / "mixed.jsonl"
    log.write_bytes(b'[1, 2]\n3\n"x"\n  {"kind": "step", "step": 0}\n\n \r\n')
    stats = ScanStats()
    assert [r["step"] for r in scan(str(log), stats)] == [0]
    assert (stats.lines, stats.skipped) == (6, 3) and len(parsed) == 1


def test_blank_lines_cost_about_what_reading_them_costs(tmp_path):
    with open(fx.write(str(tmp_path / "one.jsonl"), fx.training_log(steps=5)), "rb") as f:
        records_text = f.read()
    log = tmp_path / "blank.jsonl"
    log.write_bytes(b"\n" * 2_000_000 + records_text)
    t0 = time.process_time()
    records = list(stepprof.read(str(log)))
    took = time.process_time() - t0
    assert len(records) == len(fx.training_log(steps=5)) and took < 3.0, took  # was about 4 s
