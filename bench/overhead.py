"""stepprof's overhead on a training step, against a bare loop and torch.profiler.

Two steps (an 8-layer bf16 MLP with AdamW):
  compute-bound: 4096 wide, batch 4096 (about 7 ms on an H200);
  launch-bound:  256 wide, batch 64 (host-bound: launch cost dominates).
Variants, interleaved in a shuffled order every round:
  bare         the step as is (and bare-again, the same, as an A/A noise control);
  step         inside ``prof.step(batch_size=...)`` (the compiled boundary if built);
  full         ``prof.step`` plus forward/backward/optimizer phases (the README's loop);
  step-python, full-python  the same with ``boundary="python"``;
  full-budget  ``full`` with ``overhead_budget=0.01``;
  full-energy-off  ``full`` without the energy sampler (``energy_every_s=None``; ``full`` and the
               others run with the default, a read of NVML's energy counter every 0.5 s on a
               thread of its own).  The sampler runs by the clock through every variant's
               rounds, so the ratio of ``full`` to this one shows what energy adds per step
               (held records, their energy figures), not the sampler's reads, which every
               variant shares;
  full-explained  ``full`` with ``explain_peak=True``: its first step (in the warm-up, before any
               round) is explained; the rounds show what the later steps pay (nothing, by design);
  profiler     the bare step under torch.profiler (CPU+CUDA activities), trace
               post-processing (its exit and key_averages()) excluded and reported apart;
  with --ablate, the full loop with one setting changed (ABLATIONS below).
Each round times K steps of one variant between two synchronisations (the
host clock is honest there: the queue is drained at both ends).  The table
gives the median per-step time and, per variant, the median over rounds of
its ratio to the bare loop of the same round, with a 95% bootstrap interval of
that median (the run's precision) and p10-p90 (single rounds' spread), and the
process CPU time it added per step (both threads, less sensitive to the host's
scheduling noise than wall time).  Many short rounds pin the median down better
than few long ones: host noise drifts over seconds.

    python bench/overhead.py [--rounds 20] [--steps 30] [--ablate] [--out overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when a test imports this file
from stepprof._recorder.profiler import _make_profiler  # noqa: E402
from _common import run_info, timed_round  # noqa: E402


def make_workload(width: int, batch: int, depth: int = 8, device: str | torch.device = "cuda",
                  dtype: torch.dtype = torch.bfloat16, wrap=None):
    """The MLP step's three parts; ``wrap`` wraps the model (bench/dist_overhead.py: DDP)."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width, dtype=dtype), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(device)
    if wrap is not None:
        model = wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device=device, dtype=dtype, generator=gen)
    state = {}

    def forward():
        state["loss"] = model(x).float().pow(2).mean()

    def backward():
        state["loss"].backward()

    def optimizer():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return forward, backward, optimizer


def any_step(prof, phased, batch, fwd, bwd, opt):
    """One step: bare (``prof`` None), a step record, or with :func:`phased_step`'s phases."""
    if prof is None:
        fwd(); bwd(); opt()  # noqa: E702
    elif phased:
        phased_step(prof, batch, fwd, bwd, opt)
    else:
        with prof.step(batch_size=batch):
            fwd(); bwd(); opt()  # noqa: E702


def phased_step(prof, batch, fwd, bwd, opt):
    """One step with forward/backward/optimizer phases: the README's loop."""
    with prof.step(batch_size=batch):
        with prof.measure("forward"):
            fwd()
        with prof.measure("backward"):
            bwd()
        with prof.measure("optimizer"):
            opt()


def quantiles(xs):
    s = sorted(xs)
    if len(s) < 2:  # one round (a smoke run): no spread
        return {"median": s[0], "p10": s[0], "p90": s[0]}
    q = statistics.quantiles(s, n=10, method="inclusive")
    return {"median": statistics.median(s), "p10": q[0], "p90": q[-1]}


def median_ci(xs, n_boot: int = 2000, seed: int = 0):
    """95% bootstrap interval of the median: how precisely this run pins the median down."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n_boot))
    return [meds[int(0.025 * n_boot)], meds[int(0.975 * n_boot)]]


#: Profiler settings per variant.  ``boundary="auto"`` is the compiled boundary once
#: ``stepprof build`` has built it (the JSON says which ran: ``boundary``).
VARIANTS = {
    "step": {},
    "full": {},
    "step-python": {"boundary": "python"},
    "full-python": {"boundary": "python"},
    "full-budget": {"overhead_budget": 0.01},
    "full-energy-off": {"energy_every_s": None},
    "full-explained": {"explain_peak": True},
}
#: With --ablate: one feature changed at a time, to attribute the full loop's cost.
ABLATIONS = {
    "full-inline": {"collect_every_s": None},
    "full-every-20ms": {"collect_every_s": 0.02},
    "step-every-20ms": {"collect_every_s": 0.02},
    "full-every-phase-peak": {"phase_peaks_every": 1},
    "full-no-syncs": {"syncs": "off"},
    "full-no-nvtx": {"nvtx": False},
}


def _settling(prof):
    """(wait, settle) for ``timed_round``: a profiler's records are written in its own round.

    With energy sampling on CUDA, a step's record waits for the first energy sample after the
    step: the untimed ``wait`` holds the collector (so that its thread writes nothing) until
    that sample has come, then the timed ``settle`` writes the round's records.
    """
    if prof is None:
        return None, None
    energy = prof._energy
    if energy is None or energy.sampler is None:
        return None, prof.flush
    collector = prof._collector

    def wait():
        collector.lock.acquire()
        end = time.perf_counter_ns()
        sampler = energy.sampler
        deadline = time.monotonic() + 10 * energy.every_s + 5
        while sampler.running and (sampler.latest() or 0) < end and time.monotonic() < deadline:
            time.sleep(0.001)

    def settle():
        try:
            collector.harvest()
        finally:
            collector.lock.release()

    return wait, settle


def run(name: str, width: int, batch: int, rounds: int, k: int, tmp: str, profiler: bool = True,
        ablate: bool = False, device: str = "cuda") -> dict:
    cpu = device == "cpu"
    fwd, bwd, opt = make_workload(width, batch, device="cpu", dtype=torch.float32) if cpu else make_workload(width, batch)
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    settings = {**VARIANTS, **(ABLATIONS if ablate else {})}
    profs = {v: _make_profiler(os.path.join(tmp, f"{name}-{v}.jsonl"), **kw) for v, kw in settings.items()}

    def bare():
        fwd(); bwd(); opt()

    def stepped(prof):
        def step():
            with prof.step(batch_size=batch):
                fwd(); bwd(); opt()
        return step

    def phased(prof):
        return lambda: phased_step(prof, batch, fwd, bwd, opt)

    variants = {
        "bare": bare,
        "bare-again": bare,  # an A/A control: its ratio shows the noise floor of the estimate
    }
    for v, prof in profs.items():
        variants[v] = stepped(prof) if v.startswith("step") else phased(prof)
    if profiler:
        variants["profiler"] = bare
    for fn in variants.values():  # warm-up: allocator, cuBLAS handles, Adam state
        for _ in range(10):
            fn()
    sync()
    for prof in profs.values():  # the warm-up's records, before any round
        wait, settle = _settling(prof)
        if wait is not None:
            wait()
        settle()

    per_step = {v: [] for v in variants}
    cpu_per_step = {v: [] for v in variants}
    post_s = []
    rng = random.Random(0)
    for _ in range(rounds):
        order = list(variants)
        rng.shuffle(order)
        for v in order:
            fn = variants[v]
            if v == "profiler":
                acts = [torch.profiler.ProfilerActivity.CPU] + ([] if cpu else [torch.profiler.ProfilerActivity.CUDA])
                p = torch.profiler.profile(activities=acts)
                p.__enter__()
            # stepprof's variants write their round's last records before the clock stops:
            # left to the collector thread, they would be written during the next round.
            prof = profs.get(v)
            wait, settle = _settling(prof)
            wall_us, cpu_us = timed_round(fn, k, sync, settle, wait)
            if v == "profiler":
                # The post-processing: the exit stops the trace and collects its events
                # (CUPTI's buffers flushed, kineto's results built), key_averages() parses them.
                t2 = time.perf_counter()
                p.__exit__(None, None, None)
                p.key_averages()
                post_s.append(time.perf_counter() - t2)
            per_step[v].append(wall_us)
            cpu_per_step[v].append(cpu_us)
    summaries = {v: p.close() for v, p in profs.items()}

    out = {"width": width, "batch": batch, "rounds": rounds, "steps_per_round": k,
           "settings": settings, "variants": {}}
    for v, xs in per_step.items():
        ratios = [x / b for x, b in zip(xs, per_step["bare"])]
        added = [x - b for x, b in zip(xs, per_step["bare"])]
        cpu_added = [x - b for x, b in zip(cpu_per_step[v], cpu_per_step["bare"])]
        out["variants"][v] = {
            "us_per_step": quantiles(xs),
            "ratio_to_bare": {**quantiles(ratios), "median_ci95": median_ci(ratios)},
            "added_us": quantiles(added),
            "process_cpu_us_per_step": quantiles(cpu_per_step[v]),
            "process_cpu_added_us": quantiles(cpu_added),
        }
    out["stepprof_overhead_us_median"] = {v: s.overhead_us_median for v, s in summaries.items()}
    out["stepprof_overhead_us_mean"] = {v: s.overhead_us_mean for v, s in summaries.items()}
    out["boundary"] = {v: s.boundary for v, s in summaries.items()}
    out["gpu_steps"] = {v: [s.gpu_steps, s.measured_steps] for v, s in summaries.items()}
    out["stepprof_gpu_ms_median"] = {v: s.gpu_ms.median if s.gpu_ms is not None else None
                                     for v, s in summaries.items()}
    if not profiler:
        return out
    out["profiler_postprocess_s_median"] = statistics.median(post_s)
    # torch.profiler's trace processing runs in the training process too: per profiled step,
    # it costs post-processing time / steps profiled, on top of the in-loop slowdown.
    out["profiler_added_us_with_postprocess"] = (
        out["variants"]["profiler"]["added_us"]["median"] + statistics.median(post_s) / k * 1e6
    )
    add = {v: out["variants"][v]["added_us"]["median"] for v in variants}
    out["profiler_added_over_stepprof"] = {
        v: (add["profiler"] / add[v] if add[v] > 0 else None) for v in profs
    }
    out["profiler_with_postprocess_over_stepprof"] = {
        v: (out["profiler_added_us_with_postprocess"] / add[v] if add[v] > 0 else None) for v in profs
    }
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=30, help="steps per variant per round")
    ap.add_argument("--out", default="overhead.json")
    ap.add_argument("--no-profiler", action="store_true",
                    help="leave torch.profiler out (its trace post-processing dominates the run time)")
    ap.add_argument("--workloads", default="compute-bound,launch-bound",
                    help="comma-separated subset of compute-bound,launch-bound")
    ap.add_argument("--ablate", action="store_true",
                    help="add variants of the full loop with one feature changed (see ABLATIONS)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: the launch-bound step's shape in fp32 on the CPU (a host-only check)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/overhead.py needs CUDA (or --device cpu); nothing measured")
        return 0
    results = {**run_info("overhead.py", gpu="cpu" if args.device == "cpu" else None), "workloads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        chosen = args.workloads.split(",")
        for name, width, batch in (("compute-bound", 4096, 4096), ("launch-bound", 256, 64)):
            if name in chosen:
                results["workloads"][name] = run(
                    name, width, batch, args.rounds, args.steps, tmp, profiler=not args.no_profiler,
                    ablate=args.ablate, device=args.device,
                )

    print(f"{results['gpu']}, torch {results['torch']}, {args.rounds} interleaved rounds x {args.steps} steps")
    print(f"{'workload':14s} {'variant':22s} {'µs/step':>9s} {'added µs':>9s} {'ratio':>7s} "
          f"{'95% CI of ratio':>16s} {'p10-p90':>14s} {'cpu+ µs':>8s} {'overhead_us':>11s} {'profiler/this':>13s}")
    for name, w in results["workloads"].items():
        for v, r in w["variants"].items():
            rt = r["ratio_to_bare"]
            ci = rt["median_ci95"]
            ovh = w["stepprof_overhead_us_mean"].get(v)
            f = w.get("profiler_added_over_stepprof", {}).get(v)
            print(f"{name:14s} {v:22s} {r['us_per_step']['median']:9.1f} {r['added_us']['median']:9.1f} "
                  f"{rt['median']:7.4f} {ci[0]:7.4f}-{ci[1]:.4f} {rt['p10']:6.4f}-{rt['p90']:.4f} "
                  f"{r['process_cpu_added_us']['median']:8.1f} "
                  f"{'' if ovh is None else f'{ovh:.1f}':>11s} {'' if f is None else f'{f:.1f}x':>13s}")
        if "profiler_postprocess_s_median" not in w:
            continue
        pp = w["profiler_with_postprocess_over_stepprof"]
        print(f"{name:14s} torch.profiler trace post-processing {w['profiler_postprocess_s_median']:.2f} s per "
              f"round of {w['steps_per_round']} steps: with it, torch.profiler adds "
              f"{w['profiler_added_us_with_postprocess']:.0f} µs/step = "
              + ", ".join(f"{v} {x:.0f}x" for v, x in pp.items() if x is not None))
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
