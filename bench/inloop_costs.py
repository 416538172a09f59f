"""What each thing stepprof does per step costs *inside* the launch-bound loop.

A tight loop (bench/primitives.py) undersells these costs two to ten times: inside a
training step the host's caches are cold.  So each primitive is added, alone, to
bench/overhead.py's launch-bound step, and timed against the bare step in interleaved
rounds, as bench/overhead.py does (median of per-round ratios, 95% bootstrap interval,
process CPU time added):

  ev2, ev5    2 or 5 ``torch.Event.record()`` per step (from a pool);
  mem1        one ``_cuda_resetPeakMemoryStats`` and one ``_cuda_memoryStats`` read;
  syncroute   the "warn" sync route's per-step work: its check and the step's tracker pushed
              and popped (``_syncs.Sessions.watch``/``detach``), the route held by a
              session for the whole run, as a profiler holds it;
  nvtx4       four NVTX push/pop pairs;
  pyrec       building a step-record-like nested dict;
  collsim     a thread that, every 20 ms, calls ``elapsed_time`` 4 times and ``query``
              once per step since its last wake (what the collector does);
  floor-step  only the CUDA calls a step record needs, with none of stepprof's Python
              around them: 2 event records, the peak reset and read, the sync route
              watched (as syncroute), and on a second thread 1 ``elapsed_time`` + 1 ``query``;
  floor-full  the same for the phased loop: 5 event records, 4 ``elapsed_time`` + 1 ``query``;
  step, full, full-inline   stepprof itself (bench/overhead.py's variants), and
  full-nogc   ``full`` with Python's garbage collector off during the round.
Diagnostics of where in-loop costs come from (how much pure Python work costs inside
the loop and on a second thread):
  pywork      pure Python work that costs PYWORK_US in a tight loop, on the training thread
              at each step's end;
  collpy      the same work on a second thread, every 20 ms, for each step since its last
              wake, in one go (the collector's shape);
  collpy-yield  the same, with ``time.sleep(0)`` (a GIL release) after each step's share.

    python bench/inloop_costs.py [--rounds 150] [--steps 10] [--out inloop_costs.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from stepprof import _syncs  # noqa: E402
from stepprof._device import sync_routes  # noqa: E402
from stepprof._recorder.profiler import _make_profiler  # noqa: E402
from _common import run_info  # noqa: E402
from overhead import make_workload, median_ci, phased_step  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=150)
ap.add_argument("--steps", type=int, default=10, help="steps per variant per round")
ap.add_argument("--out", default="inloop_costs.json")
args = ap.parse_args()
if not torch.cuda.is_available():
    print("bench/inloop_costs.py needs CUDA; nothing measured")
    raise SystemExit(0)
rounds, k = args.rounds, args.steps
fwd, bwd, opt = make_workload(256, 64)
tmp = tempfile.mkdtemp()
dev = torch.cuda.current_device()
pool = [torch.Event(device="cuda", enable_timing=True) for _ in range(64)]
ms = torch._C._cuda_memoryStats; rp = torch._C._cuda_resetPeakMemoryStats
push = torch._C._nvtx.rangePushA; pop = torch._C._nvtx.rangePop
tracker = _syncs.SyncTracker("warn")
i = [0]
def ev(n):
    def f():
        j = i[0]; i[0] = (j + n) % 60
        pool[j].record(); fwd(); bwd(); opt()
        for m in range(1, n): pool[j + m].record()
    return f
def mem1():
    rp(dev); fwd(); bwd(); opt(); s = ms(dev); s["allocated_bytes"]["all"]["peak"]
sessions = _syncs.Sessions()  # holds the "warn" route for the whole run, as a profiler does
def syncroute():
    tracker.begin([], None, "count", False)
    sessions.watch(tracker, sync_routes.warn_route)
    fwd(); bwd(); opt()
    _syncs.detach(tracker); tracker.end()
def nvtx4():
    push("s"); push("f"); fwd(); pop(); push("b"); bwd(); pop(); push("o"); opt(); pop(); pop()
def pyrec():
    fwd(); bwd(); opt()
    r = {"a": 1, "phases": {n: {"wall_ms": 1.0, "gpu_ms": 2.0, "peak": 3, "count": 1, "syncs": 0} for n in ("f", "b", "o")},
         "unavailable": {}, "syncs": {"count": 0, "sites": [], "mechanism": "warn"}, "x": [1, 2], "y": (3, 4)}
    sink.append(r)
    if len(sink) > 100: sink.clear()
sink = []
# Pure Python work calibrated to PYWORK_US in a tight loop: dict and attribute churn like
# building a record.
PYWORK_US = 20.0
def _work(n):
    d = {}
    for j in range(n):
        d[j & 15] = {"a": j, "b": (j, j + 1), "c": str(j & 3)}
    return d
_n = 10
while True:
    t0 = time.perf_counter_ns()
    for _ in range(200): _work(_n)
    per_call = (time.perf_counter_ns() - t0) / 200 / 1e3
    if per_call >= PYWORK_US: break
    _n = int(_n * PYWORK_US / per_call) + 1
PYWORK_N = _n
print(f"pywork: {PYWORK_N} iterations, {per_call:.1f} us per call in a tight loop")
def pywork():
    fwd(); bwd(); opt(); _work(PYWORK_N)
# a simulated collector: every 20 ms, elapsed_time on 4 completed pairs per step since the last wake
done_ev = [torch.Event(device="cuda", enable_timing=True) for _ in range(2)]
done_ev[0].record(); done_ev[1].record(); torch.cuda.synchronize()
coll_stop = threading.Event()
# Per variant, the calls its steps owe the simulated collector and those done, as running
# totals (only the training thread adds to owed, only the thread to done).  The thread works
# only for the variant being timed, and stops mid-batch when its round ends: a share left
# at a round's end waits for that variant's next round, never another variant's.
coll_on = [None]  # the variant being timed, if it has a simulated collector
coll_owed = {v: [0, 0] for v in ("collsim", "floor-step", "floor-full")}  # elapsed_time, query
coll_done = {v: [0, 0] for v in coll_owed}
def coll_loop():
    while not coll_stop.wait(0.02):
        v = coll_on[0]
        if v not in coll_owed:
            continue
        owed, done = coll_owed[v], coll_done[v]
        while done[0] < owed[0] and coll_on[0] == v:
            done_ev[0].elapsed_time(done_ev[1]); done[0] += 1
        while done[1] < owed[1] and coll_on[0] == v:
            done_ev[1].query(); done[1] += 1
threading.Thread(target=coll_loop, daemon=True).start()
_cs, _fs, _ff = coll_owed["collsim"], coll_owed["floor-step"], coll_owed["floor-full"]
def collsim():
    fwd(); bwd(); opt(); _cs[0] += 4; _cs[1] += 1
# The floor: only the CUDA calls the issue asks for, with none of stepprof's bookkeeping.
def floor_step():
    j = i[0]; i[0] = (j + 2) % 60
    tracker.begin([], None, "count", False); sessions.watch(tracker, sync_routes.warn_route)
    rp(dev); pool[j].record()
    fwd(); bwd(); opt()
    pool[j + 1].record(); ms(dev)["allocated_bytes"]["all"]["peak"]
    _syncs.detach(tracker); tracker.end()
    _fs[0] += 1; _fs[1] += 1
def floor_full():
    j = i[0]; i[0] = (j + 5) % 60
    tracker.begin([], None, "count", False); sessions.watch(tracker, sync_routes.warn_route)
    rp(dev); pool[j].record()
    fwd(); pool[j + 1].record(); bwd(); pool[j + 2].record(); opt(); pool[j + 3].record()
    pool[j + 4].record(); ms(dev)["allocated_bytes"]["all"]["peak"]
    _syncs.detach(tracker); tracker.end()
    _ff[0] += 4; _ff[1] += 1

# The same for pure Python work: owed and done per variant, worked only in its own rounds.
py_on = [None]
py_owed = {"collpy": [0], "collpy-yield": [0]}
py_done = {v: [0] for v in py_owed}
def collpy_loop():
    while not coll_stop.wait(0.02):
        v = py_on[0]
        if v not in py_owed:
            continue
        owed, done, yield_ = py_owed[v], py_done[v], v == "collpy-yield"
        while done[0] < owed[0] and py_on[0] == v:
            _work(PYWORK_N); done[0] += 1
            if yield_: time.sleep(0)
threading.Thread(target=collpy_loop, daemon=True).start()
_cp, _cy = py_owed["collpy"], py_owed["collpy-yield"]
def collpy():
    fwd(); bwd(); opt(); _cp[0] += 1
def collpy_yield():
    fwd(); bwd(); opt(); _cy[0] += 1

def prof(**kw):
    return _make_profiler(os.path.join(tmp, f"p{len(os.listdir(tmp))}.jsonl"), **kw)
p_step, p_full, p_full_ng, p_full_inl = prof(), prof(), prof(), prof(collect_every_s=None)
def bare(): fwd(); bwd(); opt()
def step():
    with p_step.step(batch_size=64):
        fwd(); bwd(); opt()
variants = {"bare": bare, "bare-again": bare, "ev2": ev(2), "ev5": ev(5), "mem1": mem1, "syncroute": syncroute,
            "nvtx4": nvtx4, "pyrec": pyrec, "collsim": collsim, "pywork": pywork, "collpy": collpy, "collpy-yield": collpy_yield,
            "floor-step": floor_step, "floor-full": floor_full, "step": step,
            "full": lambda: phased_step(p_full, 64, fwd, bwd, opt),
            "full-nogc": lambda: phased_step(p_full_ng, 64, fwd, bwd, opt),
            "full-inline": lambda: phased_step(p_full_inl, 64, fwd, bwd, opt)}
for fn in variants.values():
    for _ in range(10): fn()
torch.cuda.synchronize()
# stepprof's variants write a round's last records before the clock stops (and the warm-up's
# before the first round): left to the collector thread, they would be written during the
# next variant's round.
drains = {"step": p_step.flush, "full": p_full.flush, "full-nogc": p_full_ng.flush,
          "full-inline": p_full_inl.flush}
for d in drains.values(): d()
for owed, done in [*zip(coll_owed.values(), coll_done.values()), *zip(py_owed.values(), py_done.values())]:
    done[:] = owed  # the warm-up's simulated-collector work is not any round's
per = {v: [] for v in variants}; cpu = {v: [] for v in variants}
rng = random.Random(0)
for _ in range(rounds):
    order = list(variants); rng.shuffle(order)
    for v in order:
        fn = variants[v]
        coll_on[0] = v if v in coll_owed else None
        py_on[0] = v if v in py_owed else None
        if v == "full-nogc": gc.disable()
        torch.cuda.synchronize(); c0 = time.process_time(); t0 = time.perf_counter()
        for _ in range(k): fn()
        torch.cuda.synchronize()
        if v in drains: drains[v]()
        t1 = time.perf_counter(); c1 = time.process_time()
        gc.enable(); coll_on[0] = py_on[0] = None
        per[v].append((t1 - t0) / k * 1e6); cpu[v].append((c1 - c0) / k * 1e6)
coll_stop.set()
summ = {"step": p_step.close(), "full": p_full.close(), "full-nogc": p_full_ng.close(), "full-inline": p_full_inl.close()}
sessions.end()
out = {}
print(f"{run_info('inloop_costs.py')['gpu']}, {rounds} interleaved rounds x {k} steps")
print(f"{'variant':12s} {'us/step':>8s} {'added':>7s} {'ratio':>7s} {'CI95':>15s} {'cpu+':>7s} {'ovh':>6s}")
for v, xs in per.items():
    r = [x / b for x, b in zip(xs, per["bare"])]
    a = statistics.median([x - b for x, b in zip(xs, per["bare"])])
    c = statistics.median([x - b for x, b in zip(cpu[v], cpu["bare"])])
    ci = median_ci(r)
    o = summ[v].overhead_us_median if v in summ else None
    out[v] = {"us": statistics.median(xs), "added_us": a, "ratio": statistics.median(r), "ci": ci, "cpu_added_us": c, "overhead_us": o}
    print(f"{v:12s} {statistics.median(xs):8.1f} {a:7.1f} {statistics.median(r):7.4f} {ci[0]:.4f}-{ci[1]:.4f} {c:7.1f} {'' if o is None else round(o, 1)!s:>6s}")
with open(args.out, "w") as fh:
    json.dump({**run_info("inloop_costs.py"), "pywork_tight_us": per_call, "rounds": rounds, "steps_per_round": k, "variants": out}, fh, indent=2)
