"""The edges of the command line (issue 28, item 4): one exit status for a log with nothing to
show, another tool's log named as such, a closed pipe, ``--json`` errors, the user's paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from stepprof._cli import PIPE_CLOSED, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def no_steps(tmp_path):
    path = tmp_path / "summary-only.jsonl"
    path.write_text('{"schema_version": 2, "kind": "summary", "run_id": "r1"}\n')
    return str(path)


@pytest.fixture
def foreign(tmp_path):
    path = tmp_path / "wandb.jsonl"
    path.write_text('{"_step": 0, "loss": 1.5}\n{"_step": 1, "loss": 1.2}\n{"level": "info"}\n')
    return str(path)


def _commands(tmp_path, log):
    return [["report", log], ["report", "--json", log], ["plot", log, "-o", str(tmp_path / "p.png")],
            ["export", "--chrome", str(tmp_path / "t.json"), log]]


def test_every_command_exits_2_on_a_log_with_nothing_to_show(tmp_path, no_steps, capsys):
    pytest.importorskip("matplotlib")
    for argv in _commands(tmp_path, no_steps):
        assert main(argv) == 2, argv
        assert "no step" in capsys.readouterr().err, argv


def test_another_tools_log_is_named_not_a_stepprof_log_by_every_command(tmp_path, foreign, capsys):
    pytest.importorskip("matplotlib")
    for argv in _commands(tmp_path, foreign):
        assert main(argv) == 2, argv
        got = capsys.readouterr()
        assert "not a stepprof log: none of its 3 line(s) is a stepprof record" in got.out + got.err, argv


def test_a_report_piped_into_head_exits_quietly_with_the_pipes_status(tmp_path):
    from tests import logfixtures as fx  # a log big enough to outlast the pipe's buffer

    lines = "".join(json.dumps(fx.step_record(i, warmup=False, wall=7.0, gpu=7.0)) + "\n" for i in range(5))
    for k in range(60):  # a report of 60 logs: more than a pipe's 64 KiB buffer holds
        (tmp_path / f"run{k}.jsonl").write_text(lines)
    done = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {sys.executable} -m stepprof report --json {tmp_path}/run*.jsonl | head -c 10"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert done.stdout == '{\n  "stepp' and done.stderr == ""
    assert done.returncode == PIPE_CLOSED


@pytest.mark.skipif(torch.cuda.is_available(), reason="the failure is CUDA's absence")
def test_a_json_command_that_fails_says_why_in_json_too(capsys):
    assert main(["calibrate", "--json"]) == 2
    got = capsys.readouterr()
    assert json.loads(got.out) == {"error": "calibrate measures a CUDA GPU, and CUDA is not available here"}
    assert got.err.startswith("stepprof: calibrate measures a CUDA GPU")


def test_export_errors_name_the_users_path_not_its_temp_file(tmp_path, capsys):
    from tests import logfixtures as fx

    log = tmp_path / "run.jsonl"
    log.write_text(json.dumps(fx.step_record(0, warmup=False, wall=7.0, gpu=7.0)) + "\n")
    out = tmp_path / "trace.json"
    out.mkdir()  # a directory where the trace should go
    assert main(["export", "--chrome", str(out), str(log)]) == 2
    err = capsys.readouterr().err
    assert repr(str(out)) in err and ".stepprof-export-" not in err
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".stepprof-export-")]
