"""On a real GPU: every kind of sync point is counted once at the user's line, nothing else is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import stepprof
from stepprof import _syncs

from .conftest import marked_line
from .test_cuda import _count_syncs

pytestmark = pytest.mark.cuda

def line_of(marker: str) -> str:
    return marked_line(__file__, marker)


def one_step(log):
    (rec,) = [r for r in stepprof.read(log) if r["kind"] == "step"]
    return rec


def operands():
    x = torch.randn(1000, device="cuda")
    return x, x > 0, x.sum(), torch.tensor([1, 2, 3, 4], device="cuda"), torch.ones(100)


def test_each_of_the_14_kinds_is_counted_once_at_its_line(log, capsys):
    x, mask, s, rep, host = operands()
    ev = torch.cuda.Event()
    stream = torch.cuda.current_stream()
    torch.cuda.synchronize()
    with stepprof.Profiler(log) as prof:
        with prof.step():
            s.item()  # item
            x[:4].tolist()  # tolist
            x.cpu()  # to_host
            float(s)  # scalar
            if s > 0:  # bool
                pass
            torch.nonzero(x)  # nonzero
            x[mask]  # mask_index
            torch.masked_select(x, mask)  # masked_select
            torch.unique(x)  # unique
            torch.repeat_interleave(x[:4], rep)  # repeat_interleave
            print(x[:3])  # print
            host.to("cuda")  # to_device
            torch.cuda.synchronize()  # device_synchronize
            stream.synchronize()  # stream_synchronize
            ev.record()
            ev.synchronize()  # event_synchronize
            # look-alikes that do not wait
            x.to("cpu", non_blocking=True)
            torch.nonzero_static(x, size=10)
            x[mask] = 1.0
    capsys.readouterr()
    rec = one_step(log)
    got = {(s["where"], s["kind"]): s["count"] for s in rec["syncs"]["sites"]}
    kinds = [
        "item", "tolist", "to_host", "scalar", "bool", "nonzero", "mask_index", "masked_select",
        "unique", "repeat_interleave", "print", "to_device", "device_synchronize",
        "stream_synchronize", "event_synchronize",
    ]
    # repeat_interleave without output_size drains the queue twice inside one C++ op (the
    # output size, then a check that repeats >= 0): two waits, one call, because stepprof
    # measured its waits per call at the first step.  print's dozen waits run inside torch's
    # Python formatting code, in one frame of torch's: one count.
    expected = {(line_of(k), k): 1 for k in kinds}
    assert got == expected, json.dumps(rec["syncs"], indent=1)
    assert rec["syncs"]["count"] == len(kinds)
    assert _syncs.WAITS_PER_CALL == {"repeat_interleave": 2}
    waits = {s["kind"]: s["waits"] for s in rec["syncs"]["sites"]}
    assert waits["repeat_interleave"] == 2 and waits["print"] > 3
    assert rec["syncs"]["mechanism"] == "warn"
    assert set(rec["allocator"]) == {
        "num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free",
    }



def test_repeat_interleave_in_a_loop_counts_calls_not_waits(log):
    rep = torch.tensor([1, 2, 3], device="cuda")
    with stepprof.Profiler(log) as prof:
        with prof.step():
            for _ in range(3):
                torch.repeat_interleave(rep)  # loop
            rep.repeat_interleave(2)  # int repeats: no wait
            torch.repeat_interleave(rep, output_size=6)  # output_size: no wait
    rec = one_step(log)
    (site,) = rec["syncs"]["sites"]
    assert (site["where"], site["kind"], site["count"], site["waits"]) == (
        line_of("loop"), "repeat_interleave", 3, 6
    ), json.dumps(rec["syncs"], indent=1)


def test_sync_free_step_counts_zero_and_stepprof_adds_no_sync(log):
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU()).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 256, device="cuda")
    with stepprof.Profiler(log, warmup=2, max_syncs=0, on_sync="raise") as prof:
        for i in range(22):
            if i == 2:
                seen = _count_syncs()  # GPU-trace callbacks: every wait, whoever makes it
            with prof.step():
                with prof.measure("forward"):
                    loss = model(x).square().mean()
                with prof.measure("backward"):
                    loss.backward()
                with prof.measure("optimizer"):
                    opt.step()
                    opt.zero_grad()
        assert seen == [], f"waits during sync-free profiled steps: {seen}"
    steps = [r for r in stepprof.read(log) if r["kind"] == "step" and not r["warmup"]]
    assert len(steps) == 20
    assert all(r["syncs"]["count"] == 0 and r["syncs"]["waits"] == 0 for r in steps)
    assert all(ph["syncs"] == 0 for r in steps for ph in r["phases"].values())


def test_a_loop_counts_each_call(log):
    s = torch.ones(8, device="cuda").sum()
    with stepprof.Profiler(log) as prof:
        with prof.step():
            for _ in range(3):
                s.item()  # looped
    (site,) = one_step(log)["syncs"]["sites"]
    assert (site["where"], site["count"], site["waits"]) == (line_of("looped"), 3, 3)


def test_budget_raise_stops_at_the_offending_line(log):
    s = torch.ones(8, device="cuda").sum()
    with stepprof.Profiler(log) as prof:
        with pytest.raises(stepprof.SyncBudgetExceeded) as info:
            with prof.step(max_syncs=0, on_sync="raise"):
                s.item()  # offending
    assert (info.value.where, info.value.kind) == (line_of("offending"), "item")
    line = int(line_of("offending").rsplit(":", 1)[1])
    assert any(str(e.path) == __file__ and e.lineno + 1 == line for e in info.traceback)
    assert one_step(log)["error"]["type"] == "SyncBudgetExceeded"


def test_global_state_is_restored_after_a_step_that_raised(log):
    s = torch.ones(8, device="cuda").sum()
    before = (
        torch.cuda.get_sync_debug_mode(), list(warnings.filters), warnings.showwarning,
        warnings._showwarnmsg, torch.cuda.synchronize, torch.cuda.Event.synchronize,
    )
    with stepprof.Profiler(log) as prof:
        with pytest.raises(ValueError, match="planted"):
            with prof.step():
                s.item()
                raise ValueError("planted")
    after = (
        torch.cuda.get_sync_debug_mode(), list(warnings.filters), warnings.showwarning,
        warnings._showwarnmsg, torch.cuda.synchronize, torch.cuda.Event.synchronize,
    )
    assert after == before
    assert one_step(log)["syncs"]["count"] == 1


def test_users_own_sync_debug_modes_are_respected(log):
    s = torch.ones(8, device="cuda").sum()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with stepprof.Profiler(log) as prof:
                with prof.step():
                    s.item()
        assert torch.cuda.get_sync_debug_mode() == 1
        assert sum("synchronizing" in str(w.message) for w in caught) == 1  # still shown
        assert one_step(log)["syncs"]["count"] == 1
        torch.cuda.set_sync_debug_mode("error")
        os.remove(log)
        with stepprof.Profiler(log) as prof:
            with prof.step():
                torch.ones(8, device="cuda").square()
        rec = one_step(log)
        assert rec["syncs"] is None and "'error'" in rec["unavailable"]["syncs"]
        assert torch.cuda.get_sync_debug_mode() == 2
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_syncs_in_and_between_steps_and_the_mode_at_close(log):
    """The route is installed at the first step and stays: a sync between steps counts in
    ``syncs_outside_steps`` and in no step; close puts the sync-debug mode back."""
    s = torch.ones(8, device="cuda").sum()
    before = (torch.cuda.get_sync_debug_mode(), list(warnings.filters), warnings._showwarnmsg,
              torch.cuda.synchronize, torch.cuda.Event.synchronize)
    assert before[0] == 0
    with stepprof.Profiler(log) as prof:
        for _ in range(3):
            with prof.step():
                s.item()  # in-step
            assert torch.cuda.get_sync_debug_mode() == 1  # installed for the session
            s.item()
            torch.cuda.synchronize()
    after = (torch.cuda.get_sync_debug_mode(), list(warnings.filters), warnings._showwarnmsg,
             torch.cuda.synchronize, torch.cuda.Event.synchronize)
    assert after == before
    recs = [r for r in stepprof.read(log) if r["kind"] == "step"]
    assert [(r["syncs"]["count"], r["syncs"]["sites"][0]["where"]) for r in recs] == [(1, line_of("in-step"))] * 3
    assert prof.summary.syncs_outside_steps == 6  # two a step, and none of stepprof's own


def test_a_users_error_mode_mid_session_is_given_way_to_and_kept(log):
    s = torch.ones(8, device="cuda").sum()
    try:
        with stepprof.Profiler(log) as prof:
            with prof.step():
                s.item()
            torch.cuda.set_sync_debug_mode("error")
            with prof.step():
                torch.ones(8, device="cuda").square()
        first, second = [r for r in stepprof.read(log) if r["kind"] == "step"]
        assert first["syncs"]["count"] == 1
        assert second["syncs"] is None and "'error'" in second["unavailable"]["syncs"]
        assert prof.summary.syncs_outside_steps is None
        assert "'error'" in prof.summary.unavailable["syncs_outside_steps"]
        assert torch.cuda.get_sync_debug_mode() == 2  # theirs, kept
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_gets_the_sync_state_back(log):
    s = torch.ones(8, device="cuda").sum()
    original = torch.cuda.synchronize
    prof = stepprof.Profiler(log)
    with prof.step():
        s.item()
    assert torch.cuda.get_sync_debug_mode() == 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # no CUDA call in a forked child: the C getter reads a host-side flag
        try:
            ours = [f for f in warnings.filters if "synchronizing" in getattr(f[1], "pattern", "")]
            report = {"mode": torch._C._cuda_get_sync_debug_mode(), "filter": bool(ours),
                      "synchronize": torch.cuda.synchronize is original}
        except BaseException as e:  # noqa: BLE001
            report = {"error": repr(e)}
        os.write(write, json.dumps(report).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        report = json.loads(f.read())
    os.waitpid(pid, 0)
    assert report == {"mode": 0, "filter": False, "synchronize": True}
    assert torch.cuda.get_sync_debug_mode() == 1  # the parent's session goes on
    with prof.step():
        s.item()
    prof.close()
    assert torch.cuda.get_sync_debug_mode() == 0
    assert [r["syncs"]["count"] for r in stepprof.read(log) if r["kind"] == "step"] == [1, 1]


_TRACE_SCRIPT = """\
import json, sys, torch, stepprof
s = torch.ones(8, device="cuda").sum()
ev = torch.cuda.Event()
with stepprof.Profiler(sys.argv[1], syncs="trace") as prof:
    with prof.step():
        s.item()
        torch.cuda.synchronize()
        ev.record()
        ev.synchronize()
    s.item()  # between steps
rec = [r for r in stepprof.read(sys.argv[1]) if r["kind"] == "step"][0]
raised = None
with stepprof.Profiler(None, syncs="trace") as p2:
    try:
        with p2.step(max_syncs=0, on_sync="raise"):
            s.item()
    except stepprof.SyncBudgetExceeded as e:
        raised = [e.kind, e.where.rsplit(":", 1)[1], e.count]
print(json.dumps(rec["syncs"]))
print(json.dumps(raised))
print(json.dumps(prof.summary.syncs_outside_steps))
"""


def test_trace_mechanism_self_tests_and_counts(tmp_path):
    # In a child process: activating torch's GPU trace cannot be undone.
    script = tmp_path / "trace_step.py"
    script.write_text(_TRACE_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "trace.jsonl")],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert out.returncode == 0, out.stderr
    syncs, raised, outside = (json.loads(x) for x in out.stdout.strip().splitlines()[-3:])
    assert syncs["mechanism"] == "trace"
    # A budget error found in a trace callback (which torch calls from C++ and which cannot
    # raise into the user's code) is raised at the step's exit, naming the line.
    assert raised == ["item", "16", 1]
    assert outside == 1  # the wait between steps; stepprof's own at close count nowhere
    assert sorted((s["kind"], s["where"].rsplit(":", 1)[1]) for s in syncs["sites"]) == [
        ("device_synchronize", "7"), ("event_synchronize", "9"), ("item", "6"),
    ]
