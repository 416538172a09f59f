"""Hostile logs: numbers that would size the report's work, and terminal escapes in its text."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from stepprof._report import build_report, render

from . import logfixtures as fx

MiB = 2**20


def _rank_log(path, rank, world, steps=20):
    recs = fx.training_log(steps=steps, flops=False)
    for r in recs:
        r.update(rank=rank, local_rank=rank, world_size=world)
    return fx.write(str(path), recs)


def _report_cost(paths):
    """(seconds, tracemalloc peak bytes, rendered text) of building and rendering the report."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        report = build_report(paths)
        text = render(report)
        took = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return took, peak, report, text


def test_a_huge_world_size_reports_the_missing_ranks_as_a_count_in_bounded_time_and_memory(tmp_path):
    logs = [_rank_log(tmp_path / "r3.jsonl", 3, 100_000_000_000), _rank_log(tmp_path / "r7.jsonl", 7, 100_000_000_000)]
    took, peak, report, text = _report_cost(logs)
    assert took < 1.0 and peak < 4 * MiB, (took, peak)
    (note,) = report.distributed.notes
    assert "99,999,999,998 rank(s)" in note and "0, 1, 2, 4, 5, 6, 8" in note
    assert "were not given" in text


def test_a_few_missing_ranks_are_all_named(tmp_path):
    logs = [_rank_log(tmp_path / "r1.jsonl", 1, 4)]
    report = build_report(logs)
    assert report.distributed.notes == ("logs of rank(s) 0, 2, 3 were not given",)


def test_ranks_outside_the_world_do_not_count_as_given(tmp_path):
    logs = [_rank_log(tmp_path / "a.jsonl", 0, 2), _rank_log(tmp_path / "b.jsonl", 5, 2)]
    assert build_report(logs).distributed.notes == ("logs of rank(s) 1 were not given",)


# -- terminal escapes: every string from the log is printed with its control characters escaped -----

HOSTILE = "\x1b]0;pwned\x07\x1b[2J[bold]x[/bold]:smile:\x9b31m\nfake line\r\x00\x7f"
_CONTROL = {*map(chr, range(0x20)), "\x7f", *map(chr, range(0x80, 0xA0))} - {"\n"}


def _hostile_log(path):
    recs = fx.training_log(steps=40)
    for r in recs:
        r.update(rank=0, local_rank=0, world_size=2)
        if r["kind"] == "step":
            r["name"] = HOSTILE
            r["device"] = "cuda:0" + HOSTILE
            r["phases"][HOSTILE] = r["phases"].pop("optimizer")
            site = r["syncs"]["sites"][0]
            site.update(where=HOSTILE, kind=HOSTILE, code=HOSTILE)
            r["syncs"]["mechanism"] = HOSTILE
            r["unavailable"] = {"gpu_ms": HOSTILE, "mfu": HOSTILE}
            if r["step"] == 30:
                r["error"] = "RuntimeError: " + HOSTILE
        elif r["kind"] == "memory":
            r.update(notes=["fragmented " + HOSTILE], explanation=HOSTILE, basis=HOSTILE)
        elif r["kind"] == "flops":
            r.update(source=HOSTILE, device_name=HOSTILE, calibration=None)
    recs.append({"schema_version": 2, "kind": "ranks", "step": HOSTILE, "rank": 0, "world_size": 2,
                 "straggler_rank": 1, "straggler_basis": HOSTILE, "straggler_excess_ms": 1.0,
                 "unavailable": {"straggler_rank": HOSTILE}})
    recs.append({"schema_version": 2, "kind": "sweep_point", "trial": 1, "phase": HOSTILE, "batch_size": 8,
                 "oom": False, "samples_per_s": 100.0, "step_ms": 1.0, "step_ms_p10": 0.9, "step_ms_p90": 1.1,
                 "timed_steps": 3, "warmup_steps": 1, "peak_allocated_bytes": 1000, "alloc_retries": 0,
                 "device_allocs": 0, "leaked_bytes": None, "error": HOSTILE, "wall_s": 1.0})
    recs.append({"schema_version": 2, "kind": "sweep_result", "knee": 8, "max_fit": 8, "first_oom": None,
                 "predicted_max": None, "thrash_zone": None, "recommended": 8, "reason": HOSTILE,
                 "stopped": HOSTILE, "device": HOSTILE, "trials": 1, "wall_s": 1.0, "capacity_bytes": None,
                 "fit_base_bytes": None, "fit_bytes_per_sample": None, "knee_within": 0.1, "notes": [HOSTILE]})
    recs.append({"schema_version": 2, "kind": HOSTILE})
    return fx.write(str(path), recs)


def _assert_clean(text):
    assert "\x1b" not in text and not _CONTROL & set(text), sorted(_CONTROL & set(text))
    assert "fake line" not in text.replace("\\nfake line", "")  # a value's newline never starts a line


def test_control_characters_from_the_log_are_printed_escaped(tmp_path):
    log = _hostile_log(tmp_path / "esc\x1b[2J.jsonl")
    text = render(build_report([log]))
    _assert_clean(text)
    assert "\\x1b]0;pwned\\x07\\x1b[2J[bold]x[/bold]:smile:\\x9b31m\\nfake line\\r\\x00\\x7f" in text  # visible
    assert "esc\\x1b[2J.jsonl" in text
    for shown in ("names: " + "\\x1b", "cuda:0\\x1b", "\\x1b]0;pwned", "recommended 8: \\x1b"):
        assert shown in text, shown


def test_the_cli_prints_escapes_as_text_and_json_keeps_the_values_exact(tmp_path, capsys):
    import orjson

    from .report_helpers import cli

    log = _hostile_log(tmp_path / "h.jsonl")
    rc, out, _ = cli(capsys, "report", log)
    assert rc == 0
    _assert_clean(out)
    rc, out, _ = cli(capsys, "report", "--json", log)
    assert rc == 0 and "\x1b" not in out  # JSON escapes them
    run = orjson.loads(out)["logs"][0]["runs"][0]
    assert run["names"] == [HOSTILE] and run["device"] == "cuda:0" + HOSTILE


def test_on_a_terminal_rich_neither_interprets_markup_nor_passes_escapes(tmp_path, capsys, monkeypatch):
    import sys

    pytest.importorskip("rich")
    from .report_helpers import cli

    log = _hostile_log(tmp_path / "h.jsonl")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    rc, out, _ = cli(capsys, "report", log)
    assert rc == 0
    assert "[bold]x[/bold]:smile:" in out  # printed as written: no markup, no emoji
    for seq in ("\x1b]0;", "\x07", "\x1b[2J", "\x9b", "\x00", "\r"):
        assert seq not in out, repr(seq)


def test_json_escapes_del_and_c1_so_its_text_is_safe_on_a_terminal(tmp_path, capsys):
    import orjson

    from .report_helpers import cli

    log = _hostile_log(tmp_path / "h.jsonl")
    rc, out, _ = cli(capsys, "report", "--json", log)
    assert rc == 0
    assert not _CONTROL & set(out.replace("\n", "")), sorted(_CONTROL & set(out))
    assert "\\u009b31m" in out and "\\u007f" in out
    assert orjson.loads(out)["logs"][0]["runs"][0]["names"] == [HOSTILE]  # the same values


def test_plots_show_a_logs_names_with_their_control_characters_escaped(tmp_path, capfd):
    """matplotlib writes a glyph it lacks to stderr as it is: a name from the log must not reach it raw."""
    import warnings

    pytest.importorskip("matplotlib")
    from . import readerlogs
    from .report_helpers import cli

    recs = readerlogs.every_kind()
    for r in recs:
        if r["kind"] in ("step", "peak", "sweep_result"):
            r["device"] = "cuda:0" + HOSTILE
        if r["kind"] == "peak":
            r.update(phase=HOSTILE, op=HOSTILE)
            r["modules"][0]["module"] = HOSTILE
    log = fx.write(str(tmp_path / "h.jsonl"), recs)
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for flags in ([], ["--peak"], ["--sweep"]):
            assert cli(capfd, "plot", *flags, log, "-o", str(tmp_path / f"p{len(flags)}{''.join(flags)}.png"))[0] == 0
    out, err = capfd.readouterr()
    shown = out + err + "".join(str(w.message) for w in caught)
    assert not _CONTROL & set(shown.replace("\n", "")), sorted(_CONTROL & set(shown))
