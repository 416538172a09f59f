"""Sync tracking's per-step cost with the "warn" route installed per step (what stepprof
does: the step is the scope that restores the sync-debug mode, filters and patches) against
the same route installed once for the whole round (a session-scoped route, as a design
alternative), on bench/overhead.py's launch-bound step, interleaved against the bare step.

    python bench/sync_route_scope.py [ROUNDS=200] [STEPS=10]
"""
import json, os, random, statistics, sys, time
import torch
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE); sys.path.insert(0, os.path.join(HERE, ".."))
from stepprof import _syncs
from stepprof._device import sync_routes
from overhead import make_workload, median_ci

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 200
k = int(sys.argv[2]) if len(sys.argv) > 2 else 10
fwd, bwd, opt = make_workload(256, 64)
tr = _syncs.SyncTracker("warn")
outer = _syncs.SyncTracker("warn")
def bare(): fwd(); bwd(); opt()
def per_step():
    tr.begin([], None, "count", False); _syncs.attach(tr, sync_routes.install_warn_route)
    fwd(); bwd(); opt()
    _syncs.detach(); tr.end()
def session():  # the route stays installed (outer attach per round); per step: the tracker only
    tr.begin([], None, "count", False); _syncs.attach(tr, sync_routes.install_warn_route)
    fwd(); bwd(); opt()
    _syncs.detach(); tr.end()
variants = {"bare": bare, "bare-again": bare, "per-step": per_step, "session": session}
for fn in variants.values():
    for _ in range(10): fn()
torch.cuda.synchronize()
per = {v: [] for v in variants}
rng = random.Random(0)
for _ in range(rounds):
    order = list(variants); rng.shuffle(order)
    for v in order:
        fn = variants[v]
        if v == "session":
            outer.begin([], None, "count", False); _syncs.attach(outer, sync_routes.install_warn_route)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(k): fn()
        torch.cuda.synchronize(); per[v].append((time.perf_counter() - t0) / k * 1e6)
        if v == "session":
            _syncs.detach(); outer.end()
out = {}
for v, xs in per.items():
    r = [x / b for x, b in zip(xs, per["bare"])]
    a = statistics.median([x - b for x, b in zip(xs, per["bare"])])
    ci = median_ci(r)
    out[v] = {"added_us": a, "ratio": statistics.median(r), "ci": ci}
    print(f"{v:12s} {statistics.median(xs):8.1f} {a:7.1f} {statistics.median(r):7.4f} {ci[0]:.4f}-{ci[1]:.4f}")
with open(os.path.join(os.environ.get("OUT", "."), "sync_route_scope.json"), "w") as fh:
    json.dump(out, fh, indent=1)
