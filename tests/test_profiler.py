"""The Profiler facade: closing, concurrent closes, forked children, the host's RSS."""

from __future__ import annotations

import time

import pytest

import stepprof

from .conftest import make, steps
from .fakes import FakeGpu


def test_close_is_idempotent_and_a_closed_profiler_refuses_steps(log, gpu):
    prof = make(log, gpu)
    with prof.step():
        pass
    s = prof.close()
    assert prof.close() is s and prof.summary is s and prof.closed
    with pytest.raises(stepprof.UsageError, match="closed"):
        with prof.step():
            pass
    assert len(list(stepprof.read(log, kind="summary"))) == 1


def test_close_from_two_threads_at_once_closes_once(log):
    """A second close() while the first is still synchronising waits for it and returns the
    same summary; the close-time records are written once."""
    import threading

    class SlowSync(FakeGpu):
        def __init__(self):
            super().__init__()
            self.waiting, self.go = threading.Event(), threading.Event()

        def synchronize(self):
            self.waiting.set()
            self.go.wait(5)
            super().synchronize()

    gpu = SlowSync()
    prof = make(log, gpu)
    with prof.step():
        gpu.launch(5.0)             # pending: close() must synchronise
    build = prof._build_summary
    slow = []

    def slow_build(*args):          # the first closer lingers before its summary
        if not slow:
            slow.append(1)
            time.sleep(0.2)
        return build(*args)

    prof._build_summary = slow_build
    got = [None, None]

    def closer(i):
        got[i] = prof.close()

    first = threading.Thread(target=closer, args=(0,))
    first.start()
    assert gpu.waiting.wait(5)
    second = threading.Thread(target=closer, args=(1,))
    second.start()
    time.sleep(0.1)                 # the second closer is inside close() too
    gpu.go.set()
    first.join(5)
    second.join(5)
    assert got[0] is not None and got[0] is got[1] is prof.summary
    assert gpu.syncs == 1
    kinds = [(r["kind"], r.get("trigger")) for r in stepprof.read(log)]
    assert kinds == [("step", None), ("memory", "after_warmup"), ("memory", "close"), ("summary", None)]


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_write_the_parents_pending_steps_again(log, gpu):
    """Steps pending in the parent at a fork are the parent's to write: a child that exits
    normally (closing its inherited profilers at interpreter exit) must not write them too."""
    import os

    from stepprof import _registry

    prof = make(log, gpu, collect_every_s=30, memory_every=0)  # step 0 stays pending
    with prof.step():
        pass
    pid = os.fork()
    if pid == 0:                                 # the child: as at its interpreter exit
        try:
            _registry._close_all_at_exit()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    prof.close()
    assert [r["step"] for r in steps(log)] == [0]


def test_a_forked_child_records_nothing_into_the_parents_log(log, gpu):
    """An inherited profiler is inert in a forked child: its steps and phases are not
    recorded, its close writes no summary, and using it warns once with the remedy."""
    import os
    import warnings as w

    prof = make(log, gpu, memory_every=0)
    with prof.step():
        pass
    r, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            with w.catch_warnings(record=True) as caught:
                w.simplefilter("always")
                for _ in range(2):
                    with prof.step():
                        with prof.measure("forward"):
                            pass
                s = prof.close()
            warned = [str(c.message) for c in caught if "inherited by the forked process" in str(c.message)]
            os.write(wr, f"{len(warned)} {s.steps}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(wr)
    _, status = os.waitpid(pid, 0)
    got = os.read(r, 100).decode()
    os.close(r)
    assert status == 0, got
    with prof.step():
        pass
    prof.close()
    kinds = [(x["kind"], x.get("step")) for x in stepprof.read(log) if x["kind"] != "memory"]
    assert kinds == [("step", 0), ("step", 1), ("summary", None)]   # the parent's only
    assert got.split()[0] == "1"                 # one warning, at the first use
