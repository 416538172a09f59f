"""stepprof.sweep against a brute-force truth and a Lightning-style finder, on a GPU.

Workloads (bf16 autocast, AdamW, random data of the real shape and range, never zeros):
  transformer  nn.TransformerEncoder: 8 pre-norm causal layers, d_model 1024, 16 heads,
               FFN 4096, sequence 256, vocabulary 8192, next-token cross-entropy
  cnn          a ResNet-18-style network (stem, 4 stages of 2 basic blocks, 64-512 channels),
               channels-last 3x128x128 images, 100 classes
Methods, each on a fresh model and optimizer after gc.collect() and empty_cache():
  truth     doubling from 1 until out of memory, then bisection until the boundary is exact;
            a size fits when 2 steps ran
  finder    Lightning's BatchSizeFinder in "binsearch" mode, written out here: from 2, doubling,
            then binary search to hi - lo <= 1; 3 steps per trial, gc.collect() + empty_cache()
            before each trial, at most 25 successful trials (Lightning's defaults)
  stepprof  stepprof.sweep(train_step, make_batch) with its defaults
torch's allocator is capped at --memory-gib with set_per_process_memory_fraction (real
allocator OOMs, a smaller device) so that the whole script stays near two minutes; pass
--memory-gib 0 for the whole GPU.  The order of finder and stepprof alternates by round.

    python bench/sweep.py [--memory-gib 32] [--quick] [--rounds 1] [--models transformer,cnn]
                          [--out sweep.json] [--plot-dir DIR]
    python bench/sweep.py --cpu-check 40   # the script itself, on the CPU: tiny models, and an
                                           # out-of-memory error above 40 samples (no figures)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stepprof
from _common import run_info  # bench/ is on sys.path when a script in it runs
from stepprof._sweep.trial import is_oom

# -- workloads -------------------------------------------------------------------------------

DEVICE = "cuda"
TINY = False      # --cpu-check: small models, to check the script quickly
OOM_ABOVE = None  # --cpu-check: make_batch raises torch.OutOfMemoryError above this many samples


class Transformer(nn.Module):
    def __init__(self, vocab=8192, d=1024, heads=16, layers=8, seq=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens) + self.pos, mask=self.mask, is_causal=True))


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.skip = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout else nn.Identity()
        )

    def forward(self, x):
        return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))) + self.skip(x))


def resnet18ish(classes=100):
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


def workload(name):
    """A fresh (train_step, make_batch) for ``name``, seeded, with its own model and optimizer."""
    torch.manual_seed(0)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    if name == "transformer":
        vocab, seq = (8192, 256) if not TINY else (256, 16)
        model = (Transformer() if not TINY else Transformer(vocab, 32, 2, 2, seq)).to(DEVICE)

        def make_batch(n):
            tokens = torch.randint(0, vocab, (n, seq + 1), device=DEVICE, generator=gen)
            return tokens[:, :-1], tokens[:, 1:]

        def loss_of(batch):
            x, y = batch
            return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    else:
        model = resnet18ish().to(DEVICE).to(memory_format=torch.channels_last)
        side = 128 if not TINY else 64

        def make_batch(n):
            x = torch.randn(n, 3, side, side, device=DEVICE, generator=gen).to(memory_format=torch.channels_last)
            return x, torch.randint(0, 100, (n,), device=DEVICE, generator=gen)

        def loss_of(batch):
            x, y = batch
            return nn.functional.cross_entropy(model(x), y)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step(batch):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = loss_of(batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if OOM_ABOVE is not None:
        inner = make_batch

        def make_batch(n):
            if n > OOM_ABOVE:
                raise torch.OutOfMemoryError(f"CUDA out of memory (simulated above {OOM_ABOVE})")
            return inner(n)

    return train_step, make_batch


def clean():
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def fits(train_step, make_batch, n, steps):
    """Run ``steps`` steps at batch ``n``; False on out-of-memory (cleaned up outside the except)."""
    ok, batch = True, None
    try:
        batch = make_batch(n)
        for _ in range(steps):
            train_step(batch)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    except RuntimeError as e:
        if not is_oom(e):
            raise
        ok = False
    batch = None
    if not ok:
        clean()
    return ok


# -- the three methods ------------------------------------------------------------------------


def truth(name):
    train_step, make_batch = workload(name)
    t0, trials = time.perf_counter(), 0
    lo, hi, n = 0, None, 1
    while hi is None:
        trials += 1
        clean()
        if fits(train_step, make_batch, n, 2):
            lo, n = n, 2 * n
        else:
            hi = n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        trials += 1
        clean()
        if fits(train_step, make_batch, mid, 2):
            lo = mid
        else:
            hi = mid
    return {"max_fit": lo, "first_oom": hi, "trials": trials, "wall_s": time.perf_counter() - t0}


def finder(name, init=2, steps_per_trial=3, max_trials=25):
    """Lightning's ``_run_binary_scaling``, without the Trainer around it."""
    train_step, make_batch = workload(name)
    t0, trials = time.perf_counter(), 0
    low, high, new_size, count = 1, None, init, 0
    while True:
        clean()                                  # garbage_collection_cuda() at the top of each trial
        trials += 1
        if fits(train_step, make_batch, new_size, steps_per_trial):
            count += 1
            if count >= max_trials:
                break
            low = new_size
            if high:
                if high - low <= 1:
                    break
                new_size = (high + low) // 2
            else:
                new_size *= 2
        else:
            high = new_size
            new_size = (high + low) // 2
            if high - low <= 1:
                break
    return {"max_fit": new_size, "trials": trials, "wall_s": time.perf_counter() - t0}


def ours(name, plot_dir=None):
    train_step, make_batch = workload(name)
    t0 = time.perf_counter()
    r = stepprof.sweep(train_step, make_batch, progress=False)
    wall = time.perf_counter() - t0
    print(r, flush=True)
    if plot_dir:
        try:
            r.plot(os.path.join(plot_dir, f"sweep-{name}.png"))
        except ImportError as e:
            print(f"(no plot: {e})")
    zone = r.thrash_zone
    return {
        "max_fit": r.max_fit, "first_oom": r.first_oom, "trials": r.trials, "wall_s": wall,
        "knee": r.knee, "recommended": r.recommended, "predicted_max": r.predicted_max,
        "thrash_zone": None if zone is None else [zone.start, zone[-1]], "stopped": r.stopped,
        "reason": r.reason, "notes": list(r.notes),
        "points": [
            {k: getattr(p, k) for k in ("trial", "phase", "batch_size", "oom", "samples_per_s", "step_ms",
                                        "step_ms_p10", "step_ms_p90", "timed_steps", "peak_allocated_bytes",
                                        "alloc_retries", "device_allocs", "leaked_bytes", "wall_s")}
            for p in r.points
        ],
    }


# -- main --------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--memory-gib", type=float, default=32.0,
                    help="cap torch's allocator at this many GiB (0: the whole GPU)")
    ap.add_argument("--quick", action="store_true", help="12 GiB and one round: about a third of the time")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of finder and stepprof (alternating order)")
    ap.add_argument("--models", default="transformer,cnn")
    ap.add_argument("--out", default="sweep.json")
    ap.add_argument("--plot-dir", default=None, help="write stepprof's plot per model here (needs matplotlib)")
    ap.add_argument("--cpu-check", type=int, default=None, metavar="N",
                    help="check the script on the CPU: tiny models, simulated OOM above N samples")
    args = ap.parse_args()
    global DEVICE, TINY, OOM_ABOVE
    if args.cpu_check is not None:
        DEVICE, TINY, OOM_ABOVE = "cpu", True, args.cpu_check
        gib, total = 0.0, 0
    elif not torch.cuda.is_available():
        print("bench/sweep.py needs CUDA; nothing measured (--cpu-check N checks the script on the CPU)")
        return 0
    else:
        gib = 12.0 if args.quick else args.memory_gib
        total = torch.cuda.get_device_properties(0).total_memory
        if gib > 0:
            torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total))
    results = {
        **run_info("sweep.py", None if DEVICE == "cuda" else "cpu (script check)"),
        "memory_gib": gib if gib > 0 else total / 2**30,
        "models": {},
    }
    for name in args.models.split(","):
        clean()
        out = {"truth": truth(name), "finder": [], "stepprof": []}
        for i in range(args.rounds):
            order = ("finder", "stepprof") if i % 2 == 0 else ("stepprof", "finder")
            for method in order:
                clean()
                out[method].append(finder(name) if method == "finder" else ours(name, args.plot_dir))
        t = out["truth"]["max_fit"]
        fw = statistics.median(x["wall_s"] for x in out["finder"])
        sw = statistics.median(x["wall_s"] for x in out["stepprof"])
        out["summary"] = {
            "truth_max_fit": t,
            "finder_max_fit": out["finder"][0]["max_fit"],
            "stepprof_max_fit": out["stepprof"][0]["max_fit"],
            "stepprof_max_fit_error": (t - out["stepprof"][0]["max_fit"]) / t,
            "finder_max_fit_error": (t - out["finder"][0]["max_fit"]) / t,
            "stepprof_over_finder_wall": sw / fw,
            "knee": out["stepprof"][0]["knee"],
            "recommended": out["stepprof"][0]["recommended"],
            "thrash_zone": out["stepprof"][0]["thrash_zone"],
        }
        results["models"][name] = out
        with open(args.out, "w") as fh:   # after each model: a partial run still leaves results
            json.dump(results, fh, indent=2)

    print(f"\n{results['gpu']}, torch {results['torch']}, allocator capped at {results['memory_gib']:.1f} GiB")
    print(f"{'model':12s} {'method':9s} {'wall s':>7s} {'trials':>6s} {'max_fit':>8s} {'vs truth':>9s} "
          f"{'knee':>6s} {'thrash zone':>13s}")
    for name, out in results["models"].items():
        t = out["truth"]["max_fit"]
        rows = [("truth", out["truth"])] + [("finder", x) for x in out["finder"]] + [
            ("stepprof", x) for x in out["stepprof"]]
        for method, x in rows:
            err = (t - x["max_fit"]) / t if x["max_fit"] else float("nan")
            zone = x.get("thrash_zone")
            print(f"{name:12s} {method:9s} {x['wall_s']:7.1f} {x['trials']:6d} {x['max_fit'] or 0:8,d} "
                  f"{err:9.1%} {x.get('knee') or '':>6} {'' if not zone else f'{zone[0]}-{zone[1]}':>13s}")
        s = out["summary"]
        target = "meets" if s["stepprof_over_finder_wall"] <= 0.75 else "misses"
        print(f"{name:12s} stepprof/finder wall time {s['stepprof_over_finder_wall']:.2f} "
              f"({target} the <= 0.75 target); stepprof max_fit {s['stepprof_max_fit_error']:.1%} under the truth")
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
