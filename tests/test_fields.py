"""The record declaration (stepprof/_fields.py): complete, in step with docs/reference/schema.md and the writers."""

from __future__ import annotations

import os
import re

import pytest

import stepprof
from stepprof._fields import FREE, RECORDS, UNITS, WRITER_FIELDS, Field, ListOf, MapOf, Obj
from stepprof._schema import RECORD_KINDS
from stepprof._schema_doc import markdown

from . import readerlogs
from .conftest import make

SCHEMA_MD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "reference", "schema.md")


def test_every_kind_stepprof_writes_is_declared():
    assert set(RECORDS) == RECORD_KINDS


def test_docs_reference_schema_md_is_generated_from_the_declaration():
    """The committed page is ``python -m stepprof._schema_doc``'s output: regenerate it after
    changing the declaration (``python -m stepprof._schema_doc > docs/reference/schema.md``)."""
    with open(SCHEMA_MD, encoding="utf-8") as f:
        committed = f.read()
    assert committed == markdown(), "docs/reference/schema.md is stale: run python -m stepprof._schema_doc"


@pytest.mark.parametrize("kind", sorted(RECORD_KINDS))
def test_the_schema_page_has_a_table_for_each_kind_with_every_declared_field(kind):
    section = markdown().split(f'## `kind: "{kind}"`', 1)[1].split("\n## ", 1)[0]
    rows = {m for m in re.findall(r"^\| `(\w+)` \|", section, re.M)}
    writer = {f.name for f in WRITER_FIELDS} | {"schema_version", "kind"}
    assert {f.name for f in RECORDS[kind].fields} - writer <= rows


def _walk(fields: tuple[Field, ...]):
    for f in fields:
        yield f
        t = f.type
        while isinstance(t, (MapOf, ListOf)):
            t = t.value if isinstance(t, MapOf) else t.item
        if isinstance(t, Obj):
            yield from _walk(t.fields)


def test_every_field_has_a_type_a_known_unit_and_a_meaning():
    for record in RECORDS.values():
        for f in _walk(record.fields):
            assert f.unit is None or f.unit in UNITS, f
            assert f.meaning and "\n" not in f.meaning, f
            assert not (f.required and f.nullable), f


def _undeclared(value, t, path=""):
    """The paths in ``value`` that the type ``t`` does not declare."""
    if isinstance(t, Obj) and type(value) is dict:
        fields = {f.name: f for f in t.fields}
        for k, v in value.items():
            if k not in fields:
                yield f"{path}{k}"
            else:
                yield from _undeclared(v, fields[k].type, f"{path}{k}.")
    elif isinstance(t, MapOf) and type(value) is dict:
        for v in value.values():
            yield from _undeclared(v, t.value, path)
    elif isinstance(t, ListOf) and type(value) is list:
        for v in value:
            yield from _undeclared(v, t.item, path)


def _written_by_stepprof(tmp_path, gpu):
    """Records that stepprof's own writers wrote: a profiled run (fake GPU: memory, syncs, allocator,
    FLOPs given) and a CPU sweep, and the fixtures modelled on the peak and ranks writers."""
    log = str(tmp_path / "run.jsonl")
    with make(log, gpu, flops_per_step=10**9, memory_every=1) as prof:
        for _ in range(4):
            with prof.step(batch_size=8):
                with prof.measure("forward"):
                    gpu.launch(1.0)
                with prof.measure("backward"):
                    with prof.measure("allreduce"):
                        gpu.launch(0.5)
    import torch

    sweep_log = str(tmp_path / "sweep.jsonl")
    stepprof.sweep(lambda x: x.sum(), lambda n: torch.ones(n, 4), max_batch=4, progress=False, min_time_s=0,
                   log=sweep_log)
    return [*stepprof.read(log), *stepprof.read(sweep_log), readerlogs.peak_record(3), readerlogs.ranks_record(3)]


def test_the_writers_write_only_declared_fields(tmp_path, gpu, nvml):
    records = _written_by_stepprof(tmp_path, gpu)
    assert {r["kind"] for r in records} == RECORD_KINDS
    for r in records:
        assert list(_undeclared(r, Obj(RECORDS[r["kind"]].fields))) == [], r["kind"]


def test_what_the_writers_write_reads_back_unchanged(tmp_path, gpu, nvml):
    from stepprof._sanitise import sanitise

    for r in _written_by_stepprof(tmp_path, gpu):
        before = repr(r)
        assert repr(sanitise(r)) == before, r["kind"]


def test_free_fields_are_only_where_another_writer_chose_the_shape():
    free = [(kind, f.name) for kind, r in RECORDS.items() for f in _walk(r.fields) if f.type is FREE]
    assert free == [("flops", "calibration")]


def test_the_summary_object_the_record_and_the_aggregate_read_the_declared_fields(gpu):
    """The summary's fields are declared once (``RECORDS["summary"]``): ``stepprof.Summary`` has
    an attribute for each and no other, ``summary_record`` writes them in the declared order,
    and the aggregate gives a value for each (``log`` is the profiler's); the nested
    ``Percentiles`` and ``PhaseFigures`` are the declared objects."""
    import attrs

    from stepprof._aggregate import RunAggregate
    from stepprof._schema import summary_keys

    table = summary_keys()
    attrs_of_summary = {f.name for f in attrs.fields(stepprof.Summary)}
    assert {attr for _, attr, _ in table} == attrs_of_summary
    assert set(RunAggregate().summary_fields()) | {"log"} == attrs_of_summary
    declared = RECORDS["summary"]
    assert [f.name for f in attrs.fields(stepprof.Percentiles)] == [
        f.name for f in declared.field("wall_ms_percentiles").type.fields]
    assert [f.name for f in attrs.fields(stepprof.PhaseFigures)] == [
        f.name for f in declared.field("phases").type.value.fields]
    with make(None, gpu) as prof:
        with prof.step():
            gpu.launch(1.0)
    record = prof.summary.to_record()
    assert [k for k in record if k != "kind"] == [key for key, _, _ in table if key in record]
    assert {key for key, _, optional in table if not optional} <= set(record)
