"""The diagnoses: one function per thing the report detects, each with its evidence and remedies.

Each takes a run's report (its figures and tables) and returns a :class:`Diagnosis`
when it finds what it looks for, a ``str`` saying why it could not tell (listed
under "Not diagnosed"), or None when it looked and nothing stands out.
"""

from __future__ import annotations

from typing import Any

from .._rules import SPIKE_FACTOR
from .._units import MiB, format_bytes
from .model import Diagnosis, RunReport, Spike, Spikes

__all__ = [
    "HOST_BOUND_BUSY",
    "SPIKE_FACTOR",
    "diagnose",
    "fragmentation",
    "gpu_bound",
    "host_bound",
    "memory_headroom",
    "roofline_class",
    "spike_period",
    "spikes",
    "sync_heavy",
]

#: gpu_busy below this: the GPU finished the step's work well before the host.
HOST_BOUND_BUSY = 0.9
#: gpu_busy above this: the host left the step before the GPU finished it.
GPU_BOUND_BUSY = 1.1

_SYNC_REMEDY = {
    "item": "keep the value on the GPU and read it every N steps (e.g. accumulate the loss in a tensor)",
    "tolist": "read the list every N steps, or keep it on the GPU",
    "to_host": "copy with .to('cpu', non_blocking=True) into pinned memory and read it a step later",
    "to_device": "copy from pinned memory with non_blocking=True",
    "bool": "avoid Python control flow on GPU values: use torch.where, or check every N steps",
    "scalar": "avoid float()/int() of GPU values in the step: keep them as tensors",
    "nonzero": "use torch.nonzero_static(size=...) or masks that keep the shape",
    "mask_index": "use torch.where(mask, x, 0) or masked_fill instead of x[mask]",
    "masked_select": "use torch.where / masked_fill, which keep the shape",
    "unique": "use a fixed-size alternative or move it out of the step",
    "repeat_interleave": "pass output_size= to repeat_interleave",
    "print": "log tensors every N steps, not every step",
    "device_synchronize": "remove torch.cuda.synchronize() from the step (stepprof times the GPU without it)",
    "stream_synchronize": "wait on an event for the work you need, not the whole stream",
    "event_synchronize": "poll event.query() or move the wait out of the step",
    "backward": (
        "a sync inside autograd: check custom autograd functions and clip_grad_norm_(error_if_nonfinite=True)"
    ),
}

_ROOFLINE_REMEDY = {
    "compute-bound": [
        "the matmuls dominate: bf16 (or fp8) if not used yet, fewer recomputed "
        "FLOPs (activation checkpointing costs a forward)"
    ],
    "memory-bound": [
        "fuse elementwise ops (torch.compile)",
        "keep activations in bf16",
        "larger matmuls (bigger hidden sizes or batches) raise the intensity",
    ],
    "memory-bound-compiled": [
        "keep activations in bf16",
        "larger matmuls (bigger hidden sizes or batches) raise the intensity",
        "look for kernels inductor left unfused (TORCH_LOGS=output_code), and graph breaks between them",
    ],
    "host-bound-compiled": [
        "a larger batch",
        "CUDA graphs for the compiled step (mode='reduce-overhead'), if it does not use them yet",
        "fewer graph breaks: each one returns to Python",
    ],
    "host-bound": [
        "a larger batch",
        "torch.compile(mode='reduce-overhead') / CUDA graphs",
        "fuse small ops",
    ],
}

#: The share of the loop spent before steps (``input_wait_fraction``) that makes it input-bound.
INPUT_BOUND_FRACTION = 0.2

_INPUT_REMEDY = (
    "DataLoader(num_workers=N): load batches in worker processes (start near the CPU cores each training process has)",
    "DataLoader(pin_memory=True) with .to(device, non_blocking=True): copies overlap compute",
    "DataLoader(persistent_workers=True): workers survive between epochs",
    "DataLoader(prefetch_factor=k): more batches in flight per worker",
    "move the transforms to the GPU (decode and augment on the device), or precompute them",
)
#: The input remedies that need a GPU (left out of a CPU run's).
_GPU_INPUT_REMEDY = frozenset((_INPUT_REMEDY[1], _INPUT_REMEDY[4]))

_KINDS = ("input-bound", "host-bound", "sync-heavy", "memory-headroom", "fragmentation", "spikes", "roofline")


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} ms"


def _count_text(x: Any) -> str:
    return f"{x:,}" if type(x) is int else "n/a"


def _bytes(x: float) -> str:
    return format_bytes(int(x))


def diagnose(
    run: RunReport, sweep: dict[str, Any] | None, roofline_reason: str
) -> tuple[tuple[Diagnosis, ...], dict[str, str]]:
    """Every diagnosis of ``run``, in order, and the reason for each one that could not be made.

    Args:
        run: the run's report (its ``diagnoses`` are not read).
        sweep: the result record of the log's last finished sweep, if any.
        roofline_reason: why the run has no roofline class (when it has none).
    """
    if run.measured_steps == 0:
        return (), {kind: "no measured steps" for kind in _KINDS}
    found: list[Diagnosis] = []
    missing: dict[str, str] = {}
    data = input_bound(run)
    if isinstance(data, Diagnosis):
        found.append(data)
    elif data is not None:
        missing["input-bound"] = data
    host = host_bound(run, sweep)
    if isinstance(host, Diagnosis):
        found.append(host)
    else:
        gpu = gpu_bound(run)
        if gpu is not None:
            found.append(gpu)
        elif host is not None:
            missing["host-bound"] = host
    checks = (
        ("sync-heavy", sync_heavy(run)),
        ("memory-headroom", memory_headroom(run, sweep)),
        ("fragmentation", fragmentation(run)),
        ("spikes", spikes(run)),
        ("roofline", roofline_class(run, roofline_reason)),
    )
    for kind, result in checks:
        if isinstance(result, Diagnosis):
            found.append(result)
        elif result is not None:
            missing[kind] = result
    return tuple(found), missing


def input_bound(run: RunReport) -> Diagnosis | str | None:
    """The loop waits between steps: the data wait takes ``INPUT_BOUND_FRACTION`` of its time or more.

    The steady state is the medians' (a typical wait against a typical step); a loop whose waits
    take that share only through a few long ones (workers starting, epoch boundaries, evaluation
    between steps) has input *stalls*, told apart, with their own remedies.  Means go with means.
    """
    f = run.figures
    share = f.input_wait_fraction
    if share is None or f.data_wait_ms is None:
        return run.unavailable.get("input_wait_fraction", "data_wait_ms not recorded")
    if share < INPUT_BOUND_FRACTION:
        return None
    wait = f.data_wait_ms.median
    step = f.wall_ms.median if f.wall_ms is not None else None
    inside, less = f.data_wait_in_step_ms_median, ""
    if step is not None and inside is not None:  # the waits between micro-batches are in both
        step, less = max(0.0, step - inside), f" (less its median {inside:.2f} ms between micro-batches)"
    steady = wait / (wait + step) if step is not None and wait + step > 0 else share
    mean = f.data_wait_ms_mean
    on_gpu = run.device is not None and run.device.startswith("cuda")
    typical = (f"median data_wait_ms {wait:.2f} against a median step of {step:.2f} ms{less}: "
               f"{steady:.0%} of a typical iteration" if step is not None else f"median data_wait_ms {wait:.2f}")
    overall = f"over the run, waits take {share:.0%} of the loop's time" + (
        f" (mean data_wait_ms {mean:.2f}, p90 {f.data_wait_ms.p90:.2f})" if mean is not None else "")
    if steady < INPUT_BOUND_FRACTION:
        title = "Input stalls: a few long waits between steps, not the steady state"
        evidence = [overall, f"{typical}: the rest is in waits far above the median"]
        remedies: tuple[str, ...] = (
            "DataLoader(persistent_workers=True): workers survive between epochs instead of starting again",
            "raise Profiler(warmup=...) past the first steps when the stall is the workers starting",
            "look for work between some steps: evaluation, checkpoints, logging that syncs",
        )
    else:
        title = "Input-bound: the loop waits for its next batch"
        evidence = [typical, overall]
        remedies = _INPUT_REMEDY if on_gpu else tuple(r for r in _INPUT_REMEDY if r not in _GPU_INPUT_REMEDY)
        if f.data_ms_mean is None:
            title = "Input-bound (likely): the loop spends its time between steps"
            evidence.append(
                "without stepprof.iterate(loader) the wait cannot be told apart from other host work "
                "between steps (logging, evaluation, a step body left outside profile_step)"
            )
            remedies = (*remedies, "for batch in stepprof.iterate(loader): separates the loader's time (data_ms)")
    if f.data_ms_mean is not None and mean is not None:
        evidence.append(
            f"of a mean wait of {mean:.2f} ms, a mean {f.data_ms_mean:.2f} ms is spent fetching the batch "
            f"(the loader's __next__, through stepprof.iterate); the rest is other host work between steps"
        )
        if steady >= INPUT_BOUND_FRACTION and f.data_ms_mean < 0.5 * mean:
            title = "Between steps: the loop waits, but mostly not for the loader"
            remedies = ("look at the code between the steps: logging that syncs, evaluation, "
                        "checkpoints, a part of the step left outside profile_step", *remedies)
    if f.gpu_ms is not None and step is not None and wait + step > 0:
        busy = f.gpu_ms.median / (wait + step)
        evidence.append(
            f"the GPU works a median {f.gpu_ms.median:.2f} ms of each {wait + step:.2f} ms iteration: "
            f"idle {max(0.0, 1 - busy):.0%} of the loop"
        )
    return Diagnosis(kind="input-bound", title=title, evidence=tuple(evidence), remedy=remedies)


def host_bound(run: RunReport, sweep: dict[str, Any] | None) -> Diagnosis | str | None:
    """The GPU waits for Python: low ``gpu_busy``, the roofline's host bound, or a batch below the knee."""
    busy = run.figures.gpu_busy_median
    roof = run.roofline
    evidence = []
    if busy is not None and busy < HOST_BOUND_BUSY:
        evidence.append(
            f"median gpu_busy {busy:.2f}: the GPU reached the end of the step's work {1 - busy:.0%} "
            f"of the step before the host did, so it idles at least that share of each step"
        )
    if roof is not None and roof["class"] == "host-bound":
        evidence.append(
            f"roofline: {roof['host_ms']:.2f} ms of per-operation host cost (operations x "
            f"{roof['calibration']['launch_us']:.1f} µs) exceeds the compute ({_ms(roof['compute_ms'])}) "
            f"and memory ({_ms(roof['memory_ms'])}) bounds of a {roof['step_ms']:.2f} ms step"
        )
    batch = run.batch_size
    if sweep is not None and batch is not None and type(sweep.get("knee")) is int and batch < sweep["knee"]:
        evidence.append(
            f"the sweep in this log found the knee at batch {sweep['knee']:,}; at batch {batch:,} the "
            f"GPU is not saturated"
        )
    if evidence:
        return Diagnosis(
            kind="host-bound",
            title="Host-bound: the GPU waits for Python to launch work",
            evidence=tuple(evidence),
            remedy=(
                "a larger batch (more work per launch)",
                "torch.compile(model, mode='reduce-overhead'), which replays CUDA graphs",
                "CUDA graphs (torch.cuda.graphs) for a static step",
                "fuse small ops (torch.compile, fused optimizers: AdamW(fused=True))",
            ) if run.compile is None else (
                "a larger batch (more work per launch)",
                "CUDA graphs for the compiled step (mode='reduce-overhead'), if it does not use them yet",
                "fused optimizers (AdamW(fused=True)), and fewer graph breaks: each one returns to Python",
            ),
        )
    if busy is None:
        return run.unavailable.get("gpu_busy_median", "gpu_busy not recorded")
    if busy > GPU_BOUND_BUSY:
        return None  # gpu_bound() says so
    if roof is not None and roof["class"] in ("compute-bound", "memory-bound") and (roof["explained"] or 0) >= 0.5:
        return (
            f"ruled out: the roofline's {roof['class'].split('-')[0]} bound explains "
            f"{roof['explained']:.0%} of the step"
        )
    return (
        f"median gpu_busy {busy:.2f} is close to 1, which fits both a host-bound loop and a "
        f"GPU-bound one that syncs each step; the roofline (flops='auto' and `stepprof calibrate`) "
        f"or Nsight Systems tells them apart"
    )


def gpu_bound(run: RunReport) -> Diagnosis | None:
    """The host leaves the step before the GPU finishes it (median ``gpu_busy`` above 1.1)."""
    busy = run.figures.gpu_busy_median
    if busy is None or busy <= GPU_BOUND_BUSY:
        return None
    return Diagnosis(
        kind="gpu-bound",
        title="GPU-bound: the GPU is the bottleneck",
        evidence=(f"median gpu_busy {busy:.2f}: the host left the step before the GPU finished it",),
        remedy=("see the roofline class below for what limits the GPU",),
    )


def sync_heavy(run: RunReport) -> Diagnosis | str | None:
    """The host waits for the GPU inside the step: a median of one sync or more per step."""
    table = run.syncs
    if table is None:
        return run.unavailable.get("syncs_per_step", "syncs not recorded")
    syncs = run.figures.syncs_per_step
    median = syncs.median if syncs is not None else None
    if median is None or median < 1:
        return None
    evidence = [f"median {median:g} sync(s) per step over {table.steps_counted:,} steps"]
    remedies: list[str] = []
    for site in table.sites[:5]:
        evidence.append(f"{site.where}: {site.kind} `{site.code or '?'}`, {site.per_step:.2f} per step")
        tip = _SYNC_REMEDY.get(site.kind)
        if tip and tip not in remedies:
            remedies.append(f"{site.kind} at {site.where}: {tip}")
    remedies.append("profile_step(max_syncs=0, on_sync='raise') stops at the line that syncs")
    return Diagnosis(
        kind="sync-heavy",
        title="Sync-heavy: the host waits for the GPU inside the step",
        evidence=tuple(evidence),
        remedy=tuple(remedies),
    )


def memory_headroom(run: RunReport, sweep: dict[str, Any] | None) -> Diagnosis | str:
    """How much more the batch could grow: usable memory against the peak, and the sweep's verdict."""
    mem = run.memory
    peak = mem.peak_allocated_bytes_max
    if peak is None:
        return run.unavailable.get("peak_allocated_bytes", "no peak memory in the log")
    total = mem.total_bytes
    batch = run.batch_size
    evidence: list[str] = []
    remedy: list[str] = []
    if total is not None:
        # Unknown is not 0; a negative residual (MPS, MIG, a driver change) is about 0 (memory.md).
        residual = None if mem.residual_bytes is None else max(0.0, mem.residual_bytes)
        others = 0.0
        if mem.device_used_bytes is not None and mem.nvml_process_bytes is not None:
            others = max(0.0, mem.device_used_bytes - mem.nvml_process_bytes)
        usable = total - (residual or 0.0) - others
        headroom = usable - peak
        context = (
            "CUDA context and other unknown: the last memory record has no residual"
            if residual is None
            else f"{_bytes(residual)} CUDA context and other"
        )
        evidence.append(
            f"peak {_bytes(peak)} of {'at most ' if residual is None else ''}"
            f"{_bytes(usable)} usable by the allocator ({_bytes(total)} total, {context}"
            + (f", {_bytes(others)} other processes" if others else "")
            + ")"
        )
        base = mem.allocated_bytes
        if batch and base is not None and residual is not None and peak > base:
            per_sample = (peak - base) / batch
            fits = int(batch + headroom / per_sample) if headroom > 0 else batch
            evidence.append(
                f"at batch {batch:,} the step adds {_bytes(peak - base)} over the "
                f"{_bytes(base)} held between steps ({_bytes(per_sample)} per sample): "
                f"about batch {fits:,} fits ({fits / batch:.1f}x), if that grows linearly with the batch"
            )
        if sweep is None:
            remedy.append("confirm with stepprof.sweep(), which finds the largest batch that fits and the knee")
    if sweep is not None:
        evidence.append(
            f"the sweep in this log: max_fit {_count_text(sweep.get('max_fit'))}, "
            f"knee {_count_text(sweep.get('knee'))}, recommended {_count_text(sweep.get('recommended'))}"
        )
        if batch is not None and type(sweep.get("recommended")) is int and sweep["recommended"] > 0:
            remedy.append(f"use batch {sweep['recommended']:,} (the sweep's recommendation; now {batch:,})")
    if not evidence:
        return "no memory record in the log (CUDA runs write one after warm-up)"
    return Diagnosis(kind="memory-headroom", title="Memory headroom", evidence=tuple(evidence),
                     remedy=tuple(remedy))


def fragmentation(run: RunReport) -> Diagnosis | str | None:
    """The allocator holds much more than the step ever needed, retries, or keeps calling cudaMalloc."""
    mem = run.memory
    peak = mem.peak_allocated_bytes_max
    if peak is None:
        return run.unavailable.get("peak_allocated_bytes", "no peak memory in the log")
    reserved = mem.reserved_bytes_max
    alloc = run.allocator
    retries = alloc.num_alloc_retries if alloc is not None else 0
    evidence = []
    if reserved is not None and reserved > peak:
        extra = reserved - peak
        if extra > 0.25 * reserved and extra > 512 * MiB:
            evidence.append(
                f"reserved {_bytes(reserved)} against a peak of {_bytes(peak)}: "
                f"{_bytes(extra)} cached that no step needed at once"
            )
    split = mem.inactive_split_bytes
    if split is not None and split > 256 * MiB:
        evidence.append(f"{_bytes(split)} in inactive split blocks (pieces of segments that cannot be freed)")
    if retries:
        evidence.append(
            f"{retries:,} allocation retries in measured steps: cudaMalloc failed and the "
            f"allocator freed its cache and synchronised"
        )
    if alloc is not None and alloc.steps_with_device_alloc > 0.02 * max(1, run.measured_steps):
        evidence.append(
            f"{alloc.steps_with_device_alloc:,} measured steps called cudaMalloc (a steady loop calls none)"
        )
    evidence += [f"memory record: {n}" for n in mem.notes]
    if evidence and (len(evidence) > len(mem.notes) or any("fragment" in n for n in mem.notes)):
        return Diagnosis(
            kind="fragmentation",
            title="Fragmentation and allocator churn",
            evidence=tuple(evidence),
            remedy=(
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (segments grow in place)",
                "keep tensor shapes steady across steps (pad variable lengths to a few sizes)",
                "a slightly smaller batch if allocations retry",
            ),
        )
    if reserved is None:
        return run.unavailable.get("reserved_bytes", "reserved memory not recorded")
    return None


def spikes(run: RunReport) -> Diagnosis | None:
    """Steps that compiled, and steps far above the median: when, whether they recur, and why.

    Compilation is named only in a run whose records carry the compile fields: its steps
    that compiled, with the recompile reasons; its other spikes are "not compilation".  The
    other spikes are then checked for a data wait, syncs and allocator growth, else host noise.
    """
    sp: Spikes | None = run.spikes
    comp = run.compile
    compiled = comp is not None and comp.steps > 0
    if (sp is None or not sp.count) and not compiled:
        return None
    evidence: list[str] = []
    remedy: list[str] = []
    if compiled:
        assert comp is not None
        named = ", ".join(str(s) for s in comp.step_list[:8]) + (", ..." if comp.steps > 8 else "")
        evidence.append(
            f"{comp.steps:,} measured step(s) compiled (torch.compile: {comp.compiles:,} compiles, "
            f"{comp.compile_ms:,.0f} ms in the run, warm-up included): steps {named}; they are left "
            f"out of the figures like warm-up steps"
        )
        for step, why in comp.recompile_reasons[:3]:
            evidence.append(f"step {step} recompiled: {why}")
        if comp.recompile_reasons:
            remedy.append(
                "stop the recompiles: the failed guard names what changed; for a size that varies, "
                "torch._dynamo.mark_dynamic(tensor, dim) or pad to a few sizes"
            )
        else:
            remedy.append("TORCH_LOGS=recompiles prints the reason of each recompile")
    if sp is None or not sp.count:
        return Diagnosis(kind="spikes", title="Spikes: steps that compiled", evidence=tuple(evidence),
                         remedy=tuple(remedy))
    evidence.append(
        f"{sp.count:,} step(s) took more than {SPIKE_FACTOR:g}x the median "
        f"{sp.median_ms:.2f} ms (slowest {sp.max_ms:.2f} ms)"
    )
    if comp is not None:
        evidence.append("not compilation: these steps compiled nothing")
    kept = len(sp.early) + len(sp.late)
    if kept < sp.count:
        evidence.append(f"the {kept:,} slowest are kept in the aggregate: those are listed below")
    if sp.early:
        evidence.append("right after warm-up: steps " + _listed(sp.early))
        remedy.append(
            f"raise Profiler(warmup=...) past step {sp.early[-1].step}, so that start-up work "
            f"(autotuning, caches, allocator growth) stays out of the figures"
        )
    if sp.late:
        evidence.append("later: steps " + _listed(sp.late))
        if sp.period_steps:
            evidence.append(
                f"they recur every {sp.period_steps} steps: periodic work inside the step "
                f"(evaluation, checkpointing, logging)"
            )
            remedy.append("move periodic work out of profile_step, or measure it as its own step name")
    _spike_causes(run, sp, evidence, remedy)
    return Diagnosis(kind="spikes", title="Spikes: steps far above the median", evidence=tuple(evidence),
                     remedy=tuple(remedy))


#: The most spike steps a line of evidence names.
SPIKES_NAMED = 6


def _listed(spikes: tuple[Spike, ...]) -> str:
    """The first :data:`SPIKES_NAMED` spikes, by step, and how many more there are."""
    named = ", ".join(f"{s.step} ({s.ms:.1f} ms)" for s in spikes[:SPIKES_NAMED])
    more = len(spikes) - SPIKES_NAMED
    return named + (f", and {more:,} more" if more > 0 else "")


def _spike_causes(run: RunReport, sp: Spikes, evidence: list[str], remedy: list[str]) -> None:
    """What the spikes' own records show: extra syncs, allocator growth; else host noise, unless
    they recur on a period (then the periodic work already named is the cause).

    A step's data wait is before its entry, outside its time, so it explains no spike.
    """
    spikes = [*sp.early, *sp.late]
    found = False
    syncs = run.figures.syncs_per_step
    usual = syncs.median if syncs is not None else None
    synced = [s for s in spikes if s.syncs is not None and usual is not None and s.syncs > usual]
    if synced:
        found = True
        evidence.append(f"more syncs than the median {usual:g}: " + ", ".join(
            f"step {s.step} ({s.syncs})" for s in synced[:6]))
        remedy.append("a sync that only some steps make (logging, .item(), a check every N steps) "
                      "waits for all the queued GPU work: see the top sync sites")
    if any(s.device_allocs or s.alloc_retries for s in spikes):
        found = True
        evidence.append("called cudaMalloc or retried an allocation: steps " + ", ".join(
            str(s.step) for s in spikes if s.device_allocs or s.alloc_retries))
        remedy.append(
            "the allocator grew there: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and steady "
            "shapes avoid it"
        )
    if not found and not sp.period_steps:
        evidence.append(
            "their records show no extra sync or allocator growth: host noise (Python's "
            "garbage collector, other processes, the OS)"
        )
        remedy.append("gc.freeze() after start-up (or gc.collect() at chosen steps); keep other work off the cores")


def spike_period(steps: list[int]) -> int | None:
    """The period P of spikes that really recur, or None.

    Several spikes (three or more) on evenly spaced steps: the smallest gap P > 1, every gap P
    or a multiple of it up to 3P (a spike or two that stayed under the threshold), and at least
    two gaps and half of them exactly P.  Spikes at 14, 20 and 29 have no period (their gaps, 6
    and 9, share a divisor but are not a spacing).
    """
    if len(steps) < 3:
        return None
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    p = min(gaps)
    exact = gaps.count(p)
    if p <= 1 or exact < 2 or 2 * exact < len(gaps):
        return None
    return p if all(x % p == 0 and x <= 3 * p for x in gaps) else None


def roofline_class(run: RunReport, roofline_reason: str) -> Diagnosis | str:
    """What bounds the step: compute, memory or host, from the FLOPs and the calibration."""
    roof = run.roofline
    if roof is None or roof["class"] is None:
        return roofline_reason
    cls = roof["class"]
    bw = roof["calibration"]["copy_gbps"]  # checked by build.read_calibration: a number > 0, or None
    evidence = [
        f"{_ms(roof['compute_ms'])} compute bound (FLOPs at the calibrated matmul rates), "
        f"{_ms(roof['memory_ms'])} memory bound (operation bytes at "
        + (f"{bw:,.0f} GB/s), " if bw is not None else "a copy bandwidth the calibration lacks), ")
        + f"{_ms(roof['host_ms'])} host bound, against a {roof['step_ms']:.2f} ms step"
    ]
    mfu = run.figures.mfu_median
    if mfu is not None:
        evidence.append(f"MFU {mfu:.1%} of this GPU's calibrated (measured, not datasheet) peak")
    sheet = run.figures.mfu_datasheet_median
    if sheet is not None:
        evidence.append(f"MFU {sheet:.1%} of its published dense peak (the datasheet's, as papers report it)")
    if roof["arithmetic_intensity"] is not None and roof["ridge"] is not None:
        evidence.append(
            f"arithmetic intensity {roof['arithmetic_intensity']:.0f} FLOP/byte against a ridge of "
            f"{roof['ridge']:.0f} (operation bytes count each op's inputs and outputs: an upper "
            f"bound for fused kernels)"
        )
    caveat = roof.get("caveat")
    if caveat:
        evidence.append(caveat)
    if roof["explained"] is not None and roof["explained"] < 0.5:
        evidence.append(
            f"the largest bound explains only {roof['explained']:.0%} of the step: the rest is "
            f"idle time (syncs, data waits, small kernels below their bound)"
        )
    compiled = run.compile is not None or roof.get("caveat") is not None
    remedy = _ROOFLINE_REMEDY.get(f"{cls}-compiled" if compiled else cls, _ROOFLINE_REMEDY.get(cls, []))
    return Diagnosis(kind="roofline", title=f"Roofline: {cls}" if cls else "Roofline", evidence=tuple(evidence),
                     remedy=tuple(remedy))
