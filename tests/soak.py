"""The soak harness that tests/test_soak.py and bench/soak.py share.

It runs tests/soak_child.py in subprocesses and checks what they leave behind:

- :func:`kill_run`: a child training on an appended log, SIGKILLed at a random moment;
  how many finished steps the log lacks, against what ``flush_every_s`` allows;
- :func:`signal_run`: a child sent SIGTERM or SIGINT, beside the same child without
  stepprof (the reference exit code);
- :func:`rss_run`: a profiler's RSS at two step counts.

The children import stepprof from this checkout (``PYTHONPATH``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = os.path.join(ROOT, "tests", "soak_child.py")

#: Steps a killed run may lose beyond ``rate x flush_every_s``: one because a window of
#: ``flush_every_s`` seconds holds up to ``rate x flush_every_s + 1`` step exits (its two
#: edges), one because the rate is the run's median and its last second may run a step
#: ahead of it.  :attr:`KillResult.late_steps` checks the same promise without a rate.
SLACK_STEPS = 2


def flush_every_s() -> float:
    """How far behind the training thread the log may be: ``Profiler``'s ``flush_every_s``
    default, or 1.0 s where the Profiler has no such option."""
    import inspect

    import stepprof

    p = inspect.signature(stepprof.Profiler).parameters.get("flush_every_s")
    d = p.default if p is not None else None
    return float(d) if isinstance(d, (int, float)) and not isinstance(d, bool) else 1.0


def child_env() -> dict[str, str]:
    """The environment of a child: this checkout's stepprof first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def start_train(side: str, *args: str, log: str | None = None, stderr: Any = subprocess.DEVNULL) -> subprocess.Popen:
    """Start a ``soak_child.py train`` child writing finished steps to ``side``."""
    cmd = [sys.executable, CHILD, "train", "--side", side, *args]
    if log is not None:
        cmd += ["--log", log]
    return subprocess.Popen(cmd, env=child_env(), stdout=subprocess.DEVNULL, stderr=stderr)


def read_side(side: str) -> tuple[list[tuple[int, float]], list[str]]:
    """The side file: ``(index, unix time)`` of each finished step, and the signals the user's handler saw."""
    steps: list[tuple[int, float]] = []
    signals: list[str] = []
    try:
        with open(side, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return steps, signals
    if side.endswith(".mmap"):  # (index + 1, unix ns) pairs; zeros past the last step
        import struct

        for idx1, ns in struct.iter_unpack("<qq", data[: len(data) // 16 * 16]):
            if idx1 == 0:
                break
            steps.append((idx1 - 1, ns / 1e9))
        return steps, signals
    for line in data.split(b"\n"):
        parts = line.split()
        if len(parts) == 3 and parts[0] == b"step":
            steps.append((int(parts[1]), float(parts[2])))
        elif len(parts) >= 2 and parts[0] == b"signal":
            signals.append(parts[1].decode())
    return steps, signals


def wait_for_steps(proc: subprocess.Popen, side: str, n: int = 1, timeout_s: float = 120.0) -> None:
    """Wait until the child has finished ``n`` steps; raise if it exits or takes too long."""
    deadline = time.monotonic() + timeout_s
    while True:
        if len(read_side(side)[0]) >= n:
            return
        if proc.poll() is not None:
            raise RuntimeError(f"the child exited with {proc.returncode} before step {n}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the child did not finish {n} step(s) in {timeout_s} s")
        time.sleep(0.01)


@dataclasses.dataclass(frozen=True)
class LogRange:
    """One run's bytes of an appended log, parsed line by line."""

    start_byte: int
    end_byte: int
    records: tuple[dict[str, Any], ...]  # the newline-terminated lines that are JSON objects
    bad_lines: tuple[bytes, ...]  # newline-terminated, not blank, not a JSON object
    torn: bool  # the range ends with a fragment (no newline): a line cut by the kill

    @property
    def step_indices(self) -> list[int]:
        return [r["step"] for r in self.records if r.get("kind") == "step"]


def parse_range(log: str, start: int, end: int) -> LogRange:
    """Parse the bytes ``[start, end)`` of ``log`` (one run's, when the log is appended to)."""
    with open(log, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    *complete, fragment = data.split(b"\n")
    records, bad = [], []
    for line in complete:
        if not line.strip():
            continue  # the newline that ends an earlier run's torn line
        try:
            r = json.loads(line)
        except ValueError:
            r = None
        (records if isinstance(r, dict) else bad).append(r if isinstance(r, dict) else line)
    return LogRange(start, end, tuple(records), tuple(bad), bool(fragment))


@dataclasses.dataclass(frozen=True)
class KillResult:
    """One SIGKILLed run of an appended log, and what it lost."""

    returncode: int
    killed_after_s: float  # from its first finished step to the kill
    steps_done: int  # steps that finished (the side file; its line follows the exit, so the
    # log may hold one step more when the kill falls between the two)
    steps_logged: int  # its step records in the log (indices 0 .. steps_logged - 1)
    indices_in_order: bool  # the logged indices are exactly 0 .. steps_logged - 1
    rate_steps_per_s: float | None  # the median rate of its logged steps (else its finished ones)
    bound_steps: float  # rate x flush_every_s + SLACK_STEPS
    late_steps: int  # steps that finished more than flush_every_s before the kill, not logged
    log: LogRange

    @property
    def lost_steps(self) -> int:
        return self.steps_done - self.steps_logged

    @property
    def ok(self) -> bool:
        return (self.returncode == -signal.SIGKILL and self.indices_in_order and not self.log.bad_lines
                and -1 <= self.lost_steps <= self.bound_steps and self.late_steps == 0)


def _median_rate(times: list[float]) -> float | None:
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    if not gaps:
        return None
    mid = gaps[len(gaps) // 2] if len(gaps) % 2 else (gaps[len(gaps) // 2 - 1] + gaps[len(gaps) // 2]) / 2
    return 1.0 / mid if mid > 0 else None


def kill_run(log: str, side: str, delay_s: float, *, flush_s: float | None = None, grace_s: float = 0.0,
             args: tuple[str, ...] = (), stderr: Any = subprocess.DEVNULL) -> KillResult:
    """Run a child on ``log`` (appended to) and SIGKILL it ``delay_s`` after its first finished step.

    ``grace_s``: the time beyond ``flush_s`` a step may go unwritten (a loaded machine's
    scheduling), in ``late_steps`` and ``bound_steps``.
    """
    flush_s = flush_every_s() if flush_s is None else flush_s
    start = os.path.getsize(log) if os.path.exists(log) else 0
    proc = start_train(side, *args, log=log, stderr=stderr)
    wait_for_steps(proc, side)
    t_first = time.time()
    time.sleep(delay_s)
    t_kill = time.time()
    proc.send_signal(signal.SIGKILL)
    rc = proc.wait()
    rng = parse_range(log, start, os.path.getsize(log))
    steps, _ = read_side(side)
    logged = rng.step_indices
    steps_logged = len(logged)
    # The run's own rate: its logged steps' start times (its finished steps' if it logged < 2).
    rate = _median_rate([r["start_unix_s"] for r in rng.records if r.get("kind") == "step"])
    if rate is None:
        rate = _median_rate([t for _, t in steps])
    return KillResult(
        returncode=rc,
        killed_after_s=t_kill - t_first,
        steps_done=steps[-1][0] + 1 if steps else 0,
        steps_logged=steps_logged,
        indices_in_order=logged == list(range(steps_logged)),
        rate_steps_per_s=rate,
        bound_steps=(rate or 0.0) * (flush_s + grace_s) + SLACK_STEPS,
        late_steps=sum(1 for i, t in steps if t < t_kill - flush_s - grace_s and i >= steps_logged),
        log=rng,
    )


class CpuHogs:
    """``n`` processes that spin on a CPU each while the block runs (a loaded machine)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> CpuHogs:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def tear_last_line(log: str) -> bool:
    """Cut the log's last line in half, as a kill inside its ``write()`` would leave it.

    Returns False (and changes nothing) where the log does not end with a whole line.
    """
    with open(log, "rb") as f:
        data = f.read()
    if not data.endswith(b"\n") or len(data) < 2:
        return False
    begin = data.rfind(b"\n", 0, len(data) - 1) + 1
    os.truncate(log, begin + (len(data) - 1 - begin) // 2)
    return True


def run_report(log: str) -> tuple[int, dict[str, Any] | None, str]:
    """``stepprof report --json LOG`` in a subprocess: exit code, the JSON (or None), stderr."""
    proc = subprocess.run([sys.executable, "-m", "stepprof", "report", "--json", log], env=child_env(),
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    try:
        out = json.loads(proc.stdout)
    except ValueError:
        out = None
    return proc.returncode, out, proc.stderr


@dataclasses.dataclass(frozen=True)
class SignalResult:
    """A child sent a signal with stepprof, beside the same child without it."""

    signal: str
    handler: str
    kbint_exit: int | None
    returncode: int | None  # None: it was still running a minute after the signal
    reference_returncode: int | None
    handler_called: bool  # the user's handler recorded the signal (with stepprof)
    reference_handler_called: bool
    steps_done: int
    steps_logged: int
    summary: dict[str, Any] | None  # the log's last summary
    stderr: str

    @property
    def ended_by(self) -> Any:
        return self.summary.get("ended_by") if self.summary is not None else None


def signal_run(workdir: str, sig: str, handler: str, *, kbint_exit: int | None = None,
               delay_s: float = 0.3, tag: str = "") -> SignalResult:
    """Send ``sig`` to a child with stepprof and to one without, ``delay_s`` after their first step.

    Both run at once.  ``handler`` is the user's handler (``none``, ``exit``, ``reraise``,
    ``keyboard``: see tests/soak_child.py), installed before the Profiler.
    """
    args = ["--handler", handler] + ([] if kbint_exit is None else ["--kbint-exit", str(kbint_exit)])
    name = f"{sig}-{handler}-{kbint_exit}{tag}"
    log = os.path.join(workdir, f"{name}.jsonl")
    side, ref_side = os.path.join(workdir, f"{name}.side"), os.path.join(workdir, f"{name}.ref.side")
    err_path = os.path.join(workdir, f"{name}.stderr")
    with open(err_path, "wb") as err:
        procs = [start_train(side, *args, log=log, stderr=err),
                 start_train(ref_side, *args, "--no-stepprof")]
        for p, s in zip(procs, (side, ref_side)):
            wait_for_steps(p, s)
        time.sleep(delay_s)
        for p in procs:
            p.send_signal(signal.Signals[sig])
        codes: list[int | None] = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=60))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                codes.append(None)
    steps, seen = read_side(side)
    _, ref_seen = read_side(ref_side)
    records = parse_range(log, 0, os.path.getsize(log)).records if os.path.exists(log) else ()
    summaries = [r for r in records if r.get("kind") == "summary"]
    with open(err_path, encoding="utf-8", errors="replace") as f:
        stderr = f.read()
    return SignalResult(
        signal=sig, handler=handler, kbint_exit=kbint_exit,
        returncode=codes[0], reference_returncode=codes[1],
        handler_called=sig in seen, reference_handler_called=sig in ref_seen,
        steps_done=steps[-1][0] + 1 if steps else 0,
        steps_logged=sum(1 for r in records if r.get("kind") == "step"),
        summary=summaries[-1] if summaries else None,
        stderr=stderr,
    )


def rss_run(at: tuple[int, ...], *, log: str | None = None, phases: int = 2) -> dict[str, list]:
    """A child's RSS (``rss_bytes``) and elapsed seconds at each step count in ``at``."""
    cmd = [sys.executable, CHILD, "rss", "--at", ",".join(map(str, at)), "--phases", str(phases)]
    if log is not None:
        cmd += ["--log", log]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the rss child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)
