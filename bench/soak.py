"""The soak: SIGKILL, SIGTERM and SIGINT at random moments, and the profiler's RSS over 1M steps.

tests/test_soak.py runs the same cases, shorter; both drive tests/soak_child.py (a real CPU
``Profiler`` around a small torch step) through tests/soak.py.

  kill     one appended log; a child SIGKILLed ``--kills`` times, 0-1.5 s after its first
           step.  A run fails if a complete line of it is not a JSON object, its step indices
           are not 0..n-1, it lost more finished steps than its rate x ``flush_every_s`` + 2,
           or a step that finished more than ``flush_every_s`` before the kill is missing.
           Then a normal run is appended; ``after kills`` fails unless its lines are whole,
           ``stepprof.read`` and ``stepprof report`` skip exactly the torn lines, and the
           report exits 0.
  kill, 2 hogs
           ``--hog-kills`` runs, the same, with two processes spinning on the CPUs and the
           fastest loop (empty steps with two phases, a memory-mapped side file): a collector
           thread starved of the GIL and of CPU.  Bound: ``flush_every_s`` + 0.5 s.
  sigterm, sigint
           ``--signals`` runs each, 0.1-1 s after the first step, cycling through the user's
           handlers (none, sys.exit(3), re-raise, KeyboardInterrupt; for SIGINT also a
           KeyboardInterrupt caught with exit 130).  A run fails unless the exit code is the
           same child's without stepprof, the user's handler was called, the summary's
           ``ended_by`` names the signal and every finished step is logged.  A stepprof whose
           summary has no ``ended_by`` is reported "skipped: not supported".
  rss      ``Profiler(None, device="cpu")``, empty steps with two phases: RSS growth between
           the two ``--rss-steps`` counts (bound 10 MiB); "rss, log" the same with a log file.

    python bench/soak.py [--kills 50] [--hog-kills 10] [--signals 20] [--rss-steps 100000,1000000]
                         [--seed N] [--quick] [--json PATH]

``--quick`` (3 kills, 2 signals each, RSS at 10k and 100k steps) takes about 25 s on 2
cores; the full run about 3 minutes, and 2 more once every signal run is judged.
Exit status 1 when a case has a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when a test imports this file
import stepprof  # noqa: E402
from _common import run_info  # noqa: E402
from tests import soak  # noqa: E402

RSS_BOUND_BYTES = 10 * 2**20
SIGNAL_VARIANTS = {
    "SIGTERM": [("none", None), ("exit", None), ("reraise", None), ("keyboard", None)],
    "SIGINT": [("none", None), ("exit", None), ("reraise", None), ("none", 130)],
}


def case(runs: int, failures: int, bound: str, worst: str, details: list, skipped: str | None = None) -> dict:
    return {"runs": runs, "failures": failures, "bound": bound, "worst": worst, "skipped": skipped,
            "details": details}


def kills(log: str, tmp: str, n: int, rng: random.Random, *, hogs: int = 0) -> tuple[dict, list]:
    """``n`` SIGKILLed runs on ``log``; with ``hogs``, under that many spinning processes,
    empty steps and a memory-mapped side file (a starved collector thread), and
    ``flush_every_s`` + 0.5 s allowed."""
    flush_s = soak.flush_every_s()
    grace_s = 0.5 if hogs else 0.0
    details, ranges = [], []
    with soak.CpuHogs(hogs):
        for k in range(n):
            if hogs:
                r = soak.kill_run(log, os.path.join(tmp, f"hogs{k}.mmap"), rng.uniform(0.5, 2.5), flush_s=flush_s,
                                  grace_s=grace_s, args=("--empty",))
            else:
                r = soak.kill_run(log, os.path.join(tmp, f"kill{k}.side"), rng.uniform(0.0, 1.5), flush_s=flush_s)
            ranges.append(r.log)
        details.append({
            "ok": r.ok, "returncode": r.returncode, "killed_after_s": round(r.killed_after_s, 3),
            "steps_done": r.steps_done, "steps_logged": r.steps_logged, "lost_steps": r.lost_steps,
            "rate_steps_per_s": r.rate_steps_per_s and round(r.rate_steps_per_s, 1),
            "bound_steps": round(r.bound_steps, 1), "late_steps": r.late_steps,
            "bad_lines": len(r.log.bad_lines), "torn": r.log.torn,
        })
    worst = max(details, key=lambda d: d["lost_steps"] / d["bound_steps"]) if details else None
    return case(
        n, sum(not d["ok"] for d in details), f"lost <= rate x {flush_s + grace_s:g} s + {soak.SLACK_STEPS} steps",
        f"lost {worst['lost_steps']} of bound {worst['bound_steps']:.0f} steps; "
        f"late {max(d['late_steps'] for d in details)}; torn {sum(d['torn'] for d in details)}"
        if worst else "-", details), ranges


def kill_case(tmp: str, n: int, rng: random.Random) -> tuple[dict, dict]:
    """The kill case and the 'after kills' check of the same log."""
    log = os.path.join(tmp, "kill.jsonl")
    kill, ranges = kills(log, tmp, n, rng)
    torn = sum(r.torn for r in ranges)
    start = os.path.getsize(log) if os.path.exists(log) else 0
    proc = soak.start_train(os.path.join(tmp, "normal.side"), "--steps", "50", log=log)
    rc = proc.wait(timeout=300)
    normal = soak.parse_range(log, start, os.path.getsize(log))
    whole = soak.parse_range(log, 0, os.path.getsize(log))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        read_n = sum(1 for _ in stepprof.read(log))
    skipped_by_read = sum(1 for w in caught if "skipped" in str(w.message))
    report_rc, report, _ = soak.run_report(log)
    report_skipped = report["logs"][0]["skipped_lines"] if report else None
    after = {
        "normal_run_rc": rc, "normal_run_whole": not normal.bad_lines and not normal.torn
        and normal.step_indices == list(range(50)) and normal.records[-1].get("kind") == "summary",
        "torn_lines": torn, "bad_lines_in_log": len(whole.bad_lines), "read_records": read_n,
        "read_warned": skipped_by_read == (1 if torn else 0), "report_rc": report_rc,
        "report_skipped_lines": report_skipped,
    }
    ok = (rc == 0 and after["normal_run_whole"] and len(whole.bad_lines) == torn and read_n == len(whole.records)
          and after["read_warned"] and report_rc == 0 and report_skipped == torn)
    return kill, case(1, int(not ok), "whole lines; torn lines skipped; report exits 0",
                      f"report rc {report_rc}, skipped {report_skipped} of {torn} torn", [after])


def signal_case(tmp: str, sig: str, n: int, rng: random.Random) -> dict:
    details: list[dict[str, Any]] = []
    bound = "same exit code, handler called, ended_by, no step lost"
    for k in range(n):
        handler, kbint = SIGNAL_VARIANTS[sig][k % len(SIGNAL_VARIANTS[sig])]
        r = soak.signal_run(tmp, sig, handler, kbint_exit=kbint, delay_s=rng.uniform(0.1, 1.0), tag=f"-{k}")
        d = {
            "handler": handler, "kbint_exit": kbint, "returncode": r.returncode,
            "reference_returncode": r.reference_returncode,
            "handler_called": r.handler_called, "handler_expected": handler != "none",
            "ended_by": r.ended_by, "steps_done": r.steps_done, "steps_logged": r.steps_logged,
        }
        d["ok"] = (r.returncode is not None and r.returncode == r.reference_returncode
                   and r.handler_called is (handler != "none") and r.ended_by == sig
                   and r.steps_logged >= r.steps_done)
        details.append(d)
        if r.ended_by is None:
            same = "the same" if d["returncode"] == d["reference_returncode"] else "a different"
            return case(len(details), 0, bound, "-", details,
                        skipped=f"not supported (the summary has no 'ended_by'; {same} exit code)")
    lost = max(d["steps_done"] - d["steps_logged"] for d in details)
    mismatched = sum(d["returncode"] != d["reference_returncode"] for d in details)
    return case(n, sum(not d["ok"] for d in details), bound,
                f"exit mismatches {mismatched}; steps lost {max(lost, 0)}", details)


def rss_case(at: tuple[int, int], log: str | None) -> dict:
    out = soak.rss_run(at, log=log)
    growth = out["rss_bytes"][-1] - out["rss_bytes"][0]
    details = [{**out, "growth_bytes": growth}]
    return case(1, int(growth > RSS_BOUND_BYTES), f"growth <= {RSS_BOUND_BYTES / 2**20:g} MiB",
                f"{growth / 2**20:+.2f} MiB ({at[0]:,} to {at[1]:,} steps: "
                f"{out['elapsed_s'][-1]:.1f} s)", details)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=None, help="SIGKILLed runs (default 50; --quick 3)")
    ap.add_argument("--signals", type=int, default=None, help="runs per signal (default 20; --quick 2)")
    ap.add_argument("--hog-kills", type=int, default=None,
                    help="SIGKILLed runs under two CPU hogs (default 10; --quick 2)")
    ap.add_argument("--rss-steps", default=None, help="the two step counts (default 100000,1000000)")
    ap.add_argument("--no-rss-log", action="store_true", help="skip the RSS case with a log")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer runs, fewer steps")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results here (bench/results/...)")
    args = ap.parse_args(argv)
    n_kills = args.kills if args.kills is not None else (3 if args.quick else 50)
    n_hog_kills = args.hog_kills if args.hog_kills is not None else (2 if args.quick else 10)
    nsig = args.signals if args.signals is not None else (2 if args.quick else 20)
    at = tuple(int(x) for x in (args.rss_steps or ("10000,100000" if args.quick else "100000,1000000")).split(","))
    if len(at) != 2 or not 0 < at[0] < at[1]:
        ap.error(f"--rss-steps must be two step counts, the first smaller (got {args.rss_steps!r})")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    cases: dict[str, dict] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="stepprof-soak-") as tmp:
        if n_kills:
            cases["kill"], cases["after kills"] = kill_case(tmp, n_kills, rng)
        if n_hog_kills:
            cases["kill, 2 hogs"] = kills(os.path.join(tmp, "hogs.jsonl"), tmp, n_hog_kills, rng, hogs=2)[0]
        for sig in ("SIGTERM", "SIGINT"):
            if nsig:
                cases[sig.lower()] = signal_case(tmp, sig, nsig, rng)
        cases["rss"] = rss_case(at, None)
        if not args.no_rss_log:
            cases["rss, log"] = rss_case(at, os.path.join(tmp, "rss.jsonl"))
    elapsed = time.perf_counter() - t0
    print(f"flush_every_s {soak.flush_every_s():g} s, seed {seed}, {elapsed:.0f} s")
    print(f"{'case':12s} {'runs':>5s} {'failures':>8s}  {'bound':56s} worst observed")
    for name, c in cases.items():
        worst = f"skipped: {c['skipped']}" if c["skipped"] else c["worst"]
        print(f"{name:12s} {c['runs']:5d} {c['failures']:8d}  {c['bound']:56s} {worst}")
    if args.json:
        result = {**run_info("soak.py", gpu="none (CPU children)"), "seed": seed,
                  "flush_every_s": soak.flush_every_s(), "elapsed_s": elapsed, "cases": cases}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if any(c["failures"] for c in cases.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
