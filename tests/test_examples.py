"""Every script in examples/ runs on the CPU, under a time limit, and writes a log with records."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import stepprof

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
#: Seconds each example may take here (they take under 30 s on an idle 2-core CPU).
LIMIT_S = 180


def _run(args: list[str], cwd) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU, as in CI
    root = os.path.dirname(EXAMPLES)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")  # this checkout's stepprof
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=LIMIT_S)


def test_every_example_is_tested():
    scripts = {f for f in os.listdir(EXAMPLES) if f.endswith(".py")}
    assert scripts == {*SINGLE, "ddp_torchrun.py"}, "a new example needs its line in SINGLE or its own test"


#: example -> the kinds of record its log must hold
SINGLE = {
    "quickstart.py": {"step", "summary"},
    "find_batch_size.py": {"sweep_point", "sweep_result"},
    "sync_hunt.py": {"step", "summary"},
    "memory.py": {"step", "summary", "memory"},
    "compile.py": {"step", "summary"},
    "lightning_callback.py": {"step", "summary"},
    "hf_trainer.py": {"step", "summary"},
}


@pytest.mark.parametrize("script", sorted(SINGLE))
def test_example_runs_on_the_cpu(script, tmp_path):
    log = str(tmp_path / "example.jsonl")
    done = _run([sys.executable, os.path.join(EXAMPLES, script), log], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    kinds = {r["kind"] for r in stepprof.read(log)}
    assert SINGLE[script] <= kinds, kinds
    if script not in ("lightning_callback.py", "hf_trainer.py"):  # the frameworks' own warnings
        assert "Warning:" not in done.stderr, done.stderr[-2000:]  # an example runs clean
    with open(os.path.join(EXAMPLES, script)) as f:
        first = f.read().split('"""')[1].strip().splitlines()[0]
    assert first.endswith(".") and len(first) <= 110  # the one-line docstring
    if script == "compile.py":
        steps = list(stepprof.read(log, kind="step"))
        assert any(r.get("compiled") for r in steps) or "cannot run here" in done.stdout
    if script == "find_batch_size.py":
        assert "recommended" in done.stdout


def test_ddp_example_runs_on_two_cpu_ranks(tmp_path):
    """torchrun with two processes on gloo: a log per rank, rank 0's with the ranks records."""
    log = str(tmp_path / "ddp.jsonl")
    done = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                 os.path.join(EXAMPLES, "ddp_torchrun.py"), "--steps", "12", "--ranks-every", "4",
                 "--jsonl", log], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for rank in (0, 1):
        recs = list(stepprof.read(str(tmp_path / f"ddp.rank{rank}.jsonl")))
        assert sum(r["kind"] == "step" for r in recs) == 12 and {r.get("rank") for r in recs} == {rank}
    assert any(r["kind"] == "ranks" for r in stepprof.read(str(tmp_path / "ddp.rank0.jsonl")))
    printed = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    again = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                  os.path.join(EXAMPLES, "ddp_torchrun.py"), "--steps", "12", "--ranks-every", "4",
                  "--jsonl", log], tmp_path)
    assert again.returncode == 0, again.stderr[-4000:]
    # the log is appended to; the example prints this run's ranks records only, not the last run's
    ranks = [r for r in stepprof.read(str(tmp_path / "ddp.rank0.jsonl")) if r["kind"] == "ranks"]
    assert printed and len(ranks) == 2 * len(printed)
    assert len([line for line in again.stdout.splitlines() if line.startswith("step ")]) == len(printed)
