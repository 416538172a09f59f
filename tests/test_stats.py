"""stepprof._stats: the quantile, and the bounded QuantileSketch the report and the summary use."""

from __future__ import annotations

import random

import stepprof
from stepprof._stats import QuantileSketch, median, quantile


def test_quantile_and_median_interpolate_like_numpy():
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert median([4.0, 1.0, 3.0]) == 3.0


def test_dist_is_exact_below_its_buffer_and_close_beyond():
    rng = random.Random(1)
    xs = [rng.lognormvariate(0, 1) for _ in range(1000)]
    d = QuantileSketch()
    for x in xs:
        d.add(x)
    d.settle()
    assert d.exact
    assert d.quantile(0.5) == stepprof.Percentiles.of(xs).median
    big = [rng.random() for _ in range(300_000)]
    d = QuantileSketch()
    for i, x in enumerate(big):
        d.add(x)
        if i % 4096 == 0:
            d.settle()
    d.settle()
    assert not d.exact and d.count == len(big)
    s = sorted(big)
    for q in (0.1, 0.5, 0.9):
        v = d.quantile(q)
        rank = sum(1 for x in s if x <= v) / len(s)
        assert abs(rank - q) < 0.002
    assert d.max() == max(big)
    assert abs(d.count_above(0.9) - sum(1 for x in big if x > 0.9)) < 0.002 * len(big)
    # bounded: what it holds does not grow with the stream
    assert len(d.buf) + sum(len(level) for level in d.levels) < 4 * QuantileSketch.EXACT


def test_dist_merge_matches_one_stream():
    rng = random.Random(0)
    xs = [rng.lognormvariate(0, 1) for _ in range(3 * QuantileSketch.EXACT + 123)]
    whole, a, b = QuantileSketch(), QuantileSketch(), QuantileSketch()
    for i, x in enumerate(xs):
        whole.add(x)
        (a if i < len(xs) // 3 else b).add(x)
        if i % 4096 == 0:
            for d in (whole, a, b):
                d.settle()
    a.merge(b)
    assert a.count == whole.count == len(xs)
    exact = sorted(xs)
    for q in (0.1, 0.5, 0.9):
        true = exact[int(q * (len(xs) - 1))]
        rank = sum(1 for x in exact if x <= a.quantile(q)) / len(xs)
        assert abs(rank - q) < 0.002, (q, true, a.quantile(q))


def _filled(values: range) -> QuantileSketch:
    sketch = QuantileSketch()
    for x in values:
        sketch.add(float(x))
        sketch.settle()
    return sketch


def test_merging_a_sketch_compacted_deeper_than_this_one_keeps_every_value():
    # The later stretch compacted to level 2 while this one never compacted (an empty
    # sketch, or a short first byte range of a parallel read): merge used to index
    # levels it did not have (IndexError in `stepprof report` on a large multi-run log).
    n = 2 * QuantileSketch.EXACT
    for first in (range(0), range(10), range(QuantileSketch.EXACT)):
        a, b = _filled(first), _filled(range(len(first), len(first) + n))
        a.merge(b)
        total = len(first) + n
        assert a.count == total and a.max() == total - 1
        for q in (0.1, 0.5, 0.9):
            assert abs(a.quantile(q) / (total - 1) - q) < 0.002
        assert abs(a.count_above(0.5 * total) - total / 2) < 0.002 * total


def test_a_merged_sketch_survives_pickling_as_the_parallel_read_sends_it():
    import pickle

    a, b = _filled(range(5)), _filled(range(5, 3 * QuantileSketch.EXACT))
    a.merge(pickle.loads(pickle.dumps(b)))
    assert a.count == 3 * QuantileSketch.EXACT and not a.exact
