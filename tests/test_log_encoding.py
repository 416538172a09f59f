"""Values that JSON cannot hold, and log paths that are not UTF-8: the log keeps every record.

A lone surrogate (a file name from ``os.listdir`` that is not UTF-8, in an exception
message or a step name), an int outside 64 bits or a non-str key used to make orjson
refuse the whole write batch and stop the collector thread.  Now the writer repairs the
record that fails, says so in its ``encoding_replaced``, and writes every other record as is.
"""

from __future__ import annotations

import json
import re
import os
import warnings

import orjson
import pytest

import stepprof
from stepprof._log import JsonlWriter

BAD_NAME = os.fsdecode(b"run_\xff.jsonl")     # what os.listdir gives for a non-UTF-8 name


def lines(path: str) -> list[dict]:
    """Every line of the log, parsed by the standard library (which rejects what is not JSON)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data.endswith(b"\n")
    return [json.loads(line.decode("utf-8")) for line in data.splitlines()]


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
