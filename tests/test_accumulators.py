"""stepprof._accumulators: each accumulator's add and merge; merging two halves equals adding all."""

from __future__ import annotations

import pickle
import random
from typing import Any

import pytest

from stepprof._accumulators import (
    TABLE_CAP,
    Counter,
    Fields,
    First,
    FirstByKey,
    FirstN,
    Largest,
    Last,
    Max,
    Sketch,
    Sum,
    Table,
)


def _halves(make: Any, add: Any, xs: list[Any], cut: int) -> tuple[Any, Any]:
    """(all of ``xs`` added to one, the two halves at ``cut`` added apart and merged)."""
    whole, first, second = make(), make(), make()
    for x in xs:
        add(whole, x)
    for x in xs[:cut]:
        add(first, x)
    for x in xs[cut:]:
        add(second, x)
    first.merge(second)
    return whole, first


def _value(acc: Any) -> Any:
    return acc.value


RNG = random.Random(7)
NUMBERS = [RNG.randint(-50, 50) for _ in range(200)]
KEYS = [RNG.randrange(TABLE_CAP - 20) for _ in range(3000)]  # (a count past the cap is not kept alike)
CASES = {
    "sum": (Sum, lambda a, x: a.add(x), NUMBERS),
    "max": (Max, lambda a, x: a.add(x), NUMBERS),
    "first": (First, lambda a, x: a.add(x), NUMBERS),
    "last": (Last, lambda a, x: a.add(x), NUMBERS),
    "counter": (Counter, lambda a, x: a.add(x), KEYS),
    # more keys than a table keeps: the first ones are kept alike
    "first_by_key": (FirstByKey, lambda a, x: a.add(x % (TABLE_CAP + 40), x), list(range(5000))[::-7]),
    "first_n": (lambda: FirstN(10), lambda a, x: a.add(x), NUMBERS),
    "largest": (lambda: Largest(8), lambda a, x: a.add((x, -x)), NUMBERS),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("cut", [0, 1, 7, 100, 199, 200])
def test_merging_two_halves_equals_adding_all(name, cut):
    make, add, xs = CASES[name]
    whole, merged = _halves(make, add, xs, cut)
    if name == "largest":
        assert sorted(merged.value) == sorted(whole.value)
    else:
        assert merged.value == whole.value


def test_each_accumulator_adds_what_its_name_says():
    xs = [3, 9, 1, 9, 4]
    accs = {"sum": Sum(), "max": Max(), "first": First(), "last": Last(), "first_n": FirstN(2), "largest": Largest(2)}
    for x in xs:
        for name, acc in accs.items():
            acc.add((x, name) if name == "largest" else x)
    assert {name: acc.value for name, acc in accs.items() if name != "largest"} == {
        "sum": 26, "max": 9, "first": 3, "last": 4, "first_n": [3, 9]}
    assert sorted(x for x, _ in accs["largest"].value) == [9, 9]
    assert Sum().value == 0 and Max().value is None and Max(False).value is False
    flag = Max(False)
    flag.add(True)
    assert flag.value is True


def test_last_keeps_its_value_when_the_later_stretch_has_none():
    a, b = Last(), Last()
    a.add("x")
    a.merge(b)
    assert a.value == "x"
    b.add("y")
    a.merge(b)
    assert a.value == "y"


def test_a_counter_and_a_table_keep_only_cap_keys():
    counter = Counter(("a", "b"))
    assert counter.value == {"a": 0, "b": 0}
    for key in range(TABLE_CAP + 10):
        counter.add(key)
    counter.add("a", 5)
    assert len(counter.value) == TABLE_CAP and counter.value["a"] == 5 and TABLE_CAP - 1 not in counter.value
    unbounded = Counter(cap=float("inf"))
    for key in range(TABLE_CAP + 10):
        unbounded.add(key)
    assert len(unbounded.value) == TABLE_CAP + 10
    table = Table(Sum)
    for key in range(TABLE_CAP + 5):
        acc = table.at(key)
        if acc is not None:
            acc.add(2)
    assert len(table.value) == TABLE_CAP and table.at(TABLE_CAP) is None and table.at(0).value == 2


def test_a_table_merges_each_keys_accumulator():
    a, b, whole = Table(Sum), Table(Sum), Table(Sum)
    for i, key in enumerate(KEYS):
        (a if i < 1000 else b).at(key).add(1)
        whole.at(key).add(1)
    a.merge(b)
    assert {k: v.value for k, v in a.value.items()} == {k: v.value for k, v in whole.value.items()}


def test_largest_takes_only_what_it_would_keep():
    top = Largest(2)
    for x in (5, 1, 7):
        if top.takes(x):
            top.add((x,))
    assert sorted(top.value) == [(5,), (7,)]
    assert not top.takes(5) and top.takes(6)


@pytest.mark.parametrize("cut", [0, 1, 40_000, 69_999, 70_000])
def test_a_sketch_merged_from_halves_gives_the_quantiles_of_all(cut):
    rng = random.Random(3)
    xs = [rng.gauss(10, 2) for _ in range(70_000)]  # past Sketch.EXACT: compacted

    def add(sketch: Sketch, x: float) -> None:
        sketch.add(x)
        sketch.settle()

    whole, merged = _halves(Sketch, add, xs, cut)
    assert merged.value is merged and merged.count == whole.count == len(xs)
    for q in (0.1, 0.5, 0.9):
        assert merged.quantile(q) == pytest.approx(whole.quantile(q), rel=2e-3)


class _Pair(Fields):
    FIELDS = (("total", Sum), ("top", Max), ("names", Counter))
    __slots__ = tuple(name for name, _ in FIELDS)


def test_fields_merge_is_a_loop_over_the_declared_accumulators():
    a, b = _Pair(), _Pair()
    a.total.add(2), a.top.add(1), a.names.add("x")
    b.total.add(3), b.top.add(4), b.names.add("x"), b.names.add("y")
    a.merge(b)
    assert (a.total.value, a.top.value, a.names.value) == (5, 4, {"x": 2, "y": 1})


def test_accumulators_have_slots_and_pickle():
    pair = _Pair()
    pair.names.add("x")
    for acc in (Sum(), Max(), First(), Last(), Counter(), FirstByKey(), FirstN(3), Largest(3), Table(Sum), Sketch(),
                pair):
        assert not hasattr(acc, "__dict__")
        back = pickle.loads(pickle.dumps(acc))
        assert type(back) is type(acc)
    assert pickle.loads(pickle.dumps(pair)).names.value == {"x": 1}
