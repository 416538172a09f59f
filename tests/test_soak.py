"""Soak and fault tests: SIGKILL at random moments, SIGTERM and SIGINT, RSS over many steps.

Every test runs real children (tests/soak_child.py, driven by tests/soak.py); bench/soak.py
runs the same cases longer.  A failure message carries the seed of the kill moments:
``STEPPROF_SOAK_SEED=<seed>`` draws the same ones again.
"""

from __future__ import annotations

import os
import random
import signal
import warnings

import pytest

import stepprof

from . import soak

KILLS = 10
NORMAL_STEPS = 50


def test_kill_soak_loses_at_most_a_flush_interval_and_leaves_a_readable_log(tmp_path):
    """SIGKILL a training child KILLS times at random moments, all on one appended log.

    Every complete line of every run parses; a run loses at most the steps of one
    ``flush_every_s`` (every step that finished longer ago than that is in the log).
    One line is cut in half after a kill, as a kill inside a ``write()`` leaves it
    (rare by chance): ``stepprof.read`` and the report skip it and every torn line,
    and a normal run appended afterwards writes whole lines.
    """
    seed = int(os.environ.get("STEPPROF_SOAK_SEED", random.SystemRandom().randrange(2**32)))
    rng = random.Random(seed)
    log = str(tmp_path / "soak.jsonl")
    flush_s = soak.flush_every_s()
    runs, planted = [], 0
    for k in range(KILLS):
        # The first kill comes before the collector's first write (it waits 20 ms) or just
        # after it; the others anywhere in 1.5 s of training.
        delay_s = rng.uniform(0.0, 0.03) if k == 0 else rng.uniform(0.05, 1.5)
        r = soak.kill_run(log, str(tmp_path / f"side{k}"), delay_s, flush_s=flush_s)
        why = f"seed {seed}, kill {k}: {r}"
        assert r.returncode == -signal.SIGKILL, why
        assert r.log.bad_lines == (), why  # every newline-terminated line is a JSON object
        assert r.indices_in_order, why
        assert r.lost_steps >= -1, why  # the side file's line follows the step's exit
        assert r.late_steps == 0, why  # nothing older than flush_every_s is missing
        assert r.lost_steps <= r.bound_steps, why
        written = r.log
        if not planted and k >= KILLS // 2 and not written.torn and written.records:
            assert soak.tear_last_line(log)
            planted = 1
            written = soak.parse_range(log, written.start_byte, os.path.getsize(log))
        runs.append(written)
    torn = sum(rr.torn for rr in runs)
    assert planted and torn >= planted, f"seed {seed}: planted {planted}, torn {torn}"
    assert torn <= KILLS  # at most one torn line per kill, by construction of the ranges

    start = os.path.getsize(log)
    proc = soak.start_train(str(tmp_path / "side-normal"), "--steps", str(NORMAL_STEPS), log=log)
    assert proc.wait(timeout=300) == 0
    normal = soak.parse_range(log, start, os.path.getsize(log))
    assert normal.bad_lines == () and not normal.torn
    assert normal.step_indices == list(range(NORMAL_STEPS))
    assert normal.records[-1]["kind"] == "summary"

    whole = soak.parse_range(log, 0, os.path.getsize(log))
    assert len(whole.bad_lines) == torn and not whole.torn, f"seed {seed}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n = sum(1 for _ in stepprof.read(log))
    assert n == len(whole.records)
    assert [str(w.message) for w in caught] == [
        f"stepprof.read: skipped {torn} line(s) of {log!r} that are not stepprof records (not a JSON "
        f"object, torn, over 8 MiB, or without a usable kind or step index)"
    ]
    rc, report, err = soak.run_report(log)
    assert rc == 0, err
    (logrep,) = report["logs"]
    assert logrep["skipped_lines"] == torn
    steps_per_run = [len(rr.step_indices) for rr in runs if rr.step_indices] + [NORMAL_STEPS]
    assert [run["measured_steps"] for run in logrep["runs"]] == steps_per_run


#: What a loaded machine's scheduling may add to ``flush_every_s`` before a step is written.
LOADED_GRACE_S = 0.5


def test_kill_soak_under_two_cpu_hogs_loses_at_most_a_flush_interval_and_a_half_second(tmp_path):
    """The same kills, with two processes spinning on the two cores and the fastest loop
    (empty steps, two phases, the side file a memory map: the most records for a collector
    thread starved of the GIL and of CPU to write).
    Each run loses at most the steps of ``flush_every_s`` + 0.5 s: the training thread
    writes when the collector thread cannot."""
    seed = int(os.environ.get("STEPPROF_SOAK_SEED", random.SystemRandom().randrange(2**32)))
    rng = random.Random(seed)
    log = str(tmp_path / "hogs.jsonl")
    flush_s = soak.flush_every_s()
    with soak.CpuHogs(2):
        for k in range(KILLS):
            r = soak.kill_run(log, str(tmp_path / f"side{k}.mmap"), rng.uniform(0.5, 2.5), flush_s=flush_s,
                              grace_s=LOADED_GRACE_S, args=("--empty",))
            why = f"seed {seed}, kill {k}: {r}"
            assert r.returncode == -signal.SIGKILL, why
            assert r.log.bad_lines == () and r.indices_in_order, why
            assert r.late_steps == 0, why  # nothing older than flush_every_s + 0.5 s is missing
            assert -1 <= r.lost_steps <= r.bound_steps, why


class EndedByMissing(AssertionError):
    """The log's last summary has no ``ended_by`` (or there is no summary)."""


# (signal, the user's handler, --kbint-exit, the exit code without stepprof)
SIGNAL_CASES = [
    ("SIGTERM", "none", None, -signal.SIGTERM),  # the default action: dies of it
    ("SIGTERM", "exit", None, 3),  # sys.exit(3)
    ("SIGTERM", "reraise", None, -signal.SIGTERM),  # default action restored, sent again
    ("SIGTERM", "keyboard", None, -signal.SIGINT),  # raises KeyboardInterrupt, uncaught
    ("SIGINT", "none", None, -signal.SIGINT),  # KeyboardInterrupt, traceback, dies of SIGINT
    ("SIGINT", "none", 130, 130),  # KeyboardInterrupt caught, sys.exit(130)
    ("SIGINT", "exit", None, 3),
    ("SIGINT", "reraise", None, -signal.SIGINT),
]


@pytest.mark.parametrize(("sig", "handler", "kbint_exit", "expected_rc"), SIGNAL_CASES)
def test_signal_ends_the_run_with_a_summary_and_the_same_exit(tmp_path, sig, handler, kbint_exit, expected_rc):
    """A signal mid-training: the user's handler is still called, the process exits as it
    would without stepprof, and the log ends with a summary saying which signal ended it,
    after every finished step."""
    r = soak.signal_run(str(tmp_path), sig, handler, kbint_exit=kbint_exit)
    # An uncaught KeyboardInterrupt ends the process by SIGINT, or with status 1 where the
    # interpreter cannot re-raise it (seen on the H200 host): either way, as without stepprof.
    assert r.reference_returncode in ((expected_rc, 1) if expected_rc == -signal.SIGINT else (expected_rc,))
    assert r.returncode == r.reference_returncode, r.stderr[-3000:]
    assert r.reference_handler_called is (handler != "none")
    assert r.handler_called is (handler != "none"), r.stderr[-3000:]
    if r.ended_by is None:
        raise EndedByMissing(f"the summary lacks 'ended_by': {r.summary}" if r.summary else "no summary")
    assert r.ended_by == sig
    assert r.steps_logged >= r.steps_done  # every finished step was written


RSS_BOUND_BYTES = 10 * 2**20


class RssOverBound(AssertionError):
    """The profiler's RSS grew more than RSS_BOUND_BYTES."""


def test_rss_is_flat_between_100k_and_1m_steps():
    """A profiler without a log, 1M empty steps with two phases (about 25 s on 2 cores):
    its RSS at 1M steps is within 10 MiB of its RSS at 100k."""
    out = soak.rss_run((100_000, 1_000_000), phases=2)
    assert out["steps"] == [100_000, 1_000_000]
    assert out["measured_steps"] == 1_000_000
    assert out["phase_steps"] == {"phase0": 1_000_000, "phase1": 1_000_000}
    lo, hi = out["rss_bytes"]
    if hi - lo > RSS_BOUND_BYTES:
        raise RssOverBound(f"RSS grew {(hi - lo) / 2**20:.2f} MiB from 100k to 1M steps: {out}")


def test_rss_with_a_log_is_flat_between_100k_and_1m_steps():
    """The same 1M empty steps with two phases, written to a log (about 60 s on 2 cores): the
    steps waiting for the collector are bounded (``HARVEST_AT``), so RSS at 1M steps is
    within 10 MiB of RSS at 100k."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = soak.rss_run((100_000, 1_000_000), log=os.path.join(d, "rss.jsonl"), phases=2)
    assert out["measured_steps"] == 1_000_000
    lo, hi = out["rss_bytes"]
    if hi - lo > RSS_BOUND_BYTES:
        raise RssOverBound(f"RSS grew {(hi - lo) / 2**20:.2f} MiB from 100k to 1M steps with a log: {out}")
