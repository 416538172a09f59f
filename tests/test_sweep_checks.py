"""stepprof._sweep.checks: bad arguments and batches of the wrong size."""

from __future__ import annotations

import pytest
import torch

import stepprof


# -- bad input ------------------------------------------------------------------------------


def _ok_step(batch):
    pass


def _ok_batch(n):
    return torch.zeros(n, 1)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"start": 0}, stepprof.ConfigError, r"'start' must be >= 1 \(got 0\)"),
    ({"start": 2.5}, stepprof.ConfigError, r"'start' must be an int >= 1 \(got 2.5\)"),
    ({"start": True}, stepprof.ConfigError, r"'start' must be an int"),
    ({"start": 64, "max_batch": 32}, stepprof.ConfigError, r"'max_batch' must be >= 'start' \(64\) \(got 32\)"),
    ({"max_batch": 0}, stepprof.ConfigError, r"'max_batch' must be >= 1 \(got 0\)"),
    ({"time_budget_s": -1}, stepprof.ConfigError, r"'time_budget_s' must be a finite number of seconds > 0 \(got -1\)"),
    ({"time_budget_s": 0}, stepprof.ConfigError, r"'time_budget_s'.*\(got 0\)"),
    ({"time_budget_s": float("nan")}, stepprof.ConfigError, r"'time_budget_s'.*\(got nan\)"),
    ({"warmup": -1}, stepprof.ConfigError, r"'warmup' must be >= 0 \(got -1\)"),
    ({"steps": 0}, stepprof.ConfigError, r"'steps' must be >= 1 \(got 0\)"),
    ({"steps": 5, "max_steps": 4}, stepprof.ConfigError, r"'max_steps' must be >= 5 \(got 4\)"),
    ({"min_time_s": -0.1}, stepprof.ConfigError, r"'min_time_s'.*\(got -0.1\)"),
    ({"knee_within": 1.5}, stepprof.ConfigError, r"'knee_within'.*\(got 1.5\)"),
    ({"progress": "yes"}, stepprof.ConfigError, r"'progress'.*\(got 'yes'\)"),
    ({"restore": (object(),)}, stepprof.ConfigError, r"'restore' takes objects with state_dict"),
    ({"device": "gpu0"}, stepprof.ConfigError, r"'device'.*\(got 'gpu0'\)"),
])
def test_bad_arguments_name_the_value(kwargs, error, match):
    kwargs.setdefault("progress", False)
    with pytest.raises(error, match=match):
        stepprof.sweep(_ok_step, _ok_batch, **kwargs)


def test_non_callables_are_usage_errors():
    with pytest.raises(stepprof.UsageError, match=r"'train_step' must be callable \(got None\) \(did you call it"):
        stepprof.sweep(None, _ok_batch)
    with pytest.raises(stepprof.UsageError, match=r"'make_batch' must be callable \(got tensor"):
        stepprof.sweep(_ok_step, torch.zeros(3, 1))
    with pytest.raises(TypeError):                  # UsageError is a TypeError
        stepprof.sweep(_ok_step, 5)


@pytest.mark.parametrize(("make_batch", "match"), [
    (lambda n: torch.zeros(2 * n, 3), r"make_batch\(1\) returned a batch of 2 samples"),
    (lambda n: (torch.zeros(n + 1, 3), torch.zeros(n + 1)), r"make_batch\(1\) returned a batch of 2 samples"),
    (lambda n: {"x": torch.zeros(7, 3)}, r"make_batch\(1\) returned a batch of 7 samples"),
    (lambda n: ["a"] * (n + 2), r"make_batch\(1\) returned a list of 3 items, not 1"),
    (lambda n: {"text": ["a"] * 5}, r"make_batch\(1\) returned a dict whose lists hold \[5\] items"),
    (lambda n: None, r"make_batch\(1\) returned None"),
])
def test_a_batch_of_the_wrong_size_is_rejected(make_batch, match):
    with pytest.raises(stepprof.ConfigError, match=match):
        stepprof.sweep(_ok_step, make_batch, progress=False)


def test_batches_whose_size_cannot_be_known_are_accepted():
    r = stepprof.sweep(_ok_step, lambda n: object(), max_batch=2, progress=False, min_time_s=0)
    assert r.max_fit == 2
    # A tuple of tensors where some other tensor has another leading size is fine.
    r = stepprof.sweep(_ok_step, lambda n: (torch.zeros(n, 3), torch.zeros(5)), max_batch=2,
                       progress=False, min_time_s=0)
    assert r.max_fit == 2


def test_a_list_of_n_samples_is_a_batch_of_n():
    # torchvision's detection models take a list of n images and a list of n target dicts.
    def make_batch(n):
        images = [torch.randn(3, 8, 8) for _ in range(n)]
        targets = [{"boxes": torch.rand(2, 4), "labels": torch.ones(2)} for _ in range(n)]
        return images, targets

    r = stepprof.sweep(_ok_step, make_batch, max_batch=4, progress=False, min_time_s=0)
    assert r.max_fit == 4
    r = stepprof.sweep(_ok_step, lambda n: [torch.randn(5) for _ in range(n)], max_batch=4,
                       progress=False, min_time_s=0)
    assert r.max_fit == 4
    with pytest.raises(stepprof.ConfigError, match=r"make_batch\(1\) returned a batch of 3 samples"):
        stepprof.sweep(_ok_step, lambda n: [torch.randn(3, 8, 8) for _ in range(n + 1)], progress=False)


def test_an_unwritable_log_fails_before_any_trial(tmp_path):
    calls = []
    with pytest.raises(stepprof.ConfigError, match="'log' cannot be written"):
        stepprof.sweep(calls.append, _ok_batch, log=tmp_path / "missing" / "x.jsonl", progress=False)
    assert calls == []
