"""The spike diagnosis (issue 28, item 2): a period only for spikes that really recur, no
"host noise" beside it, and lists that say when they are cut."""

from __future__ import annotations

import pytest

from stepprof._report import build_report, render
from stepprof._report.diagnose import spike_period

from . import logfixtures as fx


@pytest.mark.parametrize("steps, period", [
    ([14, 20, 29], None),              # gaps 6 and 9 share 3, but no spacing: the case
    ([10, 20, 30], 10),
    ([100, 200, 300, 400], 100),
    ([10, 20, 40, 50], 10),            # one spike stayed under the threshold: a gap of 2P
    ([10, 20], None),                  # two spikes are not several
    ([10, 11, 12], None),              # consecutive steps: a stretch, not a period
    ([10, 20, 70, 80], None),          # a gap past 3P
    ([10, 20, 30, 50, 70, 90], None),  # fewer than half of the gaps are P
    ([5, 25, 45, 65, 95], None),       # a gap of 30 is no multiple of 20
])
def test_a_period_is_claimed_only_for_spikes_on_evenly_spaced_steps(steps, period):
    assert spike_period(steps) == period


def _log(tmp_path, spikes_at, n=40, name="run"):
    records = [fx.step_record(i, warmup=i < 2, wall=20.0 if i in spikes_at else 5.0, gpu=None, syncs=False)
               for i in range(n)]
    return fx.write(str(tmp_path / f"{name}.jsonl"), records)


def _spikes_text(log):
    text = render(build_report([log]))
    assert "Spikes: steps far above the median" in text
    return text


def test_spikes_at_uneven_steps_claim_no_period_and_are_host_noise(tmp_path):
    text = _spikes_text(_log(tmp_path, {14, 20, 29}))
    assert "recur every" not in text and "host noise" in text


def test_spikes_that_recur_name_the_period_and_not_host_noise(tmp_path):
    text = _spikes_text(_log(tmp_path, {15, 25, 35}))
    assert "they recur every 10 steps: periodic work inside the step" in text
    assert "host noise" not in text


def test_a_long_spike_list_says_how_many_it_leaves_out(tmp_path):
    spikes = set(range(14, 40, 2))  # 13 later spikes
    text = _spikes_text(_log(tmp_path, spikes, n=60))
    line = next(line for line in text.splitlines() if "later: steps" in line)
    assert line.count(" ms)") == 6 and line.rstrip().endswith("and 7 more")
    assert "13 step(s) took more than 3x the median" in text
