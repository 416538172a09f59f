"""The public API as a user meets it: the surface, configure, the log, the demo."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import stepprof



def steps(log):
    return list(stepprof.read(log, kind="step"))


def test_all_is_exactly_the_public_surface():
    public = {n for n in dir(stepprof) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(stepprof, n)).__name__ == "module"}
    assert sorted(stepprof.__all__) == stepprof.__all__
    assert set(stepprof.__all__) == public - modules
    assert stepprof.__all__ == [
        "BuildError", "ConfigError", "MemoryReport", "MissingExtraError", "PeakExplanation", "Percentiles", "PhaseFigures", "Profiler", "SCHEMA_VERSION",
        "StepprofError", "StepprofWarning",
        "Summary", "SweepPoint", "SweepResult", "SyncBudgetExceeded", "UsageError", "configure",
        "explain_peak", "frame", "iterate", "measure", "memory_report", "profile_step", "read", "sweep",
    ]


def test_dir_shows_only_the_public_names():
    """dir() lists the public surface, not the lazy loader's helpers or the private modules."""
    from stepprof import _registry  # noqa: F401 - importing a private module sets an attribute

    assert stepprof.__version__ and stepprof._registry is not None
    assert dir(stepprof) == sorted([*stepprof.__all__, "__version__"])


def test_the_readme_example_runs_on_cpu(log):
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [torch.randn(4, 8) for _ in range(5)]
    with stepprof.Profiler(log, warmup=3) as prof:
        for batch in loader:
            with stepprof.profile_step(batch_size=len(batch)):
                with stepprof.measure("forward"):
                    loss = model(batch).square().mean()
                with stepprof.measure("backward"):
                    loss.backward()
                with stepprof.measure("optimizer"):
                    opt.step()
                    opt.zero_grad()
    recs = steps(log)
    assert [r["warmup"] for r in recs] == [True] * 3 + [False] * 2
    assert all(set(r["phases"]) == {"forward", "backward", "optimizer"} for r in recs)
    assert prof.summary.measured_steps == 2


def test_sync_budget_exceeded_survives_pickle_and_copy():
    """Exceptions cross process boundaries pickled (multiprocessing, ProcessPoolExecutor)."""
    import copy
    import pickle

    e = stepprof.SyncBudgetExceeded("over budget", where="train.py:12", kind="item", count=2)
    for back in (pickle.loads(pickle.dumps(e)), copy.copy(e)):
        assert type(back) is stepprof.SyncBudgetExceeded and str(back) == "over budget"
        assert (back.where, back.kind, back.count) == ("train.py:12", "item", 2)


def test_configure_sets_the_default_profiler(tmp_path):
    first, second = str(tmp_path / "1.jsonl"), str(tmp_path / "2.jsonl")
    p1 = stepprof.configure(log=first, warmup=1)
    for _ in range(2):
        with stepprof.profile_step():
            pass
    p2 = stepprof.configure(log=second)
    assert p1.closed and not p2.closed      # the old default was closed and summarised
    assert [r["warmup"] for r in steps(first)] == [True, False]
    assert len(list(stepprof.read(first, kind="summary"))) == 1
    with pytest.raises(stepprof.ConfigError, match="'warmup' must be >= 0"):
        stepprof.configure(log=second, warmup=-1)


def test_autocast_and_real_cpu_training(log):
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.AdamW(model.parameters())
    with stepprof.Profiler(log) as prof:
        for _ in range(3):
            with prof.step(batch_size=8):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    with prof.measure("forward"):
                        loss = model(torch.randn(8, 16)).float().pow(2).mean()
                with prof.measure("backward"):
                    loss.backward()
                with prof.measure("optimizer"):
                    opt.step()
                    opt.zero_grad()
    assert prof.summary.measured_steps == 3


def test_demo_command_runs(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "stepprof", "demo", "--steps", "12", "--warmup", "2",
         "--log", str(tmp_path / "demo.jsonl"), "--device", "cpu"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "10 measured steps" in out.stdout and "loss" in out.stdout
    recs = list(stepprof.read(tmp_path / "demo.jsonl"))
    assert recs[-1]["kind"] == "summary" and len(recs) == 13


def test_demo_measures_the_device_it_trains_on(tmp_path, monkeypatch):
    """``--device cuda:1`` trains on cuda:1: the profiler must measure cuda:1 too, not the current
    device (cuda:0), whose events and allocator see none of the demo's work."""
    from stepprof import _demo

    seen = []

    class Spy(stepprof.Profiler):
        def __init__(self, *args, **kwargs):
            seen.append(kwargs.get("device"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(_demo, "Profiler", Spy)
    _demo.run_demo(steps=2, warmup=0, log=str(tmp_path / "demo.jsonl"), device="cpu", out=lambda _: None)
    assert seen == [torch.device("cpu")]


@pytest.mark.parametrize(
    "device", ["foo", "cuda", "cuda:0", "xpu"], ids=["typo", "cuda-absent", "cuda0-absent", "other-type"]
)
def test_demo_rejects_a_device_it_cannot_train_on_naming_the_argument(device, tmp_path, monkeypatch, capsys):
    """A bad --device is a usage error (exit 2) that names the option, the value and the fix,
    before any training or log: not a torch traceback."""
    from stepprof import _cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    log = tmp_path / "demo.jsonl"
    with pytest.raises(SystemExit) as exc:
        _cli.main(["demo", "--steps", "2", "--log", str(log), "--device", device])
    out, err = capsys.readouterr()
    assert exc.value.code == 2
    assert "--device" in err and repr(device) in err and "--device cpu" in err
    assert "Traceback" not in err and out == ""
    assert not log.exists()


def test_demo_rejects_a_negative_warmup_before_it_starts(tmp_path, capsys):
    from stepprof import _cli

    log = tmp_path / "demo.jsonl"
    with pytest.raises(SystemExit) as exc:
        _cli.main(["demo", "--warmup", "-1", "--log", str(log)])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == "" and not log.exists()
    assert "--warmup must be >= 0 (got -1)" in err and "--warmup 0" in err


@pytest.mark.parametrize(
    "argv", [["demo", "--steps", "0"], ["demo", "--device", "foo"], ["plot", "x.jsonl", "-o", "x.png", "--run", "-1"]]
)
def test_a_subcommand_argument_error_shows_that_subcommand_usage(argv, capsys):
    """As argparse does for `--steps abc`: the usage and the prefix are the subcommand's, not
    the top level's `usage: stepprof [-h] COMMAND ...`, which names none of its options."""
    from stepprof import _cli

    with pytest.raises(SystemExit) as exc:
        _cli.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.startswith(f"usage: stepprof {argv[0]} ") and f"\nstepprof {argv[0]}: error: " in err

