"""stepprof._sweep.rules: the knee and the thrash zone, on hand-made points."""

from __future__ import annotations

import stepprof
from stepprof._sweep.rules import find_knee, find_thrash_zone


def test_a_noisy_dip_is_not_a_drop():
    pts = [
        _pt(1, 100.0, 10.0, p10=9.0), _pt(2, 190.0, 10.5, p10=10.0), _pt(4, 200.0, 20.0, p10=19.0),
        # 5% below the best at the median, but its fastest steps are as fast as the best's
        _pt(8, 185.0, 43.2, p10=39.0),
    ]
    assert find_thrash_zone(pts) is None
    pts[-1] = _pt(8, 150.0, 53.0, p10=52.0)
    assert find_thrash_zone(pts) == range(8, 9)


def _pt(n, sps, ms, *, p10=None, retries=0, oom=False):
    return stepprof.SweepPoint(
        trial=n, phase="grow", batch_size=n, oom=oom, samples_per_s=None if oom else sps,
        step_ms=None if oom else ms, step_ms_p10=p10, step_ms_p90=None, timed_steps=3,
        warmup_steps=1, peak_allocated_bytes=None, alloc_retries=retries, device_allocs=0,
        leaked_bytes=None, error=None, wall_s=0.1,
    )


def test_knee_is_the_smallest_batch_within_10_percent_of_the_best():
    pts = [_pt(1, 10.0, 1), _pt(2, 50.0, 1), _pt(4, 91.0, 1), _pt(8, 100.0, 1), _pt(16, 0, 0, oom=True)]
    assert find_knee(pts) == 4
    assert find_knee(pts, within=0.05) == 8
    assert find_knee([_pt(1, 0, 0, oom=True)]) is None
