"""stepprof._options: Profiler's settings, their defaults and checks, written once."""

from __future__ import annotations

import inspect

import attrs
import pytest
import torch

import stepprof
from stepprof._options import NAMES, ProfilerOptions


def test_profiler_takes_exactly_the_options_with_their_defaults():
    """Profiler's documented signature and ProfilerOptions name the same settings, in the same
    order, with the same defaults (configure() takes them through ProfilerOptions)."""
    params = {
        n: p for n, p in inspect.signature(stepprof.Profiler.__init__).parameters.items()
        if not n.startswith("_") and n != "self"
    }
    assert tuple(params) == NAMES == tuple(f.name for f in attrs.fields(ProfilerOptions))
    for field in attrs.fields(ProfilerOptions):
        if params[field.name].default is not inspect.Parameter.empty:
            assert params[field.name].default == field.default, field.name


def test_options_convert_values_as_the_profiler_uses_them(tmp_path):
    opts = ProfilerOptions(tmp_path / "run.jsonl", device="cpu", flops_per_step=10)
    assert opts.log == str(tmp_path / "run.jsonl") and opts.device == torch.device("cpu")
    assert opts.flops_per_step == 10.0 and isinstance(opts.flops_per_step, float)
    assert ProfilerOptions() == ProfilerOptions(None, warmup=0)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        opts.warmup = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"warmup": -1}, r"'warmup' must be >= 0 \(got -1\)"),
        ({"syncs": "all"}, r"'syncs' must be one of 'warn', 'trace', 'off' \(got 'all'\)"),
        ({"flops": "auto", "flops_per_step": 10}, r"pass either flops='auto' .* not both"),
    ],
)
def test_options_check_as_the_profiler_does(kwargs, match):
    with pytest.raises(stepprof.ConfigError, match=match):
        ProfilerOptions(**kwargs)


def test_configure_takes_the_options_and_names_an_unknown_one(tmp_path):
    prof = stepprof.configure(log=str(tmp_path / "run.jsonl"), warmup=2, nvtx=False)
    assert prof.warmup == 2 and prof._options.nvtx is False
    with pytest.raises(stepprof.UsageError, match=r"configure\(\) got an unknown option 'warump'.*'warmup'"):
        stepprof.configure(warump=2)
    assert stepprof.configure().log is None  # log defaults to None, as Profiler's options do


def test_a_callback_profiles_the_framework_device_unless_told_otherwise():
    from stepprof.integrations._close import on_device

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 1)
    assert on_device({"warmup": 2}, cpu) == {"warmup": 2, "device": cpu}
    assert on_device({}, cuda) == {"device": cuda}
    assert on_device({"device": "cuda:0"}, cpu) == {"device": "cuda:0"}  # the user's wins
    assert on_device({}, torch.device("meta")) == {}  # not CPU or CUDA: the profiler chooses
    assert on_device({}, None) == {}
