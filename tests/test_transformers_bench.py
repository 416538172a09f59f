"""bench/finders_transformers.py --quick: the script itself, on the CPU (tiny BERT, simulated OOM)."""

from __future__ import annotations

import importlib.util
import json
import os
import warnings

import pytest

pytest.importorskip("transformers")

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def test_finders_transformers_quick_runs_both_finders_and_writes_its_json(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    spec = importlib.util.spec_from_file_location("finders_transformers", os.path.join(BENCH, "finders_transformers.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with warnings.catch_warnings():  # accelerate's lazy imports add filters of their own
        out = mod.main(["--quick", "--out", str(tmp_path / "r.json")])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["quick"] is True and saved["rows"] == json.loads(json.dumps(out["rows"]))
    # accelerate's finder shrank from 32 past the simulated limit (24 samples), then ran.
    tried = saved["hf"]["tried"]
    assert tried[0] == 32 and tried[-1] == saved["hf"]["picked"] <= 24 < tried[-2]
    assert saved["stepprof"]["max_fit"] == 24 < saved["stepprof"]["first_oom"]
    assert all(r["samples_per_s"] and r["samples_per_s"] > 0 for r in saved["rows"])
