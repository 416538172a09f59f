"""stepprof._validate: every bad argument is named with its value and the fix."""

from __future__ import annotations

import os

import pytest

import stepprof
from stepprof import _validate


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"warmup": -1}, r"'warmup' must be >= 0 \(got -1\)"),
        ({"warmup": "3"}, r"'warmup' must be an int >= 0 \(got '3'\)"),
        ({"warmup": True}, r"'warmup' must be an int"),
        ({"device": "gpu0"}, r"'device' must name a torch device.*'gpu0'"),
        ({"nvtx": "yes"}, r"'nvtx' must be True or False"),
    ],
)
def test_bad_profiler_arguments(log, kwargs, match):
    with pytest.raises(stepprof.ConfigError, match=match):
        stepprof.Profiler(log, **kwargs)


@pytest.mark.parametrize("bad", [b"run.jsonl", 3])
def test_a_log_that_is_not_a_str_path_fails_at_construction(tmp_path, monkeypatch, bad):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(stepprof.ConfigError, match=rf"'log' must be a str path or None \(got {bad!r}\)"):
        stepprof.Profiler(bad)
    assert not os.listdir(tmp_path)        # nothing opened: a bytes path used to fail at close()


def test_unwritable_log_fails_at_construction(tmp_path):
    bad = tmp_path / "no" / "such" / "dir" / "run.jsonl"
    with pytest.raises(stepprof.ConfigError, match=r"'log' cannot be written: .*run.jsonl.*writable"):
        stepprof.Profiler(bad)
    assert isinstance(stepprof.ConfigError("x"), ValueError)


@pytest.mark.parametrize("bs, match", [(0, r"got 0"), (-2, r"got -2"), ("8", r"got '8'"), (2.5, r"got 2.5")])
def test_bad_batch_size(bs, match):
    with pytest.raises(stepprof.ConfigError, match=r"'batch_size' must be a positive int.*" + match):
        stepprof.profile_step(batch_size=bs)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: stepprof.profile_step(8), r"'name' must be a str or None \(got 8\); .*batch_size=8"),
        (lambda: stepprof.profile_step(batch_size=0), r"\(got 0\); pass the number of samples"),
        (lambda: stepprof.profile_step(batch_size=True), r"\(got True\); pass the number of samples"),
    ],
)
def test_bad_step_arguments_name_the_fix(call, match):
    with pytest.raises(stepprof.StepprofError, match=match):
        call()


def test_bad_environment_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("STEPPROF_WARMUP", "many")
    with pytest.raises(stepprof.ConfigError, match="STEPPROF_WARMUP must be an int >= 0 \\(got 'many'\\)"):
        with stepprof.profile_step():
            pass
    monkeypatch.setenv("STEPPROF_WARMUP", "0")
    monkeypatch.setenv("STEPPROF_LOG", str(tmp_path / "missing" / "x.jsonl"))
    with pytest.raises(stepprof.ConfigError, match="STEPPROF_LOG: 'log' cannot be written"):
        with stepprof.profile_step():
            pass


@pytest.mark.parametrize("kwargs", [{"flops": "yes"}, {"flops_per_step": -1}, {"flops": "auto", "flops_per_step": 10}])
def test_bad_arguments_fail_before_the_log_is_opened(log, kwargs):
    """A rejected Profiler neither creates its log nor keeps a file descriptor open."""
    fds = set(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    with pytest.raises(stepprof.ConfigError):
        stepprof.Profiler(log, **kwargs)
    assert not os.path.exists(log)
    if fds is not None:
        assert set(os.listdir("/proc/self/fd")) <= fds


def test_the_checks_do_not_import_torch():
    """stepprof.read checks its log path with _validate, and starts without torch."""
    import subprocess
    import sys

    code = "import sys, stepprof._validate, stepprof._log; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize(
    "given, match",
    [
        ({"wramup": 3}, r"configure\(\) got an unknown option 'wramup'; did you mean 'warmup'\? the options are log, warmup"),
        ({"colour": 1}, r"unknown option 'colour'; the options are log, warmup, .*, group$"),
    ],
)
def test_an_unknown_option_names_the_argument_and_the_valid_names(given, match):
    with pytest.raises(stepprof.UsageError, match=match):
        _validate.check_option_names(given, ("log", "warmup", "device", "group"), "configure()")
