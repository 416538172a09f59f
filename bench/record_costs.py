"""Where a record's cost goes: the thread CPU of each part of the collector's pipeline, per record.

A near-empty step (bench/floor.py's: one tiny kernel on CUDA, nothing on the CPU), ``--steps``
of them under one profiler that harvests inline at each step's exit (``collect_every_s=None``),
so that every part runs on the calling thread and its thread CPU (``time.thread_time_ns``) is
its own.  Each part is wrapped; a wrapper's own cost (calibrated on an empty function) is taken
out of it and of every wrapped part around it.  The garbage collector's pauses land in
whichever part allocates when one is due: ``--no-gc`` turns it off for the loop.  Inline, each
harvest writes one step (a ``write()`` a step), which the collector thread would batch.

Parts: ``read`` (the step's events read back: ``Step.read``), ``build`` (the record and the
hooks: ``Builder.build``), ``summary`` (``RunAggregate.add_step``), ``hold`` and
``write held`` (a record waiting for its energy sample: encoded, then completed and written:
``HeldRecords``),
``log`` (``LogSink.write`` and ``end_batch``), ``harvest`` (all of a harvest, these included).

``--python-fold``: records are built and the summary folds in Python, not in C (stepprof/_fold.c,
when it is built).  ``--python-harvest``: the harvest's loop in Python, not in one C call for
many steps (``harvest_steps``), which runs read, build and log inside it: without the flag only
``harvest``, ``summary``, ``hold``, ``write held`` and the log's batch write are charged apart.

    python bench/record_costs.py [--steps 5000] [--phases 3] [--energy-off] [--no-gc] [--python-fold]
                                 [--python-harvest] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stepprof._recorder import collector as collector_mod  # noqa: E402
from stepprof._recorder import held, sinks, step  # noqa: E402
from stepprof._recorder.profiler import _make_profiler  # noqa: E402
from _common import run_info  # noqa: E402
from floor import near_empty_step, run_steps  # noqa: E402

#: (part, class, method): the wrapped parts, in the table's order.
PARTS = (
    ("harvest", collector_mod.Collector, "harvest"),
    ("read", step.Step, "read"),
    ("build", collector_mod.Builder, "build"),
    ("summary", None, "add_step"),
    ("hold", held.HeldRecords, "hold"),
    ("write held", held.HeldRecords, "write"),
    ("log", sinks.LogSink, "write"),
    ("log", sinks.LogSink, "end_batch"),
)


class Meter:
    """Thread CPU per part, less the wrappers' own cost."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.wrapped_calls = 0  # every wrapped call so far (to count those inside a call)
        self.overhead_ns = 0.0  # one wrapper's own cost

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.thread_time_ns

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            inner0 = self.wrapped_calls
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = clock() - t0
                inner = self.wrapped_calls - inner0
                self.wrapped_calls += 1
                self.ns[part] = self.ns.get(part, 0) + elapsed - round(inner * self.overhead_ns)
                self.calls[part] = self.calls.get(part, 0) + 1

        return wrapped

    def calibrate(self, n: int = 20000) -> None:
        """A wrapper's own cost: an empty function, wrapped, against the same unwrapped."""
        def empty() -> None:
            return None

        probe = Meter()
        w = probe.wrap("probe", empty)
        clock = time.thread_time_ns
        for _ in range(3):  # the fastest of three: a wrapper costs what it costs when warm
            t0 = clock()
            for _ in range(n):
                w()
            t1 = clock()
            for _ in range(n):
                empty()
            t2 = clock()
            cost = max(0.0, ((t1 - t0) - (t2 - t1)) / n)
            self.overhead_ns = cost if not self.overhead_ns else min(self.overhead_ns, cost)


def run(steps: int, phases: int, energy: bool, no_gc: bool, device: str, python_harvest: bool = False) -> dict[str, Any]:
    meter = Meter()
    native = collector_mod._NATIVE
    fast = native.harvest
    if python_harvest:  # the harvest's loop in Python: each part runs, and is charged, on its own
        native.harvest = None
    meter.calibrate()
    saved = []
    for part, cls, name in PARTS:
        if cls is not None:
            saved.append((cls, name, cls.__dict__[name]))
            setattr(cls, name, meter.wrap(part, cls.__dict__[name]))
    work, sync = near_empty_step(device == "cuda")
    tmp = tempfile.mkdtemp(prefix="stepprof-record-costs-")
    try:
        prof = _make_profiler(os.path.join(tmp, "run.jsonl"), device=device, collect_every_s=None,
                              energy_every_s=0.5 if energy else None)
        sink = prof._summary_sink
        sink.add_step = meter.wrap("summary", sink.add_step)
        names = [f"p{k}" for k in range(phases)]
        if no_gc:
            gc.disable()
        sync()
        t0 = time.thread_time_ns()
        run_steps(prof, steps, names, work)
        loop_ns = time.thread_time_ns() - t0
        gc.enable()
        prof.close()
    finally:
        gc.enable()
        native.harvest = fast
        for cls, name, fn in saved:
            setattr(cls, name, fn)
    per_record = {part: meter.ns[part] / steps / 1e3 for part in meter.ns}
    return {
        "steps": steps, "phases": phases, "energy": energy, "gc": not no_gc, "device": device,
        "harvest_loop": "python" if python_harvest or fast is None else "c",
        "wrapper_ns": meter.overhead_ns,
        "loop_us_per_step": loop_ns / steps / 1e3,
        "us_per_record": per_record,
        "calls": dict(meter.calls),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--phases", type=int, default=3)
    ap.add_argument("--energy-off", action="store_true")
    ap.add_argument("--no-gc", action="store_true")
    ap.add_argument("--python-fold", action="store_true")
    ap.add_argument("--python-harvest", action="store_true")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    from stepprof import _aggregate
    from stepprof._recorder import collector

    fold_why = _aggregate.use_native(not args.python_fold) or collector.use_native(not args.python_fold)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    res = run(args.steps, args.phases, not args.energy_off, args.no_gc, device, args.python_harvest)
    info = run_info("record_costs.py", gpu=None if device == "cuda" else "cpu")
    print(f"stepprof's record pipeline on {info['gpu']}, torch {info['torch']}: {args.steps} steps, "
          f"{args.phases} phases, energy {'on' if res['energy'] else 'off'}, gc {'on' if res['gc'] else 'off'} "
          f"(a wrapper: {res['wrapper_ns']:.0f} ns, taken out); records built and folded in "
          f"{'Python' if args.python_fold else 'C' if fold_why is None else f'Python ({fold_why})'}; "
          f"the harvest's loop in {'C' if res['harvest_loop'] == 'c' else 'Python'}")
    res["fold"] = "python" if args.python_fold or fold_why is not None else "c"
    print(f"  training thread, all of it: {res['loop_us_per_step']:.1f} µs/step")
    seen = []
    for part, _, _ in PARTS:
        if part in res["us_per_record"] and part not in seen:
            seen.append(part)
            print(f"  {part:12s} {res['us_per_record'][part]:8.2f} µs/record")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**info, **res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
