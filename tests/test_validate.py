"""stepprof._validate: every bad argument is named with its value and the fix."""

from __future__ import annotations

import os

import pytest
import torch

import stepprof
from stepprof import _dist, _validate


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
    with pytest.raises(stepprof.ConfigError, match=rf"'log' must be a path \(a str or an os.PathLike\) or None \(got {bad!r}\)"):
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


# -- integers: one check serves the profiler's, the step's and the sweep's ---------------------


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: _validate.check_warmup(-1), "'warmup' must be >= 0 (got -1); pass 0 to keep every step"),
        (lambda: _validate.check_warmup("3"), "'warmup' must be an int >= 0 (got '3'); pass e.g. warmup=3"),
        (lambda: _validate.check_memory_every(-5, "every"),
         "'every' must be an int >= 0 (got -5); pass e.g. every=1000, or 0 to write no periodic memory record"),
        (lambda: _dist.check_ranks_every(1.0),
         "'ranks_every' must be an int >= 0 (got 1.0); pass e.g. ranks_every=100, or 0 to turn the "
         "cross-rank exchange off"),
        (lambda: _validate.check_max_syncs(-1),
         "'max_syncs' must be an int >= 0 or None (got -1); pass e.g. max_syncs=0 to require sync-free steps"),
        (lambda: _validate.check_max_syncs(True),
         "'max_syncs' must be an int >= 0 or None (got True); pass e.g. max_syncs=0 to require sync-free steps"),
        (lambda: _validate.check_int(3, "max_steps", 5, "max_steps bounds the timed steps"),
         "'max_steps' must be >= 5 (got 3); max_steps bounds the timed steps"),
        (lambda: _validate.check_int(None, "steps", 1, "pass e.g. steps=3"),
         "'steps' must be an int >= 1 (got None); pass e.g. steps=3"),
    ],
)
def test_the_integer_checks_say_what_the_value_misses(call, message):
    with pytest.raises(stepprof.ConfigError) as e:
        call()
    assert str(e.value) == message


def test_a_good_integer_comes_back_unchanged():
    assert _validate.check_warmup(0) == 0
    assert _validate.check_count(7, "n", "") == 7
    assert _validate.check_max_syncs(None) is None
    assert _validate.check_int(5, "steps", 5, "") == 5


# -- the sweep: sweep(...) and the batches its make_batch returns -----------------------------


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


# -- the command line ---------------------------------------------------------------------------


def test_the_cli_checks_name_a_cuda_device_this_machine_lacks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(stepprof.ConfigError, match=r"^--device 'cuda:2': this machine has 2 CUDA device\(s\), "
                       r"cuda:0 to cuda:1; pass one of those, or --device cpu$"):
        _validate.check_demo_options(1, 0, "cuda:2")
    _validate.check_demo_options(1, 0, "cuda:1")
    with pytest.raises(stepprof.ConfigError, match=r"^'--device' must be 0\.\.1 \(got 2\)$"):
        _validate.check_calibrate_device(2)
    assert _validate.check_calibrate_device(1) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is not available")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_a_cuda_device_without_cuda_is_refused_not_recorded_as_the_cpu(tmp_path, device):
    log = tmp_path / "run.jsonl"
    with pytest.raises(stepprof.ConfigError, match=r"'device' is 'cuda(:\d)?', but CUDA is not available here .*pass device='cpu'"):
        stepprof.Profiler(str(log), device=device)
    assert not log.exists()  # refused before the log opens


@pytest.mark.cuda
def test_a_cuda_device_past_the_visible_ones_is_refused(tmp_path):
    n = torch.cuda.device_count()
    with pytest.raises(stepprof.ConfigError, match=rf"sees {n} CUDA device\(s\): pass device='cuda:0' to 'cuda:{n - 1}'"):
        stepprof.Profiler(None, device=f"cuda:{n}")


def test_an_empty_name_is_refused_for_a_step_and_a_phase():
    with pytest.raises(stepprof.UsageError, match=r"'name' must not be empty \(got ''\); pass a name such as 'forward'"):
        stepprof.measure("")
    prof = stepprof.Profiler(None, device="cpu")
    with pytest.raises(stepprof.UsageError, match="must not be empty"):
        prof.step(name="")
    with prof.step(name="ok"):
        pass
    assert prof.close().steps == 1
