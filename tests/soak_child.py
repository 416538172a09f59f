"""The child process of the soak tests (tests/test_soak.py) and bench/soak.py.

Two commands, run by path or as ``python -m tests.soak_child``:

``train``: a real CPU ``stepprof.Profiler(LOG, device="cpu")`` around a small real torch
step (a Linear forward, backward and SGD step; ``forward`` and ``backward`` phases through
``stepprof.measure``).  Right after each step exits it appends ``step <i> <unix time>`` to
the side file, one unbuffered ``os.write`` on an ``O_APPEND`` descriptor, so the parent
knows how far training got whatever kills the child.  ``--handler`` installs a user
SIGTERM/SIGINT handler *before* the Profiler; when called it appends ``signal <NAME>``
to the side file, then:

- ``exit``: ``sys.exit(--exit-code)``;
- ``reraise``: restores the default action and sends itself the signal (dies of it);
- ``keyboard``: raises ``KeyboardInterrupt`` (what Python's own SIGINT handler does).

``--empty`` runs empty steps with the same two phases instead (the most records a second).
A side path ending in ``.mmap`` is a memory-mapped file of ``(index + 1, unix time)`` pairs
(two int64s, time in ns) written with a memory store, not a system call: a loop that never
lets go of the GIL, as most training loops do not on the CPU (a starved collector thread).
``--kbint-exit CODE`` catches a ``KeyboardInterrupt`` around the loop and exits with CODE
(130, say).  ``--no-stepprof`` runs the same loop without stepprof: the exit code a
signal gives without it.

``rss``: a real ``stepprof.Profiler(LOG or None, device="cpu")`` doing empty steps with two
phases; prints one JSON object with the process's RSS (``/proc/self/statm``, after
``gc.collect()`` and a drain of the written steps) at each ``--at`` step count, and the
summary's step count per phase.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import sys
import time

HANDLERS = ("none", "exit", "reraise", "keyboard")
#: Steps a ``.mmap`` side file holds (16 bytes each).
MMAP_SLOTS = 1 << 20


def _train(args: argparse.Namespace) -> int:
    side = os.open(args.side, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    mapped = None
    if args.side.endswith(".mmap"):
        import mmap
        import struct

        os.ftruncate(side, MMAP_SLOTS * 16)
        mapped = mmap.mmap(side, MMAP_SLOTS * 16)
        pack_into = struct.Struct("<qq").pack_into

    def handler(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        os.write(side, f"signal {name} {time.time():.6f}\n".encode())
        if args.handler == "exit":
            sys.exit(args.exit_code)
        if args.handler == "reraise":
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the signal is delivered before this returns
        raise KeyboardInterrupt

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # a shell's background job
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    if args.handler != "none":  # the user's handler comes first, the Profiler after
        for name in args.signals.split(","):
            signal.signal(signal.Signals[name], handler)

    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(16, 32)

    if args.no_stepprof:
        prof_cm: contextlib.AbstractContextManager = contextlib.nullcontext()
        step = contextlib.nullcontext
        measure = lambda name: contextlib.nullcontext()  # noqa: E731
    else:
        import stepprof

        opts = {} if args.flush_every_s is None else {"flush_every_s": args.flush_every_s}
        prof = stepprof.Profiler(args.log, device="cpu", **opts)
        prof_cm = prof
        step = lambda: prof.step(batch_size=16)  # noqa: E731
        measure = stepprof.measure

    def loop() -> None:
        i = 0
        with prof_cm:
            while args.steps <= 0 or i < args.steps:
                with step():
                    if args.empty:  # the fastest loop: the most steps for the collector to write
                        with measure("forward"):
                            pass
                        with measure("backward"):
                            pass
                    else:
                        with measure("forward"):
                            loss = model(x).square().mean()
                        with measure("backward"):
                            loss.backward()
                        opt.step()
                        opt.zero_grad()
                if mapped is None:
                    os.write(side, b"step %d %.6f\n" % (i, time.time()))
                elif i < MMAP_SLOTS:
                    pack_into(mapped, 16 * i, i + 1, time.time_ns())
                i += 1

    if args.kbint_exit is None:
        loop()
        return 0
    try:
        loop()
    except KeyboardInterrupt:
        return args.kbint_exit
    return 0


def _statm_rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rss(args: argparse.Namespace) -> int:
    import stepprof

    at = sorted({int(n) for n in args.at.split(",")})
    out: dict[str, list] = {"steps": [], "rss_bytes": [], "elapsed_s": []}
    names = [f"phase{k}" for k in range(args.phases)]
    with stepprof.Profiler(args.log, device="cpu") as prof:
        t0 = time.perf_counter()
        marks = iter(at)
        due = next(marks)
        i = 0
        while True:
            with prof.step(batch_size=8):
                for name in names:
                    with prof.measure(name):
                        pass
            i += 1
            if i == due:
                prof.flush()  # the written steps' records are let go, as the collector would
                gc.collect()
                out["steps"].append(i)
                out["rss_bytes"].append(_statm_rss())
                out["elapsed_s"].append(time.perf_counter() - t0)
                due = next(marks, None)
                if due is None:
                    break
    summary = prof.summary
    out["measured_steps"] = summary.measured_steps
    out["phase_steps"] = {name: ph.steps for name, ph in summary.phases.items()}
    print(json.dumps(out), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="soak_child")
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train")
    t.add_argument("--log", default=None, help="the log (appended to); none: no log")
    t.add_argument("--side", required=True, help="the side file: a line per finished step")
    t.add_argument("--steps", type=int, default=0, help="steps to run; 0: until killed")
    t.add_argument("--handler", choices=HANDLERS, default="none")
    t.add_argument("--signals", default="SIGTERM,SIGINT", help="the signals the handler takes")
    t.add_argument("--exit-code", type=int, default=3, help="the code of --handler exit")
    t.add_argument("--kbint-exit", type=int, default=None)
    t.add_argument("--no-stepprof", action="store_true")
    t.add_argument("--empty", action="store_true", help="empty steps (two empty phases), no torch work")
    t.add_argument("--flush-every-s", type=float, default=None, help="passed to the Profiler if given")
    r = sub.add_parser("rss")
    r.add_argument("--log", default=None)
    r.add_argument("--at", default="100000,1000000", help="step counts at which RSS is read")
    r.add_argument("--phases", type=int, default=2)
    args = ap.parse_args(argv)
    return _train(args) if args.command == "train" else _rss(args)


if __name__ == "__main__":
    raise SystemExit(main())
