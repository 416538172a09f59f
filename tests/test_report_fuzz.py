"""Report fuzzing: a realistic log with fields replaced by wrong types, huge numbers, or deleted.

Every field of every record kind the report reads (``step``, ``memory``, ``flops``,
``ranks``, ``summary``, ``sweep_point``, ``sweep_result``), at the top level and nested
(``calibration``, ``phases``, ``syncs.sites``, ``allocator``, the ranks figures, ...),
is a candidate.  ``build_report`` + ``render`` and ``stepprof report [--json]`` must
finish without an exception, in bounded time, and print something.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import signal
from typing import Any

import pytest

from stepprof._cli import main
from stepprof._report import build_report, render

from . import logfixtures as fx

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

#: Seconds one example may take (the report of this small log takes milliseconds).
DEADLINE_S = 10.0

KINDS = ("step", "memory", "flops", "ranks", "summary", "sweep_point", "sweep_result")


def _ranks_record(step: int) -> dict[str, Any]:
    stats = {"median": 7.0, "min": 6.9, "max": 9.1, "argmax": 1}
    return {
        "schema_version": fx.SCHEMA_VERSION, "kind": "ranks", "step": step, "world_size": 2, "rank": 0,
        "window_steps": {"median": 10, "min": 10, "max": 10, "argmax": 0}, "step_basis": "gpu_ms",
        "figures": {"gpu_ms": stats, "wall_ms": stats}, "phases": {"forward": stats},
        "per_rank": {"gpu_ms": [7.0, 9.1]}, "straggler_rank": 1, "straggler_basis": "forward",
        "straggler_excess_ms": 2.1, "step_ratio": 1.3, "threshold": 1.1,
        "unavailable": {"straggler_rank": "fine"}, "group_ranks": [0, 1],
    }


def _sweep_records() -> list[dict[str, Any]]:
    points = [
        {"schema_version": fx.SCHEMA_VERSION, "kind": "sweep_point", "trial": i, "phase": "grow",
         "batch_size": b, "oom": b > 64, "samples_per_s": None if b > 64 else 1000.0 * b,
         "step_ms": None if b > 64 else 1.0 + b / 64, "step_ms_p10": 0.9, "step_ms_p90": 1.1, "timed_steps": 3,
         "warmup_steps": 1, "peak_allocated_bytes": 1000 * b, "alloc_retries": 0, "device_allocs": 0,
         "leaked_bytes": None, "error": "CUDA out of memory" if b > 64 else None, "wall_s": 1.0,
         "unavailable": {}}
        for i, b in enumerate((8, 16, 32, 64, 128))
    ]
    result = {"schema_version": fx.SCHEMA_VERSION, "kind": "sweep_result", "knee": 32, "max_fit": 64,
              "first_oom": 128, "predicted_max": 100, "thrash_zone": [64, 64], "recommended": 32,
              "reason": "the knee", "stopped": "oom", "device": "cuda:0", "trials": 5, "wall_s": 5.0,
              "capacity_bytes": 150_000_000_000, "fit_base_bytes": 1000, "fit_bytes_per_sample": 1000.0,
              "knee_within": 0.1, "notes": ["a note"], "unavailable": {}}
    return [*points, result]


def base_log(rank: int = 0) -> list[dict[str, Any]]:
    """One run of every record kind, of rank ``rank`` in a world of 2, then a sweep."""
    recs = fx.training_log(steps=30)
    if rank == 0:
        recs.insert(-1, _ranks_record(20))
        recs.insert(-1, _ranks_record(25))
    for r in recs:  # as the writer adds them: the profiler's id, then the rank fields
        r["run_id"] = f"{rank:012x}"
        r.update({k: v for k, v in (("rank", rank), ("local_rank", rank), ("world_size", 2)) if k not in r})
    sweep = _sweep_records()
    for r in sweep:
        r["run_id"] = "5eed" * 3
    return copy.deepcopy([*recs, *sweep])  # the fixtures share CALIBRATION


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into a record's nested dicts and lists (a list through its first item)."""
    out = []
    if type(value) is dict:
        for k, v in value.items():
            if prefix == () and k == "kind":
                continue
            out.append((*prefix, k))
            out += _paths(v, (*prefix, k))
    elif type(value) is list and value:
        out.append((*prefix, 0))
        out += _paths(value[0], (*prefix, 0))
    return out


_BASE = base_log()
PATHS = {kind: sorted({p for r in _BASE if r["kind"] == kind for p in _paths(r)}, key=repr) for kind in KINDS}

DELETE = object()
WRONG = st.one_of(
    st.sampled_from([None, True, False, "", "x", [], {}, [1, "a"], {"a": 1}, {"median": "x"},
                     2**70, -(2**70), 2**63, 1e308, -1e308, -0.0, 0, -1, 0.5, DELETE]),
    st.text(max_size=4),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(st.one_of(st.none(), st.integers(), st.text(max_size=2)), max_size=3),
    st.dictionaries(st.text(max_size=3), st.one_of(st.none(), st.integers(), st.floats(allow_nan=False)),
                    max_size=3),
)


@st.composite
def mutations(draw):
    kind = draw(st.sampled_from(KINDS))
    path = draw(st.sampled_from(PATHS[kind]))
    return kind, path, draw(WRONG), draw(st.sampled_from(["all", "first", "last"]))


def _apply(records: list[dict[str, Any]], kind: str, path: tuple[Any, ...], value: Any, which: str) -> None:
    targets = [r for r in records if r.get("kind") == kind]
    if which == "first":
        targets = targets[:1]
    elif which == "last":
        targets = targets[-1:]
    for r in targets:
        node: Any = r
        for key in path[:-1]:
            try:
                node = node[key]
            except (KeyError, IndexError, TypeError):
                node = None
                break
        key = path[-1]
        if type(node) is dict and key in node or type(node) is list and type(key) is int and key < len(node):
            if value is DELETE:
                if type(node) is dict:
                    del node[key]
            else:
                node[key] = copy.deepcopy(value)


def _write(path: str, records: list[dict[str, Any]]) -> str:
    # The stdlib encoder: it writes ints of any size (the reader then sees what a hostile log holds).
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


class _Overdue(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: float):
    """Raise :class:`_Overdue` in the main thread if the block runs past ``seconds`` (a hang)."""

    def overdue(signum, frame):
        raise _Overdue(f"over {seconds} s")

    old = signal.signal(signal.SIGALRM, overdue)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def check_report(paths: list[str]) -> None:
    """The report, rendered and as ``stepprof report [--json]``: no exception, output produced."""
    with _deadline(DEADLINE_S):
        report = build_report(paths)
        text = render(report)
        assert text.startswith("== ")
        for args in (["report", "--json", *paths], ["report", *paths]):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert main(args) == 0
            assert out.getvalue().strip()
        json.loads(_json_of(paths))


def _json_of(paths: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["report", "--json", *paths])
    return out.getvalue()


def mutated_report(tmp_path, changes: list[tuple[str, tuple[Any, ...], Any, str]]) -> None:
    """The report of the base log (rank 0) with ``changes`` applied, beside a clean rank-1 log."""
    records = base_log()
    for change in changes:
        _apply(records, *change)
    check_report([_write(str(tmp_path / "r0.jsonl"), records), _write(str(tmp_path / "r1.jsonl"), base_log(1))])


def test_the_base_logs_report_every_part(tmp_path):
    mutated_report(tmp_path, [])
    report = build_report([str(tmp_path / "r0.jsonl"), str(tmp_path / "r1.jsonl")])
    (run,) = report.logs[0].runs
    assert run.roofline is not None and run.ranks is not None and run.syncs is not None and run.phases
    assert report.logs[0].sweeps[0].table and report.distributed.exchanges is not None


@hypothesis.settings(max_examples=400, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(st.lists(mutations(), min_size=1, max_size=3))
def test_a_wrong_typed_or_missing_field_never_breaks_the_report(tmp_path, changes):
    mutated_report(tmp_path, changes)


# -- the cases fuzzing found, one test each ----------------------------------------------------


def _flops_report(tmp_path, **calibration):
    """The report of one clean run whose flops record's calibration has ``calibration`` set."""
    records = base_log()
    (flops,) = [r for r in records if r["kind"] == "flops"]
    for key, value in calibration.items():
        if value is DELETE:
            del flops["calibration"][key]
        else:
            flops["calibration"][key] = value
    path = _write(str(tmp_path / "r0.jsonl"), records)
    check_report([path])
    (run,) = build_report([path]).logs[0].runs
    return run


@pytest.mark.parametrize("copy_gbps", [None, DELETE, "3900", [], 0, -1.0])
def test_a_calibration_without_a_usable_copy_bandwidth_classes_the_step_without_a_memory_bound(tmp_path, copy_gbps):
    run = _flops_report(tmp_path, copy_gbps=copy_gbps)
    assert run.roofline["class"] == "compute-bound" and run.roofline["memory_ms"] is None
    assert run.roofline["calibration"]["copy_gbps"] is None
    assert run.roofline["calibration_ignored"] == ([] if copy_gbps in (None, DELETE) else ["copy_gbps"])
    (roof,) = [d for d in run.diagnoses if d.kind == "roofline"]
    assert "a copy bandwidth the calibration lacks" in roof.evidence[0]


@pytest.mark.parametrize("rates", [True, "x", [1, "a"], 2**70, 720.0])
def test_matmul_rates_that_are_not_a_dict_are_skipped_and_named(tmp_path, rates):
    run = _flops_report(tmp_path, matmul_tflops=rates)
    assert run.roofline["class"] is None and run.roofline["compute_ms"] is None
    assert run.roofline["calibration_ignored"] == ["matmul_tflops"]
    assert "stepprof calibrate measures only" in run.not_diagnosed["roofline"]


def test_one_wrong_matmul_rate_is_skipped_and_the_others_are_used(tmp_path):
    run = _flops_report(tmp_path, matmul_tflops={"bf16": 720.0, "tf32": "380", "fp32": None})
    assert run.roofline["class"] == "compute-bound"
    assert run.roofline["calibration"]["matmul_tflops"] == {"bf16": 720.0}
    assert run.roofline["calibration_ignored"] == ["matmul_tflops.tf32", "matmul_tflops.fp32"]


def test_a_list_launch_cost_is_never_multiplied_by_the_op_count(tmp_path):
    # ``ops * launch_us`` with a list would build a list of ops * len items (a hang, then an OOM).
    records = base_log()
    (flops,) = [r for r in records if r["kind"] == "flops"]
    flops["ops"] = 2**62
    flops["calibration"]["launch_us"] = [1]
    path = _write(str(tmp_path / "r0.jsonl"), records)
    check_report([path])
    (run,) = build_report([path]).logs[0].runs
    assert run.roofline["host_ms"] is None and run.roofline["calibration_ignored"] == ["launch_us"]
