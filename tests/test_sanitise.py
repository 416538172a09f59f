"""The one sanitising pass (stepprof/_sanitise.py): what a hostile value becomes, for every reader."""

from __future__ import annotations

import copy
import sys

import orjson
import pytest

from stepprof._sanitise import FREE_ITEMS, INVALID, KEY_MAX, STR_MAX, sanitise

from . import logfixtures as fx
from . import readerlogs


def _step(**changes):
    r = fx.step_record(3, warmup=False, wall=7.0, gpu=6.5)
    r.update(changes)
    return r


def _deep(n: int):
    return orjson.loads("[" * n + "]" * n)


@pytest.mark.parametrize("field, value", [
    ("wall_ms", "7"), ("wall_ms", [7.0]), ("wall_ms", True), ("wall_ms", 1e305), ("wall_ms", -1.0),
    ("overhead_us", 1e306), ("data_wait_ms", 1e303), ("start_unix_s", 1e300), ("start_unix_s", -1e300),
    ("batch_size", 2**64 - 1), ("batch_size", 4096.5), ("batch_size", -1), ("peak_allocated_bytes", 2**63),
    ("peak_allocated_bytes", 1e300),
    ("gpu_busy", {"a": 1}), ("name", 5), ("warmup", 1), ("phases", 3), ("syncs", [1]), ("error", "boom"),
])
def test_a_declared_field_of_the_wrong_type_or_out_of_range_is_null_with_the_reason(field, value):
    r = sanitise(_step(**{field: value}))
    assert r[field] is None
    assert r["unavailable"][field].startswith(INVALID + " (")


def test_an_integral_float_in_an_int_field_is_read_as_its_int():
    r = sanitise(_step(batch_size=4096.0, step=7.0, peak_allocated_bytes=2.5e9))
    assert (r["batch_size"], r["step"], r["peak_allocated_bytes"]) == (4096, 7, 2_500_000_000)
    assert all(type(r[k]) is int for k in ("batch_size", "step", "peak_allocated_bytes"))
    assert r["unavailable"] == {}


def test_a_nested_field_is_null_and_its_reason_is_keyed_by_its_declared_path():
    r = _step()
    r["phases"]["forward"]["wall_ms"] = "x"
    r["syncs"]["sites"][0]["count"] = -3
    r["allocator"]["num_device_alloc"] = 1.5
    out = sanitise(r)
    assert out["phases"]["forward"]["wall_ms"] is None and out["phases"]["backward"]["wall_ms"] == 7.0 * 0.45
    assert out["syncs"]["sites"][0]["count"] is None and out["allocator"]["num_device_alloc"] is None
    assert {"phases.wall_ms", "syncs.sites.count", "allocator.num_device_alloc"} <= out["unavailable"].keys()


def test_a_signed_field_takes_a_negative_number_and_an_unsigned_one_does_not():
    m = dict(fx.memory_record(3, "periodic"), residual_bytes=-5, allocated_bytes=-5)
    out = sanitise(m)
    assert out["residual_bytes"] == -5 and out["allocated_bytes"] is None


@pytest.mark.parametrize("line", [
    {"kind": ["step"]}, {"kind": {"a": 1}}, {"kind": 3}, {"step": 1}, {},
    {"kind": "step", "step": "3"}, {"kind": "step", "step": 2**64 - 1}, {"kind": "step", "step": -1},
    {"kind": "step", "step": 3.5},
    {"kind": "step", "wall_ms": 1.0},
])
def test_a_record_without_a_usable_kind_or_step_index_is_dropped(line):
    assert sanitise(line) is None


def test_a_record_without_an_unavailable_map_gets_one_for_its_reasons():
    out = sanitise({"kind": "step", "step": 0, "wall_ms": "x"})
    assert out["unavailable"] == {"wall_ms": out["unavailable"]["wall_ms"]}


def test_an_invalid_reason_is_null_and_no_reason_is_given_for_it():
    out = sanitise(dict(readerlogs.peak_record(2), unavailable=[1]))
    assert out["unavailable"] is None
    out = sanitise(_step(unavailable={"gpu_ms": 5, "mfu": "fine"}))
    assert out["unavailable"] == {"gpu_ms": None, "mfu": "fine"}


def test_strings_and_keys_are_cut():
    r = _step(name="n" * 100_000)
    r["phases"] = {"p" * 1000: r["phases"]["forward"], "q" * 1000: r["phases"]["backward"], "short": {}}
    out = sanitise(r)
    assert out["name"] == "n" * (STR_MAX - 1) + "…"
    assert list(out["phases"]) == ["p" * (KEY_MAX - 1) + "…", "q" * (KEY_MAX - 1) + "…", "short"]


def test_a_container_over_its_declared_size_is_null():
    out = sanitise(_step(recompile_reasons=["why"] * 65))
    assert out["recompile_reasons"] is None and "at most 64 items" in out["unavailable"]["recompile_reasons"]


def test_undeclared_fields_are_kept_when_they_are_small_and_shallow():
    out = sanitise(_step(new_scalar=1.5, new_text="t", new_list=[1, [2, [3]]], new_map={"a": {"b": 1}},
                         new_pair=[1, [2, 3]],
                         new_big=list(range(FREE_ITEMS + 1)), new_int=2**64 - 1, **{"k" * 300: 1}))
    assert out["new_scalar"] == 1.5 and out["new_text"] == "t" and out["new_map"] == {"a": {"b": 1}}
    assert out["new_pair"] == [1, [2, 3]]
    assert out["new_list"] is None  # three levels deep: two at most
    assert out["new_big"] is None and out["new_int"] is None and "k" * 300 not in out
    assert "new_scalar" not in out["unavailable"]  # nothing said about what this version does not know


@pytest.mark.parametrize("depth", [300, 1000])
def test_deep_nesting_anywhere_never_recurses_and_never_reaches_a_reader(depth):
    r = _step()
    for key in list(r):
        if key not in ("kind", "step"):
            r[key] = _deep(depth)
    r["phases"] = {"forward": {"wall_ms": _deep(depth), "extra": _deep(depth)}}
    r["unknown"] = _deep(depth)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(100)  # the pass recurses only along the declaration
    try:
        out = sanitise(r)
    finally:
        sys.setrecursionlimit(limit)

    def depth_of(v):
        return 1 + max(map(depth_of, v.values() if type(v) is dict else v), default=0) if type(v) in (dict, list) else 0

    assert depth_of(out) <= 5


def test_every_kind_that_the_writers_write_reads_back_unchanged():
    for r in readerlogs.every_kind():
        assert sanitise(copy.deepcopy(r)) == r, r["kind"]


def test_a_kind_this_version_does_not_write_keeps_its_small_fields():
    out = sanitise({"kind": "from_the_future", "x": 1, "deep": _deep(10), "run_id": ["a"]})
    assert out == {"kind": "from_the_future", "x": 1, "deep": None, "run_id": None,
                   "unavailable": {"run_id": out["unavailable"]["run_id"]}}


def test_a_free_form_field_too_deep_is_null_with_the_reason_and_a_shallow_one_is_kept():
    flops = fx.flops_record(3)
    assert sanitise(copy.deepcopy(flops))["calibration"] == fx.CALIBRATION
    out = sanitise(dict(flops, calibration={"matmul_tflops": {"bf16": {"deeper": 1}}}))
    assert out["calibration"] is None and out["unavailable"]["calibration"].startswith(INVALID)
