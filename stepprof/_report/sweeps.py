"""Sweeps in a log: ``sweep_point`` records up to their ``sweep_result``, read back into records."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import attrs

from .._sweep.result import SweepPoint, SweepResult
from .read import OPEN_RUNS_KEPT

__all__ = ["LoggedSweep", "logged_sweeps"]

#: Points kept per sweep.
_POINTS_KEPT = 10_000


@attrs.frozen
class LoggedSweep:
    """One sweep as logged: the points this version can read, the result record as found,
    the :class:`stepprof.SweepResult` rebuilt from them (None if it cannot be), and its table."""

    points: tuple[SweepPoint, ...]
    result_record: dict[str, Any] | None
    result: SweepResult | None
    table: str | None


def logged_sweeps(records: Iterable[dict[str, Any]]) -> list[LoggedSweep]:
    """Group a log's sweep records (in order) into sweeps, one per result, then those without one.

    A record whose ``run_id`` is a str belongs to that sweep (one ``stepprof.sweep()`` call),
    wherever it lies among another sweep's records; the points without one run up to the
    next result without one.  At most ``OPEN_RUNS_KEPT`` sweeps are held open: past that,
    the oldest is listed without a result.
    """
    sweeps: list[LoggedSweep] = []
    open_: OrderedDict[str | None, list[dict[str, Any]]] = OrderedDict()
    for r in records:
        rid = r.get("run_id")
        if type(rid) is not str:
            rid = None
        if r.get("kind") == "sweep_point":
            points = open_.get(rid)
            if points is None:
                if len(open_) >= OPEN_RUNS_KEPT:
                    sweeps.append(_read_sweep(open_.popitem(last=False)[1], None))
                points = open_[rid] = []
            if len(points) < _POINTS_KEPT:
                points.append(r)
        else:
            sweeps.append(_read_sweep(open_.pop(rid, []), r))
    sweeps.extend(_read_sweep(points, None) for points in open_.values())
    return sweeps


def _read_point(p: dict[str, Any]) -> SweepPoint | None:
    """The point, or None without a batch size or an out-of-memory flag (the record's other
    fields are of their type or null: stepprof._sanitise)."""
    kw: dict[str, Any] = {a.name: p.get(a.name) for a in attrs.fields(SweepPoint)}
    kw["unavailable"] = kw["unavailable"] or {}
    if kw["batch_size"] is None or kw["oom"] is None:
        return None  # a point this version cannot read
    return SweepPoint(**kw)


def _read_sweep(points: list[dict[str, Any]], result: dict[str, Any] | None) -> LoggedSweep:
    built = [p for p in map(_read_point, points) if p is not None]
    built.sort(key=lambda p: p.batch_size)
    points_table = "\n".join(str(p) for p in built) if built else None
    if result is None:
        return LoggedSweep(tuple(built), None, None, points_table)
    kw: dict[str, Any] = {a.name: result.get(a.name) for a in attrs.fields(SweepResult) if a.name != "points"}
    zone = result.get("thrash_zone")
    kw["thrash_zone"] = (
        range(zone[0], zone[1] + 1)
        if type(zone) is list and len(zone) == 2 and all(type(z) is int for z in zone) and zone[0] <= zone[1]
        else None
    )
    notes = result.get("notes")
    kw["notes"] = tuple(n for n in notes if type(n) is str) if type(notes) is list else ()
    kw["unavailable"] = result.get("unavailable") if type(result.get("unavailable")) is dict else {}
    if kw.get("knee_within") is None:
        kw["knee_within"] = 0.1
    record = {k: v for k, v in result.items() if k != "schema_version"}
    try:
        obj = SweepResult(points=tuple(built), **kw)
        table = str(obj)
    except Exception:  # noqa: BLE001 - a result this version cannot read: the points still print
        return LoggedSweep(tuple(built), record, None, points_table)
    return LoggedSweep(tuple(built), record, obj, table)
