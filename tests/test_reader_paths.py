"""A log never chooses where a file goes: names from it are sanitised, paths stay in the output folder.

Logs travel (they are attached to bug reports), so a ``run_id``, rank, step or phase name that is an
absolute path, a ``..`` sequence or control characters must not make ``export`` or ``plot`` write
anywhere but where the user's arguments say.
"""

from __future__ import annotations

import os
import uuid

import pytest

from stepprof import _export
from stepprof._errors import ConfigError
from stepprof._paths import component, components, inside
from stepprof._peak_plot import plot_peak
from stepprof._plot import plot_log

from . import logfixtures as fx
from . import readerlogs
from .report_helpers import cli


def _tree(root: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files}


def _hostile_logs(work: str, escape: str) -> list[str]:
    """Two logs of two runs each, their names absolute paths, ``..`` sequences and control characters."""
    names = [f"{work}/abs_run", "../../../../../../../../.." + escape, "..", "a/../../b\x1b]0;x\x07", ".hidden"]
    logs = []
    for k, (rank, run_ids) in enumerate([("/etc/rank", names[:2]), (None, names[2:4])]):
        recs = []
        for j, run_id in enumerate(run_ids):
            run = readerlogs.every_kind(rank=0, run_id=run_id, steps=12)
            for r in run:
                r["rank"] = rank if rank is not None else j  # a str rank, then ints
                if r["kind"] == "step":
                    r["name"] = names[(j + 3) % len(names)]
                    r["thread"] = names[j]
                    r["phases"] = {names[i]: ph for i, ph in enumerate(r["phases"].values())}
                elif r["kind"] in ("peak", "sweep_point", "sweep_result"):
                    r["run_id"] = names[j]
                    if r["kind"] == "peak":
                        r["phase"] = names[1]
                        r["modules"][0]["module"] = names[0]
            recs += run
        logs.append(fx.write(os.path.join(work, f"log{k}.jsonl"), recs))
    return logs


@pytest.fixture
def hostile(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("tensorboard")
    work = str(tmp_path / "deep" / "er" / "work")
    os.makedirs(os.path.join(work, "out"))
    escape = f"stepprof-escape-{uuid.uuid4().hex}"
    logs = _hostile_logs(work, escape)
    before = _tree(str(tmp_path))
    yield work, logs
    after = _tree(str(tmp_path))
    stems = {os.path.splitext(os.path.relpath(log, str(tmp_path)))[0] for log in logs}
    out = os.path.relpath(os.path.join(work, "out"), str(tmp_path))
    new = after - before
    assert new, "the tools wrote nothing"
    strays = {p for p in new if not p.startswith(out + os.sep)
              and p not in {s + suffix for s in stems for suffix in (".png", ".peak.png")}}
    assert not strays, f"files outside the output folder: {sorted(strays)}"
    assert not [p for p in os.listdir("/tmp") if p.startswith(escape)]
    assert not os.path.exists(os.path.join(work, "abs_run"))


def test_the_cli_writes_only_where_its_arguments_say(hostile, capsys):
    work, logs = hostile
    out = os.path.join(work, "out")
    rc, stdout, err = cli(capsys, "export", "--tensorboard", os.path.join(out, "tb"), *logs)
    assert rc == 0, err
    assert "4 runs)" in stdout
    rc, _, err = cli(capsys, "export", "--chrome", os.path.join(out, "t.json"), *logs)
    assert rc == 0, err
    for flags in ([], ["--peak"]):
        rc, _, err = cli(capsys, "plot", *flags, *logs)  # beside each log: LOG.png, LOG.peak.png
        assert rc == 0, err
    for i, log in enumerate(logs):
        for flags in ([], ["--peak"], ["--sweep"]):
            rc, _, err = cli(capsys, "plot", *flags, log, "-o", os.path.join(out, f"{i}{''.join(flags)}.png"))
            assert rc == 0, err
    for mode in ([], ["--json"]):
        assert cli(capsys, "report", *mode, *logs)[0] == 0
    tb = os.path.join(out, "tb")
    dirs = sorted(os.path.relpath(d, tb) for d, _, files in os.walk(tb) if files)
    assert all(part == component(part) for d in dirs for part in d.split(os.sep)), dirs
    assert len(dirs) == 4


def test_the_python_functions_write_only_where_their_arguments_say(hostile):
    work, logs = hostile
    out = os.path.join(work, "out")
    assert _export.export_tensorboard(logs, os.path.join(out, "tb")).runs == 4
    assert _export.export_chrome(logs, os.path.join(out, "t.json")).runs == 4
    for i, log in enumerate(logs):
        plot_log(log, os.path.join(out, f"{i}.png"))
        plot_log(log, os.path.join(out, f"{i}.sweep.png"), sweep=True)
        plot_peak(log, os.path.join(out, f"{i}.peak.png"))


def test_a_symbolic_link_in_the_output_folder_is_refused(tmp_path):
    pytest.importorskip("tensorboard")
    logs = [fx.write(str(tmp_path / f"r{k}.jsonl"), [dict(r, rank=k, run_id=f"{k:012x}")
                                                    for r in readerlogs.every_kind(rank=k)]) for k in (0, 1)]
    tb = tmp_path / "tb"
    tb.mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tb / "rank1")
    with pytest.raises(ConfigError, match="outside it"):
        _export.export_tensorboard(logs, str(tb))
    assert os.listdir(tmp_path / "elsewhere") == []


def test_components_keep_a_fixed_alphabet_and_length_and_are_unique():
    hostile = ["", ".", "..", "../x", "/abs", "a" * 500, "\x00\x1b\x9b", "ü", "a_b", "a/b", "a" * 64]
    out = components(hostile)
    assert len(set(out)) == len(out)
    for name in out:
        assert name and not name.startswith(".") and len(name) <= 64
        assert set(name) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
    assert components(["5f0c2e9a41b7", "run2"]) == ["5f0c2e9a41b7", "run2"]  # a real id stays itself


def test_inside_refuses_a_path_that_leaves_the_folder(tmp_path):
    assert inside(str(tmp_path), str(tmp_path / "a" / "b"), "--x") == str(tmp_path / "a" / "b")
    for escape in (str(tmp_path / ".." / "x"), "/etc/x"):
        with pytest.raises(ConfigError, match="'--x'.*outside it"):
            inside(str(tmp_path), escape, "--x")
