"""Logs of every record kind, for the tests of the reader tools against hostile logs.

:func:`every_kind` is one run of each kind the writers produce (step, memory, flops, peak,
ranks, summary) followed by a sweep (its points and result), with the writer's fields
(``run_id``, the rank fields) as the log writer adds them.  :func:`run_every_tool` runs each
reader tool on a set of logs, in-process: what a test or bench/fuzz.py checks for crashes.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
from collections.abc import Callable
from typing import Any

from stepprof._schema import RECORD_KINDS, SCHEMA_VERSION

from . import logfixtures as fx

GIB = 2**30


def ranks_record(step: int) -> dict[str, Any]:
    stats = {"min": 6.9, "median": 7.0, "max": 9.1, "slowest_rank": 1}
    return {
        "schema_version": SCHEMA_VERSION, "kind": "ranks", "step": step, "world_size": 2,
        "window_steps": {"min": 10, "median": 10.0, "max": 10, "slowest_rank": 0}, "step_basis": "gpu_ms",
        "figures": {"gpu_ms": stats, "wall_ms": stats, "peak_allocated_bytes": None, "syncs_per_step": None,
                    "gap_ms": stats},
        "phases": {"forward": stats, "backward": stats},
        "per_rank": {"steps": [10, 10], "gpu_ms": [7.0, 9.1], "wall_ms": [7.1, 9.2],
                     "peak_allocated_bytes": [None, None], "syncs_per_step": [None, None], "gap_ms": [0.1, 0.2]},
        "straggler_rank": 1, "straggler_basis": "forward", "straggler_excess_ms": 2.1, "step_ratio": 1.3,
        "threshold": 1.1, "unavailable": {"peak_allocated_bytes": "no rank measured it in this window"},
        "group_ranks": [0, 1],
    }


def peak_record(step: int) -> dict[str, Any]:
    """A ``kind: "peak"`` record shaped as ``PeakExplanation.to_record`` writes it (figures illustrative)."""
    cats = {"parameters": 268500992, "gradients": 268500992, "optimizer_state": 537001984,
            "activations": 134217728, "temporaries": 268500992, "other": 196608}
    return {
        "schema_version": SCHEMA_VERSION, "kind": "peak", "step": step, "device": "cuda:0",
        "peak_allocated_bytes": sum(cats.values()), "live_bytes": sum(cats.values()), "peak_at_ms": 4.2,
        "phase": "optimizer", "op": "_multi_tensor_adamw (torch/optim/adamw.py:600)", "user_frame": "train.py:42",
        "bytes_by_category": cats,
        "modules": [{"module": "0", "total_bytes": 67125248, "bytes_by_category": {"gradients": 67125248}},
                    {"module": "2", "total_bytes": 33562624, "bytes_by_category": {"activations": 33562624}}],
        "outside_modules_bytes": 268500992, "reserved_bytes": 1409286144, "fragmentation_bytes": 66584576,
        "largest_free_block_bytes": 62914560, "live_blocks": 42, "trace_entries": 310, "cost_ms": 9.8,
        "timeline_ms": [0.0, 0.05, 2.0, 4.2, 6.0], "timeline_bytes": [805306368, 806354944, 10**9,
                                                                     sum(cats.values()), 805306368],
        "activations_from": "saved_tensors_hooks", "notes": [], "unavailable": {},
    }


def sweep_records() -> list[dict[str, Any]]:
    points = [
        {"schema_version": SCHEMA_VERSION, "kind": "sweep_point", "trial": i + 1, "phase": "grow",
         "batch_size": b, "oom": b > 64, "samples_per_s": None if b > 64 else 1000.0 * b,
         "step_ms": None if b > 64 else 1.0 + b / 64, "step_ms_p10": None if b > 64 else 0.9 + b / 64,
         "step_ms_p90": None if b > 64 else 1.1 + b / 64, "timed_steps": 3, "warmup_steps": 1,
         "peak_allocated_bytes": 2**20 * b, "alloc_retries": None if b > 64 else 0,
         "device_allocs": None if b > 64 else 0, "leaked_bytes": 0 if b > 64 else None,
         "error": "OutOfMemoryError: CUDA out of memory" if b > 64 else None, "wall_s": 1.0, "unavailable": {}}
        for i, b in enumerate((8, 16, 32, 64, 128))
    ]
    result = {"schema_version": SCHEMA_VERSION, "kind": "sweep_result", "knee": 32, "max_fit": 64,
              "first_oom": 128, "predicted_max": 100, "thrash_zone": [64, 64], "recommended": 32,
              "reason": "the knee", "stopped": "boundary", "device": "cuda:0", "trials": 5, "wall_s": 5.0,
              "capacity_bytes": 150_000_000_000, "fit_base_bytes": 1000.0, "fit_bytes_per_sample": 2.0**20,
              "knee_within": 0.1, "notes": ["a note"], "unavailable": {}}
    return [*points, result]


def every_kind(rank: int = 0, world: int = 2, run_id: str | None = None, steps: int = 30) -> list[dict[str, Any]]:
    """One run of every run kind (rank ``rank`` of ``world``), then a sweep."""
    recs = fx.training_log(steps=steps)
    explained = steps * 2 // 3
    at = next(i for i, r in enumerate(recs) if r["kind"] == "step" and r["step"] == explained)
    recs.insert(at + 1, peak_record(explained))
    recs[at]["explained"] = True
    if rank == 0:
        recs.insert(-1, ranks_record(steps - 3))
        recs.insert(-1, ranks_record(steps - 1))
    for r in recs:  # as the writer adds them: the profiler's id, then the rank fields
        r["run_id"] = run_id if run_id is not None else f"{rank:012x}"
        r.update({k: v for k, v in (("rank", rank), ("local_rank", rank), ("world_size", world)) if k not in r})
    sweep = sweep_records()
    for r in sweep:
        r["run_id"] = "5eed" * 3
    return copy.deepcopy([*recs, *sweep])  # the fixtures share CALIBRATION


def _quietly(call: Callable[[], Any]) -> Any:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return call()


#: The reader tools, each run through the CLI (``stepprof._cli.main``) or its Python function.
TOOLS = ("read", "frame", "report", "report --json", "export --chrome", "export --tensorboard",
         "plot", "plot --peak", "plot --sweep")


def run_tool(tool: str, logs: list[str], out: str) -> Any:
    """Run ``tool`` on ``logs``, writing under the folder ``out``; its result (an exit status for
    the CLI ones).  A tool that refuses a log with a ConfigError (exit status 2) has not crashed."""
    import warnings

    import stepprof
    from stepprof._cli import main

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if tool == "read":
            return sum(1 for log in logs for _ in stepprof.read(log))
        if tool == "frame":
            return [len(stepprof.frame(logs, kind=k)) for k in sorted(RECORD_KINDS)]
        if tool == "report":
            return _quietly(lambda: main(["report", *logs]))
        if tool == "report --json":
            return _quietly(lambda: main(["report", "--json", *logs]))
        if tool == "export --chrome":
            return _quietly(lambda: main(["export", "--chrome", os.path.join(out, "trace.json"), *logs]))
        if tool == "export --tensorboard":
            return _quietly(lambda: main(["export", "--tensorboard", os.path.join(out, "tb"), *logs]))
        flags = {"plot": [], "plot --peak": ["--peak"], "plot --sweep": ["--sweep"]}[tool]
        return [_quietly(lambda log=log, i=i: main(["plot", *flags, log, "-o", os.path.join(out, f"{i}.png")]))
                for i, log in enumerate(logs)]


# -- large logs of one shape, for the readers' time and memory bounds --------------------------


def write_lines(path: str, records: Any) -> str:
    """``records`` (an iterable of dicts) as JSON lines, written in blocks."""
    import orjson

    with open(path, "wb") as f:
        block = []
        for r in records:
            block.append(orjson.dumps(r))
            if len(block) >= 10_000:
                f.write(b"\n".join(block) + b"\n")
                block = []
        if block:
            f.write(b"\n".join(block) + b"\n")
    return path


def _step(i: int, **changes: Any) -> dict[str, Any]:
    r = fx.step_record(i, warmup=False, wall=7.0, gpu=7.0)
    r.update(changes)
    return r


def overlapping_steps(n: int, *, phases: bool = True) -> Any:
    """``n`` steps that never nest: each starts 1 ms after the previous one and lasts 20 s, on the
    host and the GPU, with its three phases at its end (or none)."""
    def step(i: int) -> dict[str, Any]:
        r = _step(i, start_unix_s=1796012940.0 + i / 1e3, wall_ms=20_000.0, gpu_ms=20_000.0, run_id="a" * 12)
        for k, ph in enumerate(r["phases"].values()):
            ph.update(start_ms=19_990.0 + 3 * k, wall_ms=2.0, gpu_ms=2.0)
        if not phases:
            r["phases"] = {}
        return r

    return map(step, range(n))


def distinct_runs(n: int) -> Any:
    """``n`` runs of one step each, each with its own ``run_id``."""
    return (_step(0, start_unix_s=1796012940.0 + i / 1e3, run_id=f"{i:012x}") for i in range(n))


def distinct_threads(n: int) -> Any:
    """``n`` steps, each on a thread of its own name."""
    return (_step(i, start_unix_s=1796012940.0 + i / 1e2, thread=f"worker-{i}", run_id="b" * 12) for i in range(n))


def changing_phases(n: int, names: int = 50) -> Any:
    """``n`` steps, each with ``names`` phases of names no other step has."""
    phase = {"wall_ms": 0.1, "gpu_ms": 0.1, "peak_allocated_bytes": 1024, "count": 1, "syncs": 0, "start_ms": 0.0}
    return (_step(i, phases={f"p{i}.{k}": phase for k in range(names)}, run_id="c" * 12) for i in range(n))
