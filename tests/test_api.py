"""The public API as a user meets it: surface, decorator/context forms, bad input, the log."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

import stepprof

from .conftest import make
from .fakes import FakeGpu


def steps(log):
    return list(stepprof.read(log, kind="step"))


def test_all_is_exactly_the_public_surface():
    public = {n for n in dir(stepprof) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(stepprof, n)).__name__ == "module"}
    assert sorted(stepprof.__all__) == stepprof.__all__
    assert set(stepprof.__all__) == public - modules
    assert stepprof.__all__ == [
        "ConfigError", "MemoryReport", "Percentiles", "Profiler", "SCHEMA_VERSION", "StepprofError",
        "Summary", "SweepPoint", "SweepResult", "SyncBudgetExceeded", "UsageError", "configure",
        "measure", "memory_report", "profile_step", "read", "sweep",
    ]


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


def test_measure_forms_step_outside_a_step_and_phase_inside(log, gpu):
    with make(log, gpu) as prof:

        @stepprof.measure
        def train_step(x):
            with stepprof.measure("forward"):
                return x + 1

        @stepprof.measure("named")
        def other():
            return "ok"

        @stepprof.measure()
        def third():
            return 3

        assert train_step(1) == 2 and train_step.__name__ == "train_step"
        assert other() == "ok" and third() == 3
        with prof.step("outer"):
            train_step(2)           # inside a step: a phase
    recs = steps(log)
    names = [r["name"] for r in recs]
    assert names[:3] == [
        "test_measure_forms_step_outside_a_step_and_phase_inside.<locals>.train_step",
        "named",
        "test_measure_forms_step_outside_a_step_and_phase_inside.<locals>.third",
    ]
    assert recs[0]["phases"].keys() == {"forward"}
    outer = recs[3]
    assert outer["name"] == "outer"
    key = "test_measure_forms_step_outside_a_step_and_phase_inside.<locals>.train_step"
    assert set(outer["phases"]) == {key, key + "/forward"}


def test_measured_function_that_raises_is_recorded(log, gpu):
    @stepprof.measure("boom")
    def boom():
        raise KeyError("k")

    with make(log, gpu):
        with pytest.raises(KeyError):
            boom()
    (r,) = steps(log)
    assert r["error"]["type"] == "KeyError"


def test_recursive_measured_function(log, gpu):
    @stepprof.measure("fib")
    def fib(n):
        return n if n < 2 else fib(n - 1) + fib(n - 2)

    with make(log, gpu):
        assert fib(5) == 5
    (r,) = steps(log)                # the outer call is the step, inner calls nest as phases
    assert r["name"] == "fib"
    assert r["phases"]["fib"]["count"] == 2


def test_measure_above_staticmethod_and_classmethod(log, gpu):
    class Model:
        @stepprof.measure
        @staticmethod
        def loss(x):
            return x + 1

        @stepprof.measure("make")
        @classmethod
        def make(cls, x):
            return cls, x

        @stepprof.measure
        @classmethod
        def name(cls):
            return cls.__name__

    with make(log, gpu) as prof:
        assert Model.loss(1) == 2 and Model().loss(1) == 2
        assert Model.make(3) == (Model, 3) and Model().make(3) == (Model, 3)
        assert Model.name() == "Model"
    assert prof.summary.steps == 5
    local = "test_measure_above_staticmethod_and_classmethod.<locals>.Model."
    assert [r["name"] for r in steps(log)] == [local + "loss"] * 2 + ["make"] * 2 + [local + "name"]


def test_profile_step_inside_a_step_is_a_clear_error(log, gpu):
    with make(log, gpu):
        with stepprof.profile_step("outer"):
            with pytest.raises(stepprof.UsageError, match="steps do not nest.*measure"):
                with stepprof.profile_step("inner"):
                    pass
    (r,) = steps(log)
    assert r["name"] == "outer" and r["error"] is None


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: stepprof.measure.__enter__(), "forget the brackets"),
        (lambda: stepprof.profile_step.__enter__(), "forget the brackets"),
        (lambda: stepprof.measure(123), "takes a name"),
        (lambda: stepprof.measure("x")(5), "decorates a function"),
        (lambda: stepprof.measure("x")(lambda: (yield)), "generator or coroutine"),
        (lambda: stepprof.profile_step(print), "'name' must be a str.*@stepprof.measure"),
    ],
)
def test_misuse_gets_a_hint(call, match):
    with pytest.raises(stepprof.UsageError, match=match):
        call()


def test_with_measure_without_brackets_is_hinted():
    with pytest.raises(stepprof.UsageError, match="forget the brackets"):
        with stepprof.measure:  # type: ignore[attr-defined]
            pass


def test_measure_as_context_needs_a_name(log, gpu):
    with make(log, gpu):
        with pytest.raises(stepprof.UsageError, match="needs a name"):
            with stepprof.measure():
                pass


def test_sync_budget_exceeded_survives_pickle_and_copy():
    """Exceptions cross process boundaries pickled (multiprocessing, ProcessPoolExecutor)."""
    import copy
    import pickle

    e = stepprof.SyncBudgetExceeded("over budget", where="train.py:12", kind="item", count=2)
    for back in (pickle.loads(pickle.dumps(e)), copy.copy(e)):
        assert type(back) is stepprof.SyncBudgetExceeded and str(back) == "over budget"
        assert (back.where, back.kind, back.count) == ("train.py:12", "item", 2)


def test_innermost_profiler_is_the_active_one(tmp_path, gpu):
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    with make(a, gpu):
        with stepprof.profile_step("in-a"):
            pass
        with make(b, gpu):
            with stepprof.profile_step("in-b"):
                pass
        with stepprof.profile_step("in-a-again"):
            pass
    assert [r["name"] for r in steps(a)] == ["in-a", "in-a-again"]
    assert [r["name"] for r in steps(b)] == ["in-b"]


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


def test_configure_takes_every_profiler_setting():
    """configure() and Profiler() take the same settings (the default profiler is not a lesser one)."""
    import inspect

    def names(fn):
        return {n for n in inspect.signature(fn).parameters if not n.startswith("_") and n != "self"}

    assert names(stepprof.configure) == names(stepprof.Profiler.__init__)


def test_environment_configures_the_default_profiler(tmp_path, monkeypatch):
    path = str(tmp_path / "env.jsonl")
    monkeypatch.setenv("STEPPROF_LOG", path)
    monkeypatch.setenv("STEPPROF_WARMUP", "1")
    for _ in range(2):
        with stepprof.profile_step():
            pass
    from stepprof import _api

    _api._default.close()
    assert [r["warmup"] for r in steps(path)] == [True, False]


def test_no_profiler_and_no_log_warns_once_and_still_runs():
    with pytest.warns(UserWarning, match="no log is configured"):
        with stepprof.profile_step():
            x = 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with stepprof.profile_step():
            x += 1
    assert x == 2


def test_other_threads_do_not_disturb_the_open_step(log, gpu):
    seen = []

    @stepprof.measure("worker")
    def work():
        seen.append(threading.get_ident())

    with make(log, gpu) as prof:
        with prof.step("main"):
            t = threading.Thread(target=work)
            t.start()
            t.join()
    (r,) = steps(log)
    assert seen and r["name"] == "main" and r["phases"] == {}


def test_each_thread_records_into_its_own_innermost_profiler(tmp_path):
    """Two threads, each with its own ``with Profiler``: the active profiler is per thread, so
    the first thread's steps do not go to the profiler the second thread opened meanwhile."""
    a_open, b_open, a_done = threading.Event(), threading.Event(), threading.Event()
    gpus = {"a": FakeGpu(), "b": FakeGpu()}
    summaries, errors = {}, []

    def run(name, opened, wait_for, done=None):
        try:
            with make(str(tmp_path / f"{name}.jsonl"), gpus[name]) as prof:
                opened.set()
                wait_for.wait(5)
                with stepprof.profile_step(name):
                    pass
                if done is not None:
                    done.set()
                elif not a_done.wait(5):
                    errors.append("thread a never finished its step")
            summaries[name] = prof.summary.steps
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ta = threading.Thread(target=run, args=("a", a_open, b_open, a_done))
    tb = threading.Thread(target=run, args=("b", b_open, a_open))
    ta.start()
    tb.start()
    ta.join()
    tb.join()
    assert not errors
    assert summaries == {"a": 1, "b": 1}
    assert [r["name"] for r in steps(str(tmp_path / "a.jsonl"))] == ["a"]
    assert [r["name"] for r in steps(str(tmp_path / "b.jsonl"))] == ["b"]


def test_log_lines_are_whole_and_flushed_while_running(log, gpu):
    prof = make(log, gpu)
    for _ in range(3):
        with prof.step():
            pass                     # device idle: each step completes at once
    with prof.step():
        pass
    deadline = time.monotonic() + 5
    while True:                      # read while the profiler is still open
        with open(log, "rb") as f:
            data = f.read()
        if data.count(b"\n") >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    # Three steps, and after the first (warmup=0) its after-warm-up memory record.
    assert data.endswith(b"\n") and data.count(b"\n") == 4
    assert data.count(b'"kind":"memory"') == 1
    prof.close()


def test_pandas_loads_a_log_as_is(log, gpu):
    pd = pytest.importorskip("pandas")
    with make(log, gpu) as prof:
        for _ in range(3):
            with prof.step(batch_size=4):
                with prof.measure("forward"):
                    gpu.launch(1.0)
    df = pd.read_json(log, lines=True)
    # The fake is a CUDA device: memory records follow the first step and precede the summary.
    assert list(df["kind"]) == ["step", "memory", "step", "step", "memory", "summary"]
    assert df.loc[df.kind == "step", "gpu_ms"].notna().all()


def test_read_skips_torn_lines_with_a_warning(log, gpu):
    with make(log, gpu) as prof:
        with prof.step():
            pass
    with open(log, "ab") as f:
        f.write(b'{"kind": "step", "step": 9, "wal')   # a crash mid-line (not by stepprof)
    with pytest.warns(RuntimeWarning, match="skipped 1 line"):
        kinds = [r["kind"] for r in stepprof.read(log)]
    assert kinds == ["step", "memory", "memory", "summary"]   # after warm-up, and at close


def test_a_run_appended_after_a_torn_last_line_loses_no_record(log, gpu):
    with open(log, "wb") as f:
        f.write(b'{"kind": "step", "step": 9, "wal')   # an earlier process died mid-line
    with make(log, gpu) as prof:
        for _ in range(2):
            with prof.step():
                pass
    with pytest.warns(RuntimeWarning, match="skipped 1 line"):
        kinds = [(r["kind"], r.get("step")) for r in stepprof.read(log)]
    assert kinds[:2] == [("step", 0), ("memory", 0)]     # the run's first line is whole
    assert [s for k, s in kinds if k == "step"] == [0, 1]


def test_a_write_cut_short_by_a_full_disk_leaves_whole_lines(tmp_path, monkeypatch):
    import errno

    from stepprof import _log

    path = tmp_path / "full.jsonl"
    writer = _log.JsonlWriter(path)
    writer.write({"kind": "step", "step": 0})
    real_write, calls = os.write, []

    def disk_fills_up(fd, data):       # as Linux does: a short write, then ENOSPC
        if fd != writer._fd:
            return real_write(fd, data)
        calls.append(len(data))
        if len(calls) == 1:
            first = bytes(data).index(b"\n") + 1
            return real_write(fd, bytes(data)[: first + 10])   # line 1 whole, 10 bytes of line 2
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(_log.os, "write", disk_fills_up)
        writer.write_many([{"kind": "step", "step": 1}, {"kind": "step", "step": 2}])
    assert writer.failed is not None and "No space left" in writer.failed
    data = path.read_bytes()
    assert data.endswith(b"\n")                        # no half line
    assert [r["step"] for r in stepprof.read(path)] == [0, 1]   # and nothing whole is lost


def test_failed_log_write_warns_and_training_goes_on(gpu):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    prof = make("/dev/full", gpu)
    with pytest.warns(RuntimeWarning, match="logging stopped"):
        for _ in range(3):
            with prof.step():
                pass
        s = prof.close()
    assert s.steps == 3 and "failed" in s.unavailable["log"]


def test_no_graph_break_inside_a_compiled_region(log, gpu):
    def f(x):
        with stepprof.measure("inside"):
            y = x.sin()
        return y.cos()

    measured = stepprof.measure("compiled-step")(lambda x: x.sin() * 2)
    with make(log, gpu):
        compiled = torch.compile(f, fullgraph=True, backend="eager")
        x = torch.randn(4)
        assert torch.allclose(compiled(x), f(x))
        compiled_measured = torch.compile(measured, fullgraph=True, backend="eager")
        assert torch.allclose(compiled_measured(x), x.sin() * 2)
        # Recommended form: measure outside torch.compile records a step per call.
        outer = stepprof.measure("outside")(torch.compile(lambda x: x.cos(), backend="eager"))
        outer(x)
        outer(x)
    names = [r["name"] for r in steps(log)]
    assert names == ["inside", "outside", "outside"]  # the eager call of f recorded one step


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


def test_interpreter_exit_flushes_the_default_profiler(tmp_path):
    path = tmp_path / "exit.jsonl"
    code = (
        "import stepprof\n"
        f"stepprof.configure(log={str(path)!r})\n"
        "for _ in range(3):\n"
        "    with stepprof.profile_step():\n"
        "        pass\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    kinds = [r["kind"] for r in stepprof.read(path)]
    assert kinds == ["step", "step", "step", "summary"]


def test_read_checks_its_arguments_at_the_call(tmp_path):
    with pytest.raises(stepprof.ConfigError, match=r"'path' must be the path of a stepprof log.*got None"):
        stepprof.read(None)
    with pytest.raises(stepprof.ConfigError, match=r"'kind' must be a record kind.*got \['step'\]"):
        stepprof.read(tmp_path / "x.jsonl", kind=["step"])


def test_read_warns_about_a_kind_stepprof_never_writes(tmp_path):
    log = tmp_path / "run.jsonl"
    with stepprof.Profiler(log) as prof:
        with prof.step():
            pass
    with pytest.warns(RuntimeWarning, match=r"no record of kind 'steps'.*of kind 'step', 'summary'"):
        assert list(stepprof.read(log, kind="steps")) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # a kind stepprof writes, absent here: no warning
        assert list(stepprof.read(log, kind="ranks")) == []
        assert len(list(stepprof.read(log, kind="step"))) == 1
