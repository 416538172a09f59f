"""Helpers shared by the report tests: the CLI runner and a realistic H200 log."""

from __future__ import annotations

import pytest

from stepprof import _cli
from stepprof._report import build_report

from . import logfixtures as fx


def cli(capsys, *argv):
    rc = _cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def report_dict(paths):
    """The report as ``--json`` prints it (a plain dict)."""
    return build_report(paths).to_dict()


@pytest.fixture
def h200_log(tmp_path):
    return fx.write(str(tmp_path / "h200.jsonl"), fx.training_log())
