"""Values that JSON cannot hold, in every user-supplied field: the log keeps every record.

A lone surrogate (a file name from ``os.listdir`` that is not UTF-8, in an exception message,
a step name or a source file's path), an int outside 64 bits, NaN or an infinity, a non-str key:
the writer repairs the record that holds one, lists the paths it changed in ``encoding_replaced``,
and writes every other record as is.  A value a validator refuses is refused at the call, with
the argument and the fix.  ``stepprof report`` and ``stepprof.read`` read the resulting logs.
"""

from __future__ import annotations

import enum
import json
import os
import re
import runpy
import warnings

import orjson
import pytest
import torch

import stepprof
from stepprof._fields import RECORDS, UNITS
from stepprof._sanitise import INVALID
from stepprof import _syncs
from stepprof._log import JsonlWriter
from stepprof._sweep.search import sweep_on

from . import fake_torch
from .conftest import make
from .fake_torch import FakeTensor
from .fakes import FakeSweepGpu

BAD_NAME = os.fsdecode(b"run_\xff.jsonl")     # what os.listdir gives for a non-UTF-8 name


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def lines(path: str) -> list[dict]:
    """Every line of the log, parsed by the standard library, strictly: bytes that are not
    UTF-8, and NaN or Infinity (which json.loads takes by default), fail the test."""
    with open(path, "rb") as f:
        data = f.read()
    assert data.endswith(b"\n")
    return [json.loads(line.decode("utf-8"), parse_constant=_not_json) for line in data.splitlines()]


def test_unencodable_step_fields_cost_no_other_record_and_later_steps_are_written(log):
    """A real CPU Profiler: surrogates in a step name, a phase name and an error; batch_size=2**64."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # no "stepprof stopped recording after an internal error"
        with stepprof.Profiler(log) as prof:
            for i in range(8):
                name = "step\udcff" if i == 2 else "step"
                try:
                    with prof.step(name=name, batch_size=2**64 if i == 4 else 8):
                        with prof.measure("fwd\udce9" if i == 3 else "fwd"):
                            pass
                        if i == 1:
                            raise FileNotFoundError(f"no such file: {BAD_NAME} \ud800")
                except FileNotFoundError:
                    pass
    records = lines(log)
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(8))      # every step, in order
    assert records[-1]["kind"] == "summary" and records[-1]["steps"] == 8
    # The summary's per-phase figures are keyed by the phase names: the bad one is repaired there too.
    assert records[-1]["encoding_replaced"] == ["phases.fwd\ufffd"] and "fwd\ufffd" in records[-1]["phases"]
    assert steps[1]["error"] == {"type": "FileNotFoundError", "message": "no such file: run_\ufffd.jsonl \ufffd"}
    assert steps[1]["encoding_replaced"] == ["error.message"]
    assert steps[2]["name"] == "step\ufffd" and steps[2]["encoding_replaced"] == ["name"]
    assert "fwd\ufffd" in steps[3]["phases"] and steps[3]["encoding_replaced"] == ["phases.fwd\ufffd"]
    assert steps[4]["batch_size"] == str(2**64) and steps[4]["encoding_replaced"] == ["batch_size"]
    for r in (steps[0], *steps[5:]):                          # the others are as they always were
        assert "encoding_replaced" not in r and r["name"] == "step" and r["batch_size"] == 8


def test_one_bad_record_in_a_batch_costs_no_other(log):
    good = [{"kind": "step", "step": i, "x": [1.5, None, {"y": "ok"}]} for i in range(3)]
    bad = {"kind": "step", "step": 9, "name": "a\udcffb", "deep": [{"big": -(2**70), 3: "k"}]}
    records = [good[0], bad, good[1], good[2]]
    writer = JsonlWriter(log)
    writer.write_many(records)
    writer.close()
    out = lines(log)
    assert out[0] == good[0] and out[2] == good[1] and out[3] == good[2]
    assert out[1] == {
        "kind": "step", "step": 9, "name": "a\ufffdb",
        "deep": [{"big": str(-(2**70)), "3": "k"}],
        "encoding_replaced": ["name", "deep.0.big", "deep.0.3"],
    }
    assert bad["name"] == "a\udcffb" and 3 in bad["deep"][0]    # the caller's record is untouched


def test_the_writer_repairs_what_orjson_refuses_and_keeps_writing(log):
    writer = JsonlWriter(log)
    writer.write({"kind": "step", "name": "\udcff", "keys": {None: 1, 2: 2, "2": 3}})
    writer.write({"kind": "step", "big": 2**64, "obj": {1j}, "nan": float("nan"), "pair": "\ud83d\ude00"})
    writer.write_many([{"kind": "step", "step": 1}, {"kind": "step", "step": 2}])
    writer.close()
    assert writer.failed is None
    first, second, *rest = lines(log)
    assert first["name"] == "\ufffd"
    assert first["keys"] == {"None": 1, "2_": 2, "2": 3}     # a key made a str never takes another's
    assert first["encoding_replaced"] == ["name", "keys.None", "keys.2_"]
    # A value of another type is written as its str(); NaN is null (orjson's own rule, not a repair);
    # a surrogate pair (two code points to Python, invalid in UTF-8) is the character it encodes.
    assert second["big"] == str(2**64) and second["obj"] == str({1j}) and second["nan"] is None
    assert second["pair"] == "\U0001f600"
    assert second["encoding_replaced"] == ["big", "obj", "pair"]
    assert rest == [{"kind": "step", "step": 1}, {"kind": "step", "step": 2}]


def test_a_record_that_already_lists_replacements_keeps_its_list_and_adds_to_it():
    from stepprof._log import encodable

    record = {"kind": "x", "v": "\udcff", "encoding_replaced": ["earlier"]}
    assert encodable(record) == {"kind": "x", "v": "\ufffd", "encoding_replaced": ["earlier", "v"]}


def test_the_fast_path_writes_exactly_what_orjson_writes(log):
    records = [{"kind": "step", "step": i, "wall_ms": 1.25, "phases": {"fwd": {"n": i}}} for i in range(5)]
    writer = JsonlWriter(log)
    writer.write_many(records)
    writer.close()
    with open(log, "rb") as f:
        assert f.read() == b"".join(orjson.dumps(r, option=orjson.OPT_APPEND_NEWLINE) for r in records)


def test_a_log_path_that_is_not_utf8_is_accepted_and_the_summary_says_so(tmp_path):
    """Profiler(os.fsdecode(b"run_\\xff.jsonl")): the file gets the OS's name, the record a replaced one.

    Before, close() raised TypeError from orjson: the summary was lost and the user's
    in-flight exception was replaced by stepprof's.
    """
    path = str(tmp_path / BAD_NAME)
    err = KeyError("the user's own")
    with pytest.raises(KeyError) as caught:
        with stepprof.Profiler(path, device="cpu") as prof:
            with prof.step(batch_size=4):
                pass
            raise err
    assert caught.value is err and err.__context__ is None    # unchanged, nothing chained onto it
    assert prof.summary is not None and prof.summary.log == path
    assert os.listdir(tmp_path) == [BAD_NAME]                # the name the user asked for
    step, summary = lines(path)
    assert step["kind"] == "step" and "encoding_replaced" not in step
    assert summary["kind"] == "summary" and summary["steps"] == 1
    assert summary["log"] == str(tmp_path / "run_\ufffd.jsonl")
    assert summary["encoding_replaced"] == ["log"]


@pytest.mark.parametrize(
    "bad, why",
    [("run_\ud800.jsonl", "cannot be encoded as a file name"), ("run\x00.jsonl", "must not hold a null character")],
)
def test_a_log_path_the_os_cannot_take_fails_at_construction(tmp_path, monkeypatch, bad, why):
    """A lone surrogate that no byte decodes to (not what os.fsdecode gives), or a NUL: no OS takes it."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(stepprof.ConfigError, match=rf"'log' {why} \(got {re.escape(repr(bad))}\).*; pass"):
        stepprof.Profiler(bad)
    assert not os.listdir(tmp_path)


# -- every user-supplied field, with each value kind JSON cannot hold -------------------------
#
# Each case runs a real CPU Profiler (the fake device where a field needs one: sync sites,
# memory records) with a bad value in one field, and says which records' encoding_replaced
# must name which paths.  Records of the kinds a case does not list must have none.

S = "\udcff"                # a lone surrogate: what os.fsdecode gives for the byte 0xff
R = "\ufffd"                # what the log holds in its place
BIG = 2**64                 # one past uint64, the largest int orjson writes
HUGE = 2**1100              # past a float's range too
STOPPED = ("stepprof stopped", "logging stopped")
MiB = 2**20


class Phase(str, enum.Enum):
    TRAIN = "train"
    FWD = "fwd"
    BWD = "bwd"


def _steps(prof, n=3, **kw):
    for _ in range(n):
        with prof.step(**kw):
            pass


def case_profile_step_name(tmp_path, request):
    log = str(tmp_path / "run.jsonl")
    with stepprof.Profiler(log, device="cpu"):
        for _ in range(3):
            with stepprof.profile_step("train" + S, batch_size=8):
                pass
    return log, 3, {"step": ["name"]}


def case_step_name_with_a_terminal_escape(tmp_path, request):
    log = str(tmp_path / "run.jsonl")
    with stepprof.Profiler(log, device="cpu") as prof:
        _steps(prof, name="train" + S + "\x1b[2J")
    return log, 3, {"step": ["name"]}


def case_measure_qualname(tmp_path, request):
    def train_step():
        pass

    train_step.__qualname__ = "train_step" + S   # Python takes it (a class's __name__ it refuses)
    log = str(tmp_path / "run.jsonl")
    with stepprof.Profiler(log, device="cpu"):
        measured = stepprof.measure(train_step)
        for _ in range(3):
            measured()                              # outside any step: a step of that name
    return log, 3, {"step": ["name"]}


def case_phase_name(tmp_path, request):
    log = str(tmp_path / "run.jsonl")
    with stepprof.Profiler(log, device="cpu") as prof:
        for _ in range(3):
            with prof.step():
                with stepprof.measure("fwd" + S):
                    pass
    path = f"phases.fwd{R}"
    return log, 3, {"step": [path], "summary": [path]}


def case_nested_phase_name(tmp_path, request):
    log = str(tmp_path / "run.jsonl")
    with stepprof.Profiler(log, device="cpu") as prof:
        for _ in range(3):
            with prof.step():
                with prof.measure("a"):
                    with prof.measure("b" + S):
                        pass
    paths = [f"phases.a/b{R}"]
    return log, 3, {"step": paths, "summary": paths}


def case_str_subclass_names(tmp_path, request):
    """(str, Enum) members as names: the only non-str keys a user can give (phases is keyed by
    name).  They are taken as their str value at the call: plain keys, nothing to repair."""
    log = str(tmp_path / "run.jsonl")
    with stepprof.Profiler(log, device="cpu") as prof:
        for _ in range(3):
            with prof.step(name=Phase.TRAIN):
                with stepprof.measure(Phase.FWD):
                    with stepprof.measure(Phase.BWD):
                        pass
    records = lines(log)
    assert records[0]["name"] == "train" and list(records[0]["phases"]) == ["fwd/bwd", "fwd"]
    assert list(records[-1]["phases"]) == ["fwd/bwd", "fwd"]
    return log, 3, {}


def case_batch_size_past_64_bits(tmp_path, request):
    log = str(tmp_path / "run.jsonl")
    with stepprof.Profiler(log, device="cpu") as prof:
        _steps(prof, batch_size=BIG)
    step = lines(log)[0]
    assert step["batch_size"] == str(BIG) and step["samples_per_s"] > 0
    return log, 3, {"step": ["batch_size"]}


def case_batch_size_past_a_float(tmp_path, request):
    """samples_per_s would be batch_size / time: past a float, null with the reason."""
    log = str(tmp_path / "run.jsonl")
    with stepprof.Profiler(log, device="cpu") as prof:
        _steps(prof, batch_size=HUGE)
    step, summary = lines(log)[0], lines(log)[-1]
    assert step["batch_size"] == str(HUGE) and step["samples_per_s"] is None
    assert "past a float's range" in step["unavailable"]["samples_per_s"]
    assert "past a float's range" in summary["unavailable"]["samples_per_s_median"]
    return log, 3, {"step": ["batch_size"]}


def _raising_steps(log, exc_factory, n=3):
    with stepprof.Profiler(log, device="cpu") as prof:
        for _ in range(n):
            try:
                with prof.step():
                    raise exc_factory()
            except Exception:
                pass


def case_error_message(tmp_path, request):
    log = str(tmp_path / "run.jsonl")
    _raising_steps(log, lambda: FileNotFoundError(f"no such file: {BAD_NAME} {S}"))
    assert lines(log)[0]["error"]["message"] == f"no such file: run_{R}.jsonl {R}"
    return log, 3, {"step": ["error.message"]}


class StrNotStr(Exception):
    def __str__(self):
        return 5


class StrRaises(Exception):
    def __str__(self):
        raise ValueError("broken __str__")


def case_error_str_not_a_str(tmp_path, request):
    log = str(tmp_path / "run.jsonl")
    _raising_steps(log, StrNotStr)
    assert lines(log)[0]["error"] == {
        "type": "StrNotStr", "message": "<unprintable StrNotStr: its __str__ raised TypeError>",
    }
    return log, 3, {}


def case_error_str_raises(tmp_path, request):
    log = str(tmp_path / "run.jsonl")
    _raising_steps(log, StrRaises)
    assert lines(log)[0]["error"]["message"] == "<unprintable StrRaises: its __str__ raised ValueError>"
    return log, 3, {}


def case_error_type_qualname(tmp_path, request):
    """A class's __name__ cannot hold a surrogate (Python refuses it); its __qualname__ can, and
    the record's type is the __name__."""
    err = type("UserError", (Exception,), {})
    err.__qualname__ = "Outer" + S + ".UserError"
    log = str(tmp_path / "run.jsonl")
    _raising_steps(log, lambda: err("message " + S))
    assert lines(log)[0]["error"] == {"type": "UserError", "message": f"message {R}"}
    return log, 3, {"step": ["error.message"]}


def case_log_path(tmp_path, request):
    log = str(tmp_path / BAD_NAME)
    with stepprof.Profiler(log, device="cpu") as prof:
        _steps(prof)
    return log, 3, {"summary": ["log"]}


def case_configure(tmp_path, request):
    log = str(tmp_path / BAD_NAME)
    prof = stepprof.configure(log=log, device="cpu", warmup=1, max_syncs=BIG, memory_every=BIG)
    for _ in range(3):
        with stepprof.profile_step("p" + S, batch_size=BIG):
            with stepprof.measure("fwd" + S):
                pass
    prof.close()
    return log, 3, {"step": ["name", "batch_size", f"phases.fwd{R}"], "summary": ["log", f"phases.fwd{R}"]}


def case_environment(tmp_path, request):
    """STEPPROF_LOG holds what os.environ gives for a non-UTF-8 value; STEPPROF_WARMUP is 2**64."""
    log = str(tmp_path / BAD_NAME)
    monkeypatch = request.getfixturevalue("monkeypatch")
    monkeypatch.setenv("STEPPROF_LOG", log)
    monkeypatch.setenv("STEPPROF_WARMUP", str(BIG))
    for _ in range(3):
        with stepprof.profile_step():
            pass
    from stepprof import _registry

    _registry.default_profiler().close()
    assert all(r["warmup"] for r in lines(log)[:3])
    return log, 3, {"summary": ["log"]}


def case_rank_variables(tmp_path, request):
    """RANK, LOCAL_RANK and WORLD_SIZE past 64 bits: each record's rank fields, and the rank's log."""
    monkeypatch = request.getfixturevalue("monkeypatch")
    monkeypatch.setenv("RANK", str(BIG))
    monkeypatch.setenv("WORLD_SIZE", str(BIG + 1))
    monkeypatch.setenv("LOCAL_RANK", str(-BIG))
    log = str(tmp_path / "run.jsonl")
    with stepprof.Profiler(log, device="cpu", ranks_every=0) as prof:
        _steps(prof)
    ranked = str(tmp_path / f"run.rank{BIG}.jsonl")
    fields = ["rank", "local_rank", "world_size"]
    return ranked, 3, {"step": fields, "summary": fields}


def case_counts_past_64_bits(tmp_path, request):
    """Settings that reach no record as such: warm-up, budgets, periods."""
    log = str(tmp_path / "run.jsonl")
    with stepprof.Profiler(log, device="cpu", warmup=BIG, max_syncs=BIG, memory_every=BIG,
                           phase_peaks_every=BIG, ranks_every=BIG) as prof:
        _steps(prof, max_syncs=BIG)
    assert lines(log)[-1]["warmup_steps"] == 3
    return log, 3, {}


def case_flops_per_step_past_64_bits(tmp_path, request):
    log = str(tmp_path / "run.jsonl")
    with stepprof.Profiler(log, device="cpu", flops_per_step=BIG) as prof:
        _steps(prof)
    flops = next(r for r in lines(log) if r["kind"] == "flops")
    assert flops["flops_per_step"] == float(BIG)         # a float: the validator converts it
    return log, 3, {}


def case_flops_per_step_near_float_max(tmp_path, request):
    """1e308 FLOPs over a step of microseconds: TFLOP/s would be infinite, so null with the reason."""
    log = str(tmp_path / "run.jsonl")
    with stepprof.Profiler(log, device="cpu", flops_per_step=1e308) as prof:
        _steps(prof)
    step = lines(log)[0]
    assert step["flops"] == 1e308 and step["tflops_per_s"] is None
    assert "past a float's range" in step["unavailable"]["tflops_per_s"]
    return log, 3, {}


def _user_file(tmp_path) -> dict:
    """A user's source file whose name is not UTF-8, executed: its frames' co_filename holds a surrogate."""
    path = os.path.join(os.fsdecode(bytes(tmp_path)), os.fsdecode(b"train_\xff.py"))
    with open(path, "w") as f:
        f.write("def work(t):\n    t.item()  # sync\n")
    return runpy.run_path(path)


def _syncing_steps(tmp_path, request, *, on_sync="count", max_syncs=None):
    monkeypatch = request.getfixturevalue("monkeypatch")
    monkeypatch.setattr(_syncs, "_INTERNAL_PREFIXES", (*_syncs._INTERNAL_PREFIXES, fake_torch.__file__))
    gpu = request.getfixturevalue("gpu")
    work = _user_file(tmp_path)["work"]
    log = str(tmp_path / "run.jsonl")
    with make(log, gpu, max_syncs=max_syncs, on_sync=on_sync) as prof:
        for _ in range(3):
            try:
                with prof.step():
                    work(FakeTensor(gpu))
            except stepprof.SyncBudgetExceeded:
                pass
    step = lines(log)[0]
    where = step["syncs"]["sites"][0]["where"]
    assert where.endswith(f"train_{R}.py:2") and step["syncs"]["count"] == 1
    return log


def case_sync_site_in_a_non_utf8_file(tmp_path, request):
    log = _syncing_steps(tmp_path, request)
    return log, 3, {"step": ["syncs.sites.0.where"]}


def case_sync_budget_raise_names_that_file(tmp_path, request):
    log = _syncing_steps(tmp_path, request, on_sync="raise", max_syncs=0)
    assert lines(log)[0]["error"]["type"] == "SyncBudgetExceeded"
    return log, 3, {"step": ["error.message", "syncs.sites.0.where"]}


def case_sync_budget_warn_names_that_file(tmp_path, request):
    log = _syncing_steps(tmp_path, request, on_sync="warn", max_syncs=0)
    return log, 3, {"step": ["syncs.sites.0.where"]}


def case_memory_records(tmp_path, request):
    """Memory records hold no user-supplied value (the device is a torch.device): they stay as they are."""
    request.getfixturevalue("nvml")
    gpu = request.getfixturevalue("gpu")
    log = str(tmp_path / "run.jsonl")
    with make(log, gpu, memory_every=1) as prof:
        for _ in range(3):
            with prof.step(name="s" + S, batch_size=BIG):
                gpu.alloc(10 * MiB)
                gpu.launch(1.0)
            gpu.free(10 * MiB)
    assert sum(r["kind"] == "memory" for r in lines(log)) == 4     # one per step, one at close
    return log, 3, {"step": ["name", "batch_size"]}


PROFILER_CASES = [v for k, v in sorted(globals().items()) if k.startswith("case_")]


def _report_and_read(path: str, capsys) -> str:
    """``stepprof report`` (text and --json) and ``stepprof.read`` on the log: all succeed; the
    text holds no surrogate and no control character but newlines (strings go through printable)."""
    from stepprof._cli import main

    capsys.readouterr()
    assert main(["report", path]) == 0
    text = capsys.readouterr().out
    text.encode("utf-8")                                       # no lone surrogate
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", text)
    assert main(["report", "--json", path]) == 0
    as_json = json.loads(capsys.readouterr().out, parse_constant=_not_json)
    assert as_json.get("encoding_replaced", []) == ([] if _is_utf8(path) else ["logs.0.path"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read = list(stepprof.read(path))
    # read() gives every line, and changes only what no reader can take, reading it as null with
    # the reason: what the writer had to replace (an int past 64 bits, written as its decimal
    # string), and a number past its unit's range (a rate from such a batch size, say).
    raw = lines(path)
    assert len(read) == len(raw)
    for got, line in zip(read, raw):
        changed = {k for k in line if got.get(k) != line[k]} - {"unavailable"}
        replaced = {p.split(".")[0] for p in line.get("encoding_replaced", [])}
        fields = {f.name: f for f in RECORDS[line["kind"]].fields}
        for k in changed:
            assert got[k] is None and got["unavailable"][k].startswith(INVALID), k
            assert k in replaced or abs(line[k]) > UNITS[fields[k].unit].greatest, (k, line[k])
    return text


def _is_utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@pytest.mark.parametrize("case", PROFILER_CASES, ids=lambda f: f.__name__[5:])
def test_every_user_supplied_field_keeps_every_record_and_the_log_valid(case, tmp_path, request, capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, n_steps, replaced = case(tmp_path, request)
    assert not [w for w in caught if any(s in str(w.message) for s in STOPPED)]
    records = lines(path)                                      # strict JSON, every line
    kinds = [r["kind"] for r in records]
    assert kinds.count("step") == n_steps and kinds.count("summary") == 1 and kinds[-1] == "summary"
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(n_steps))
    for r in records:
        assert r.get("encoding_replaced", []) == replaced.get(r["kind"], []), r["kind"]
    text = _report_and_read(path, capsys)
    if case is case_step_name_with_a_terminal_escape:
        assert f"train{R}\\x1b[2J" in text                     # escaped, shown as text


# -- the sweep: batch sizes and the error of a trial that ran out of memory --------------------


def _sweep(tmp_path, *, start, max_batch, oom_above=None, message="CUDA out of memory"):
    gpu = FakeSweepGpu(capacity=40 * 10**9)
    sizes = []

    def make_batch(n):
        sizes.append(n)
        return object()

    def train_step(batch):
        if oom_above is not None and sizes[-1] > oom_above:
            raise torch.OutOfMemoryError(message)
        gpu.launch(1.0)
        gpu.wait_idle()

    log = str(tmp_path / "sweep.jsonl")
    result = sweep_on(gpu, gpu.clock, train_step, make_batch, start=start, max_batch=max_batch,
                      log=log, progress=False, min_time_s=0)
    return log, result


@pytest.mark.parametrize(
    "settings, point_replaced, result_replaced",
    [
        (dict(start=BIG, max_batch=4 * BIG), lambda p: ["batch_size"], ["knee", "max_fit", "recommended"]),
        (
            dict(start=1, max_batch=64, oom_above=8, message=f"CUDA out of memory {S}"),
            lambda p: ["error"] if p["oom"] else [], [],
        ),
        (
            dict(start=BIG // 2, max_batch=8 * BIG, oom_above=BIG, message=f"CUDA out of memory {S}"),
            lambda p: (["batch_size"] if p["batch_size"] != BIG // 2 else []) + (["error"] if p["oom"] else []),
            ["knee", "max_fit", "first_oom", "recommended"],
        ),
        (dict(start=HUGE, max_batch=HUGE), lambda p: ["batch_size"], ["max_fit"]),
    ],
    ids=["batch_sizes_past_64_bits", "oom_message", "oom_past_64_bits", "batch_size_past_a_float"],
)
def test_the_sweeps_records_keep_every_trial_and_the_log_valid(
    tmp_path, capsys, settings, point_replaced, result_replaced
):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log, result = _sweep(tmp_path, **settings)
    assert not [w for w in caught if any(s in str(w.message) for s in STOPPED)]
    records = lines(log)
    points = [r for r in records if r["kind"] == "sweep_point"]
    assert len(points) == result.trials and [r["kind"] for r in records[len(points):]] == ["sweep_result"]
    for p in points:
        assert p.get("encoding_replaced", []) == point_replaced(p)
    assert records[-1].get("encoding_replaced", []) == result_replaced
    if settings.get("message"):
        assert all(p["error"] == f"OutOfMemoryError: CUDA out of memory {R}" for p in points if p["oom"])
    if settings["start"] == HUGE:
        assert points[0]["samples_per_s"] is None
        assert "past a float's range" in points[0]["unavailable"]["samples_per_s"]
    _report_and_read(log, capsys)


# -- values the validators refuse at the call ---------------------------------------------------


def _profiler(**kw):
    return lambda log: stepprof.Profiler(log, **kw)


def _in_profiler(call):
    with stepprof.Profiler(None) as prof:
        return call(prof)


@pytest.mark.parametrize(
    "call, error, message",
    [
        # NaN and the infinities: every float stepprof takes must be finite.
        *[
            (_profiler(flops_per_step=float(v)), stepprof.ConfigError,
             rf"'flops_per_step' must be a positive number of FLOPs, finite as a float \(got {v}\); "
             r"e\.g\. flops_per_step=")
            for v in ("nan", "inf", "-inf")
        ],
        (_profiler(flops_per_step=HUGE), stepprof.ConfigError,
         rf"'flops_per_step' must be .* \(got {HUGE}\); e\.g\. flops_per_step="),
        (lambda log: stepprof.profile_step(batch_size=float("nan")), stepprof.ConfigError,
         r"'batch_size' must be a positive int or None \(got nan\); pass the number of samples"),
        (_profiler(max_syncs=float("inf")), stepprof.ConfigError,
         r"'max_syncs' must be an int >= 0 or None \(got inf\); pass e\.g\. max_syncs=0"),
        (_profiler(warmup=float("nan")), stepprof.ConfigError, r"'warmup' must be an int >= 0 \(got nan\); pass e\.g\. warmup=3"),
        # A device index past 64 bits, and a surrogate in a device string.
        (_profiler(device=BIG), stepprof.ConfigError,
         rf"'device' must name a torch device such as 'cuda:0' or 'cpu' \(got {BIG}\)"),
        (_profiler(device=f"cuda:{BIG}"), stepprof.ConfigError, rf"'device' must name .* \(got 'cuda:{BIG}'\)"),
        (_profiler(device="cpu" + S), stepprof.ConfigError, r"'device' must name .* \(got 'cpu\\udcff'\)"),
        (lambda log: stepprof.memory_report(BIG), stepprof.ConfigError,
         rf"'device' must name a torch device such as 'cuda:0' or 0 \(got {BIG}\); or pass nothing"),
        # A name that is not a str (an int past 64 bits, say) is refused, not made a key.
        (lambda log: _in_profiler(lambda prof: prof.step(name=BIG)), stepprof.UsageError,
         rf"'name' must be a str or None \(got {BIG}\); to give the step's batch size, pass it by keyword"),
        (lambda log: stepprof.measure(BIG), stepprof.UsageError,
         rf"measure\(\) takes a name \(str\) or a function \(got {BIG}\); use @stepprof\.measure"),
    ],
    ids=[
        "flops_per_step_nan", "flops_per_step_inf", "flops_per_step_-inf", "flops_per_step_past_a_float",
        "batch_size_nan", "max_syncs_inf", "warmup_nan", "device_index_past_64_bits",
        "device_string_past_64_bits", "device_surrogate", "memory_report_device_past_64_bits",
        "step_name_int", "measure_name_int",
    ],
)
def test_values_the_validators_refuse_name_the_argument_and_the_fix(tmp_path, call, error, message):
    log = str(tmp_path / "run.jsonl")
    with pytest.raises(error, match=message):
        call(log)
    assert not os.path.exists(log)


@pytest.mark.parametrize(
    "setting, message",
    [
        (dict(knee_within=float("nan")), r"'knee_within' must be a fraction between 0 and 1 \(got nan\); e\.g\. 0\.10"),
        (dict(min_time_s=float("inf")), r"'min_time_s' must be a finite number of seconds >= 0 \(got inf\)"),
        (dict(time_budget_s=float("nan")), r"'time_budget_s' must be a finite number of seconds > 0 \(got nan\)"),
        (dict(start=float("inf")), r"'start' must be an int >= 1 \(got inf\); the first batch size"),
    ],
    ids=["knee_within_nan", "min_time_s_inf", "time_budget_s_nan", "start_inf"],
)
def test_the_sweep_refuses_nan_and_infinities(tmp_path, setting, message):
    gpu = FakeSweepGpu(capacity=10**9)
    with pytest.raises(stepprof.ConfigError, match=message):
        sweep_on(gpu, gpu.clock, lambda b: None, lambda n: object(), progress=False,
                 log=str(tmp_path / "sweep.jsonl"), **setting)


def test_a_class_name_cannot_hold_a_surrogate():
    """So the ``type`` of a step's error, the class's ``__name__``, never needs a repair."""
    with pytest.raises(UnicodeEncodeError):
        type("Error" + S, (Exception,), {})
    err = type("Error", (Exception,), {})
    with pytest.raises(UnicodeEncodeError):
        err.__name__ = "Error" + S


@pytest.mark.cuda
def test_on_cuda_every_user_supplied_field_keeps_every_record_and_the_log_valid(tmp_path, capsys):
    """A real GPU: NVTX gets the names, the "warn" route attributes a sync to a file whose name
    is not UTF-8, FLOPs are counted and memory records written, the step's error names a file."""
    work = _user_file(tmp_path)["work"]
    log = str(tmp_path / BAD_NAME)
    x = torch.randn(64, 64, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with stepprof.Profiler(log, flops="auto", memory_every=1, max_syncs=BIG) as prof:
            for i in range(4):
                try:
                    with prof.step(name="train" + S + "\x1b[2J", batch_size=HUGE):
                        with prof.measure("fwd" + S):
                            with prof.measure("mm" + S):
                                y = x @ x
                        work(y.sum())                    # a sync, from train_\xff.py line 2
                        if i == 2:
                            raise FileNotFoundError(f"no such file: {BAD_NAME}")
                except FileNotFoundError:
                    pass
    assert not [w for w in caught if any(s in str(w.message) for s in STOPPED)]
    records = lines(log)
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [0, 1, 2, 3] and records[-1]["kind"] == "summary"
    assert sum(r["kind"] == "memory" for r in records) >= 4
    for step in steps:
        assert step["device"].startswith("cuda") and step["gpu_ms"] is not None
        assert step["name"] == f"train{R}\x1b[2J" and step["batch_size"] == str(HUGE)
        assert step["samples_per_s"] is None and "past a float's range" in step["unavailable"]["samples_per_s"]
        (i,) = [i for i, s in enumerate(step["syncs"]["sites"]) if f"train_{R}.py:2" in s["where"]]
        assert step["syncs"]["sites"][i]["kind"] == "item"
        assert {"name", "batch_size", f"phases.fwd{R}", f"phases.fwd{R}/mm{R}", f"syncs.sites.{i}.where"} <= set(
            step["encoding_replaced"]
        )
    assert steps[2]["error"]["message"] == f"no such file: run_{R}.jsonl"
    assert "error.message" in steps[2]["encoding_replaced"]
    assert set(records[-1]["encoding_replaced"]) == {"log", f"phases.fwd{R}", f"phases.fwd{R}/mm{R}"}
    for r in records:
        if r["kind"] not in ("step", "summary"):
            assert "encoding_replaced" not in r, r["kind"]
    _report_and_read(log, capsys)
