"""The log's record schema: its version, its kinds, and the builders of the step and summary records.

Every line of a stepprof log is one record, a JSON object with ``schema_version`` and
``kind``.  docs/reference/schema.md describes each field.  One function builds each kind:

- ``step``: :func:`step_record` (the collector's ``build_step_record`` calls it).
- ``summary``: :func:`summary_record` (through ``stepprof.Summary.to_record``).
- ``memory``: ``stepprof.MemoryReport.to_record`` (stepprof/_memory.py).
- ``flops``: ``FlopsHook._set_flops`` (stepprof/_recorder/flops.py).
- ``ranks``: ``ranks_record`` and ``unjoined_record`` (stepprof/_dist.py).
- ``sweep_point``: ``stepprof.SweepPoint.to_record``.
- ``sweep_result``: ``stepprof.SweepResult.to_record``.

The writer adds ``schema_version`` to a record that lacks it, ``run_id`` (the profiler's)
after its fields, and in a distributed run the rank fields ``rank``, ``local_rank`` and
``world_size`` at its end.

The summary's percentile objects are written as ``wall_ms_percentiles`` and
``gpu_ms_percentiles`` (the attributes of ``stepprof.Summary`` are ``wall_ms`` and
``gpu_ms``), so that no column holds a float in one kind and an object in another.
Version 1 (stepprof 0.1.0) named them ``wall_ms`` and ``gpu_ms``; this version does not
read them: 0.1.0 logs need stepprof 0.1.x.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import attrs

if TYPE_CHECKING:  # pragma: no cover
    from ._records import Percentiles, PhaseFigures, Summary

__all__ = [
    "RECORD_KINDS",
    "SCHEMA_VERSION",
    "SUMMARY_RENAMED",
    "step_record",
    "summary_record",
]

#: Version of the record schema; every line carries it as ``schema_version``.
SCHEMA_VERSION: Final = 2

#: The record kinds stepprof writes (docs/reference/schema.md).
RECORD_KINDS: Final = frozenset(
    {"step", "summary", "memory", "flops", "peak", "ranks", "sweep_point", "sweep_result"}
)

#: The summary's fields whose key is not their ``stepprof.Summary`` attribute: attribute -> key.
SUMMARY_RENAMED: Final = {"wall_ms": "wall_ms_percentiles", "gpu_ms": "gpu_ms_percentiles"}


class _Absent:
    """Marks an optional field that the record leaves out (None is a value: a null figure)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ABSENT"


#: Default of :func:`step_record`'s optional fields: the key is not written.
ABSENT: Final = _Absent()


def _make_step_record() -> Callable[..., dict[str, Any]]:
    """:func:`step_record`, generated from the step record's declaration (``_fields.RECORDS``),
    as attrs generates an ``__init__``: one dict display in the declared order, then one test
    per optional field.  The declaration is its only owner: a field added there is a parameter
    here, in its place."""
    from ._fields import RECORDS, WRITER_FIELDS

    writer = {f.name for f in WRITER_FIELDS}
    fields = [f for f in RECORDS["step"].fields if f.name not in ("schema_version", "kind", "encoding_replaced")]
    core = [f.name for f in fields if not f.optional]
    optional = [f.name for f in fields if f.optional]
    lines = [f"def step_record({', '.join(core)}, *, {', '.join(f'{n}=ABSENT' for n in optional)}):"]
    lines.append("    record = {'schema_version': SCHEMA_VERSION, 'kind': 'step', "
                 + ", ".join(f"{n!r}: {n}" for n in core) + "}")
    for n in optional:
        # A writer field (run_id, the rank fields) given as None is not written either.
        test = f"{n} is not ABSENT and {n} is not None" if n in writer else f"{n} is not ABSENT"
        if n == "flops_counted":
            test = f"{n} is True"  # written only as True
        lines.append(f"    if {test}:\n        record[{n!r}] = {n}")
    lines.append("    return record")
    scope: dict[str, Any] = {"ABSENT": ABSENT, "SCHEMA_VERSION": SCHEMA_VERSION}
    exec("\n".join(lines), scope)  # noqa: S102 - our own declaration, as attrs and dataclasses do
    fn: Callable[..., dict[str, Any]] = scope["step_record"]
    fn.__module__ = __name__
    fn.__doc__ = """A ``kind: "step"`` record, its keys in the declared order (docs/reference/schema.md's).

    The fields up to ``unavailable`` are always written and may be passed by position, in
    that order (the collector does: a keyword call costs a microsecond more a step).  The
    optional fields, by keyword, are left out at their default: ``host_rss_bytes`` (CPU steps
    only), ``thread`` (steps of a thread other than the training thread), ``sampled`` (under
    ``overhead_budget``), ``data_ms`` (a batch fetched through ``stepprof.iterate``), ``data_wait_in_step_ms``
    (``Profiler.add_batch(wait_s=)``), the FLOP
    fields, ``energy_j`` and ``energy_span_ms``, the compile fields, and ``run_id`` and the rank
    fields (which the log writer adds; None is not written either).  ``flops_counted`` is
    written only as True.  ``unavailable`` is kept by reference, so a caller may still add
    reasons to it.
    """
    return fn


#: Builds a ``kind: "step"`` record (see :func:`_make_step_record`).
step_record = _make_step_record()
#: The fields :func:`step_record` takes by position, in order.
STEP_CORE_FIELDS: Final = tuple(
    n for n in step_record.__code__.co_varnames[: step_record.__code__.co_argcount]
)


def _percentiles(p: Percentiles | None) -> dict[str, float] | None:
    return None if p is None else attrs.asdict(p)


def _phases(phases: dict[str, PhaseFigures]) -> dict[str, dict[str, Any]]:
    return {name: attrs.asdict(figures) for name, figures in phases.items()}


def _reasons(unavailable: dict[str, str]) -> dict[str, str]:
    return {SUMMARY_RENAMED.get(k, k): v for k, v in unavailable.items()}


#: How a summary field is written, by its ``stepprof.Summary`` attribute; the others are
#: written as they are.
_SUMMARY_WRITE: Final[dict[str, Callable[[Any], Any]]] = {"wall_ms": _percentiles, "gpu_ms": _percentiles, "phases": _phases, "unavailable": _reasons}


def summary_keys() -> tuple[tuple[str, str, bool], ...]:
    """(key, ``stepprof.Summary`` attribute, optional) of each field :func:`summary_record`
    writes, in the declared order (``_fields.RECORDS["summary"]``): the declaration is the
    summary's only list of fields.  The log writer's fields are not a summary's, but ``run_id``
    (the profiler's, which its summary carries)."""
    from ._fields import RECORDS, WRITER_FIELDS

    renamed = {new: old for old, new in SUMMARY_RENAMED.items()}
    writer = {f.name for f in WRITER_FIELDS} - {"run_id"}
    return tuple((f.name, renamed.get(f.name, f.name), f.optional) for f in RECORDS["summary"].fields
                 if f.name not in ("schema_version", "kind") and f.name not in writer)


_SUMMARY_FIELDS: Final = summary_keys()


def summary_record(summary: Summary) -> dict[str, Any]:
    """The ``kind: "summary"`` record of ``summary`` (without ``schema_version``, which the
    writer adds), its keys in the declared order (:func:`summary_keys`).

    The percentile figures go under ``wall_ms_percentiles`` and ``gpu_ms_percentiles``,
    and so do their reasons in ``unavailable``; the attributes of ``stepprof.Summary``
    keep the names ``wall_ms`` and ``gpu_ms``.  ``phases`` holds each phase's
    ``stepprof.PhaseFigures`` as an object of the same fields.  An optional field
    (``compile_steps``: the run saw compilation) is written only when it is not None.
    """
    record: dict[str, Any] = {"kind": "summary"}
    for key, attr, optional in _SUMMARY_FIELDS:
        value = getattr(summary, attr)
        if optional and value is None:
            continue
        write = _SUMMARY_WRITE.get(attr)
        record[key] = value if write is None else write(value)
    return record

