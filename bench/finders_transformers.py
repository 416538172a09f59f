"""Hugging Face's auto_find_batch_size against stepprof's HF sweep, on BERT-base (from its config).

Workload: BertForSequenceClassification(BertConfig()) (BERT-base, no download), sequence 128,
random token ids of the real range (never zeros), bf16, AdamW (the Trainer's defaults).
Methods, each on a fresh Trainer after gc.collect() and empty_cache():
  hf        TrainingArguments(auto_find_batch_size=True, per_device_train_batch_size=--hf-start):
            the Trainer runs its training loop under accelerate's find_executable_batch_size,
            which shrinks the batch on each out-of-memory error (x0.9 in accelerate >= 1.x,
            halving before) until a step runs.  Its time: from train() to the end of the first
            step that ran; every size it tried is recorded.
  stepprof  stepprof.integrations.transformers.sweep(trainer, time_budget_s=--budget-s).
Then samples/s at each picked batch: the same step the sweep times (the Trainer's
training_step under its autocast, clipping, AdamW, zero_grad) on real collated batches,
--rounds rounds interleaved (order alternating), --warmup untimed steps per size first, each
round --steps steps between two CUDA events; the median over rounds.

    python bench/finders_transformers.py [--hf-start 4096] [--budget-s 75] [--out FILE]
    python bench/finders_transformers.py --quick   # on the CPU: a tiny BERT, an out-of-memory
                                                   # error above 24 samples (no figures)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import accelerate  # noqa: E402
import transformers  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from _common import run_info  # noqa: E402 - bench/ is on sys.path when a script in it runs
from stepprof.integrations.transformers import _batch_maker, sweep  # noqa: E402

SEQ = 128


class Samples(torch.utils.data.Dataset):
    """Random token ids of the real range, full attention masks, random labels."""

    def __init__(self, n: int, vocab: int, seq: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1000 if vocab > 2000 else 1, vocab, (n, seq), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        self.seq = seq

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(self.seq, dtype=torch.long),
                "labels": self.labels[i]}


class FakeOom:
    """--quick: the model's forward raises CUDA's out-of-memory error above ``limit`` samples."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __call__(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {ids.shape[0]} samples (simulated).")


def make_trainer(quick: bool, out_dir: str, **args_kw) -> Trainer:
    torch.manual_seed(0)
    cfg = (BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64) if quick else BertConfig())
    model = BertForSequenceClassification(cfg)
    if quick:
        model.register_forward_pre_hook(FakeOom(24), with_kwargs=True)
    settings = dict(output_dir=out_dir, report_to=[], save_strategy="no", disable_tqdm=True,
                    dataloader_num_workers=0, use_cpu=quick, bf16=not quick, max_steps=1)
    settings.update(args_kw)
    seq = 16 if quick else SEQ
    return Trainer(model=model, args=TrainingArguments(**settings),
                   train_dataset=Samples(8192 if not quick else 256, cfg.vocab_size, seq))


def free(*objs) -> None:
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class Tried(TrainerCallback):
    """Each size the finder starts a loop at, and the moment its first step ends (then stop)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.done_at: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.sizes.append(state.train_batch_size)

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.done_at = time.perf_counter()
        control.should_training_stop = True


def run_hf(quick: bool, start: int, out_dir: str) -> dict:
    trainer = make_trainer(quick, out_dir, auto_find_batch_size=True, per_device_train_batch_size=start)
    tried = Tried()
    trainer.add_callback(tried)
    t0 = time.perf_counter()
    trainer.train()
    picked = trainer._train_batch_size
    result = {"picked": picked, "tried": tried.sizes, "wall_s": (tried.done_at or time.perf_counter()) - t0}
    free(trainer)
    return result


def run_stepprof(quick: bool, budget_s: float, out_dir: str) -> dict:
    trainer = make_trainer(quick, out_dir)
    opts = dict(max_batch=32, min_time_s=0.0, steps=1, warmup=0) if quick else dict(time_budget_s=budget_s)
    t0 = time.perf_counter()
    result = sweep(trainer, progress=print, **opts)
    wall = time.perf_counter() - t0
    out = {"picked": result.recommended, "knee": result.knee, "max_fit": result.max_fit,
           "first_oom": result.first_oom, "stopped": result.stopped, "reason": result.reason,
           "thrash_zone": None if result.thrash_zone is None else [result.thrash_zone.start, result.thrash_zone[-1]],
           "trials": result.trials, "wall_s": wall,
           "points": [{"batch_size": p.batch_size, "oom": p.oom, "samples_per_s": p.samples_per_s}
                      for p in result.points]}
    free(trainer)
    return out


def throughput(quick: bool, sizes: list[int], rounds: int, steps: int, warmup: int, out_dir: str) -> dict[int, dict]:
    """Median samples/s of the sweep's own step at each size: interleaved rounds, CUDA events."""
    trainer = make_trainer(quick, out_dir)
    model, opt = trainer.model, trainer.create_optimizer()
    accelerator, max_norm = trainer.accelerator, trainer.args.max_grad_norm
    trainer.current_gradient_accumulation_steps = 1
    make_batch = _batch_maker(trainer, trainer.train_dataset)
    cuda = torch.cuda.is_available() and not quick

    def step(batch):
        with accelerator.autocast():
            trainer.training_step(model, batch)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        model.zero_grad()

    batches = {n: make_batch(n) for n in sizes}
    per: dict[int, list[float]] = {n: [] for n in sizes}
    failed: dict[int, str] = {}

    def timed(n: int, k: int) -> float | None:
        """Samples/s over ``k`` steps at ``n`` (None once ``n`` ran out of memory here)."""
        if n in failed:
            return None
        try:
            if cuda:
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(k):
                    step(batches[n])
                b.record()
                b.synchronize()
                ms = a.elapsed_time(b)
            else:
                t0 = time.perf_counter()
                for _ in range(k):
                    step(batches[n])
                ms = (time.perf_counter() - t0) * 1e3
        except torch.OutOfMemoryError as e:  # near the limit, the other size's cached blocks
            failed[n] = str(e).splitlines()[0]
            model.zero_grad()
            free()
            return None
        return n * k / (ms / 1e3)

    for n in sizes:
        timed(n, warmup)
    for r in range(rounds):
        for n in (sizes if r % 2 == 0 else sizes[::-1]):
            rate = timed(n, steps)
            if rate is not None:
                per[n].append(rate)
    free(trainer, batches)
    return {n: ({"median": statistics.median(v), "min": min(v), "max": max(v)} if v and n not in failed
                else {"median": None, "oom": failed.get(n)}) for n, v in per.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-start", type=int, default=4096, help="auto_find_batch_size's starting batch")
    p.add_argument("--budget-s", type=float, default=75.0, help="the stepprof sweep's time_budget_s")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, simulated OOM, no figures")
    p.add_argument("--out", default=None, help="the JSON result (default: bench/results/finders_transformers-<date>.json)")
    a = p.parse_args(argv)
    quick = a.quick or not torch.cuda.is_available()
    if quick:
        a.hf_start, a.rounds, a.steps, a.warmup = 32, 2, 2, 1
    work = tempfile.mkdtemp(prefix="finders_hf_")
    hf = run_hf(quick, a.hf_start, work)
    sp = run_stepprof(quick, a.budget_s, work)
    sizes = sorted({hf["picked"], sp["picked"]} - {None})
    rates = throughput(quick, sizes, a.rounds, a.steps, a.warmup, work)
    best = max((r["median"] for r in rates.values() if r["median"] is not None), default=None)
    rows = []
    for name, res in (("hf auto_find_batch_size", hf), ("stepprof sweep", sp)):
        rate = rates.get(res["picked"], {}).get("median")
        rows.append({"method": name, "picked": res["picked"], "finder_wall_s": res["wall_s"],
                     "samples_per_s": rate, "vs_best": None if rate is None or not best else rate / best})
    print(f"\n{'method':<26}{'batch':>7}{'finder s':>10}{'samples/s':>12}{'vs best':>9}")
    for r in rows:
        rate = "-" if r["samples_per_s"] is None else f"{r['samples_per_s']:.0f}"
        vs = "-" if r["vs_best"] is None else f"{r['vs_best']:.1%}"
        print(f"{r['method']:<26}{r['picked']!s:>7}{r['finder_wall_s']:>10.1f}{rate:>12}{vs:>9}")
    print(f"hf tried {hf['tried']}; stepprof knee {sp['knee']}, max_fit {sp['max_fit']}, "
          f"thrash zone {sp['thrash_zone']}: {sp['reason']}")
    out = {
        **run_info("finders_transformers.py", gpu="cpu (--quick)" if quick else None),
        "transformers": transformers.__version__, "accelerate": accelerate.__version__,
        "quick": quick, "model": "tiny BERT" if quick else "BERT-base (BertConfig())", "seq": 16 if quick else SEQ,
        "hf": hf, "stepprof": sp, "throughput": {str(n): v for n, v in rates.items()}, "rows": rows,
    }
    path = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                 f"finders_transformers-{'cpu-quick' if quick else 'h200'}-{time.strftime('%Y-%m-%d')}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
