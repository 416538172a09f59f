"""The reader tools on logs shaped to break them: time and peak memory, each in a fresh process.

Cases (issue 25): a 94 MiB one-line JSON array of empty objects (``read``, ``report``); 20M blank
lines; 20,000 steps that never nest (without phases, then with three timed on the GPU: eight
slices a step), 100,000 runs of one step, and 200,000 thread names
(``export --chrome``); 1,000 runs (``export --tensorboard``, which writes the last 100); 20,000
steps that each bring 50 new phase names (``frame``).  Each tool runs in a child process that
reports its wall time and peak RSS (its VmHWM, plus each report worker's peak for a log read in
parallel), with a timeout per case.

    python bench/readers.py [--quick] [--timeout 300] [--root DIR] [--out bench/results/readers.json]

``--root`` imports stepprof from another checkout (to measure a version before these bounds);
``--quick`` runs each case at a tenth of its size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests import readerlogs  # noqa: E402
from tests.test_reader_bounds import one_line_array  # noqa: E402

#: The child: run one tool on one log, print {"s": wall seconds, "rss_kib": peak}.
_CHILD = """
import contextlib, io, json, os, resource, sys, time, warnings
warnings.simplefilter("ignore")
tool, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
workers = 0
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    if tool == "read":
        import stepprof
        sum(1 for _ in stepprof.read(path))
    elif tool == "frame":
        import stepprof
        stepprof.frame(path)
    else:
        from stepprof._cli import main
        args = {"report": ["report", "--json"], "chrome": ["export", "--chrome", out],
                "tensorboard": ["export", "--tensorboard", out]}[tool]
        assert main([*args, path]) == 0
        if tool == "report":
            from stepprof._report.read import PARALLEL_BYTES
            workers = min(16, os.cpu_count() or 1) if os.path.getsize(path) >= PARALLEL_BYTES else 0
took = time.perf_counter() - t0
own = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
print(json.dumps({"s": took, "rss_kib": own + workers * resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""


def _blank(path: str, n: int) -> str:
    with open(path, "wb") as f:
        block = b"\n" * 1_000_000
        for _ in range(n // 1_000_000):
            f.write(block)
        f.write(b'{"kind":"step","step":0,"wall_ms":1.0}\n')
    return path


def cases(scale: float) -> list[tuple[str, str, object]]:
    n = lambda k: max(10, int(k * scale))  # noqa: E731
    mib = max(9, int(94 * scale))
    return [
        (f"{mib} MiB one-line array", "read", lambda p: one_line_array(p, mib=mib)),
        (f"{mib} MiB one-line array", "report", lambda p: one_line_array(p, mib=mib)),
        (f"{n(20_000_000):,} blank lines", "read", lambda p: _blank(p, n(20_000_000))),
        (f"{n(20_000_000):,} blank lines", "report", lambda p: _blank(p, n(20_000_000))),
        (f"{n(20_000):,} steps that never nest", "chrome",
         lambda p: readerlogs.write_lines(p, readerlogs.overlapping_steps(n(20_000), phases=False))),
        (f"{n(20_000):,} such steps, 3 GPU phases each", "chrome",
         lambda p: readerlogs.write_lines(p, readerlogs.overlapping_steps(n(20_000)))),
        (f"{n(100_000):,} runs", "chrome", lambda p: readerlogs.write_lines(p, readerlogs.distinct_runs(n(100_000)))),
        (f"{n(200_000):,} thread names", "chrome",
         lambda p: readerlogs.write_lines(p, readerlogs.distinct_threads(n(200_000)))),
        (f"{n(1_000):,} runs", "tensorboard", lambda p: readerlogs.write_lines(p, readerlogs.distinct_runs(n(1_000)))),
        (f"{n(20_000):,} steps x 50 phase names", "frame",
         lambda p: readerlogs.write_lines(p, readerlogs.changing_phases(n(20_000), 50))),
    ]


def run(root: str, tool: str, path: str, out: str, timeout: float) -> dict:
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, tool, path, out], cwd=root, capture_output=True,
                              text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": root})
    except subprocess.TimeoutExpired:
        return {"s": None, "rss_mib": None, "note": f"still running at {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"s": None, "rss_mib": None, "note": proc.stderr.strip().splitlines()[-1][:120]}
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"s": got["s"], "rss_mib": got["rss_kib"] / 1024, "note": ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--root", default=ROOT, help="the checkout whose stepprof the children import")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        made: dict[str, str] = {}
        for name, tool, make in cases(0.1 if args.quick else 1.0):
            path = made.get(name)
            if path is None:
                for old in made.values():
                    os.unlink(old)
                made = {name: make(os.path.join(tmp, "log.jsonl"))}  # type: ignore[operator]
                path = made[name]
            out = os.path.join(tmp, f"out-{len(rows)}")
            t0 = time.perf_counter()
            res = run(args.root, tool, path, out, args.timeout)
            res.update(case=name, tool=tool, log_mib=os.path.getsize(path) / 2**20, wall_s=time.perf_counter() - t0)
            rows.append(res)
            print(f"{name:<34} {tool:<12} {res['log_mib']:>8.1f} MiB  "
                  + (f"{res['s']:>8.2f} s  {res['rss_mib']:>7.0f} MiB RSS" if res["s"] is not None else res["note"]),
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bench": "readers", "root": args.root, "python": platform.python_version(),
                       "cpus": os.cpu_count(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
